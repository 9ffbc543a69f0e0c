"""Iteration-level scheduler: which sequences compute how many tokens this step.

The step loop is a protocol over plain data (ORCA)::

    plan = scheduler.schedule()          # None: nothing to run
    result = runner.run(plan)            # tokens sampled for sequences that finished a chunk
    finished = scheduler.update(plan, result)

Policy, every step, under a token budget (``max_num_batched_tokens``):
1. Running sequences in arrival order: each gets its remaining tokens (1 when decoding, a
   chunk of the prompt otherwise). If blocks run out, the newest running sequence is
   preempted (blocks freed, recomputed later from its tokens) until the older one fits.
2. If nothing was preempted, waiting sequences are admitted in order while the budget,
   ``max_num_seqs`` and the free blocks allow; a prefix-cache hit skips computed blocks,
   and so does a block that a sequence scheduled before it fills in this same step.
Finished and aborted sequences leave at once and free their blocks.

With speculative decoding (``engine.spec_decode``) a decoding sequence that finds an n-gram
draft computes its last token and the draft in one step (``ScheduledSeq.draft``), when the
budget and the blocks allow, and keeps what the sampler accepted (:meth:`Scheduler.update`).

"Order" is arrival under the ``fcfs`` policy. Under ``priority`` (vLLM's) it is
``(params.priority, arrival)``: both queues are kept in that order, so budget goes to the
most urgent first and preemption takes the least urgent, and before a step the least urgent
running sequences are preempted while the first waiting one is more urgent and finds no seat
or no blocks for its first chunk.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kvrelay.engine.block_manager import BlockManager
from kvrelay.engine.config import SchedulerConfig
from kvrelay.engine.sequence import Sequence, SequenceStatus
from kvrelay.engine.spec_decode import TokenHistory, ngram_draft
from kvrelay.protocol.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from kvrelay.cachetier.block_hash import BlockHash
    from kvrelay.protocol.sampling_params import TokenLogprobs


class ExternalPrefix(NamedTuple):
    """Blocks found below the device cache for a prefix of a sequence's next block hashes."""

    start_block: int  # index of the first block it covers
    num_blocks: int
    blocks_by_tier: dict[str, int]
    payloads: Any  # opaque to the scheduler; the loader writes them into blocks


class PrefixLoader(Protocol):
    """The scheduler's view of the cache tiers (the engine implements it over the KV pool)."""

    def fetch(self, keys: list[BlockHash], start_block: int) -> ExternalPrefix | None:
        """Looks the keys up in the tiers below the device; None or a prefix of them."""

    def write(self, prefix: ExternalPrefix, block_ids: list[int]) -> None:
        """Copies the fetched blocks into ``block_ids`` of the device pool."""


class ScheduledSeq(NamedTuple):
    seq: Sequence
    start: int  # first position computed this step (== seq.num_computed_tokens)
    num_new_tokens: int  # tokens computed this step, the draft's included
    draft: tuple[int, ...] = ()  # speculative tokens after the sequence's last one

    @property
    def needs_sample(self) -> bool:
        """The chunk reaches the end of the sequence's tokens, so a token is sampled (one
        for each of the draft's rows too). A pooled (embedding) sequence never samples."""
        end = self.start + self.num_new_tokens - len(self.draft)
        return end == self.seq.num_tokens and self.seq.pool is None


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: tuple[ScheduledSeq, ...]
    num_batched_tokens: int
    preempted: tuple[str, ...] = ()


class StepResult(NamedTuple):
    """Per scheduled sequence (same order as the plan): the tokens it gains, none when its
    chunk sampled nothing, one, or with a draft the accepted ones and the next (at most
    ``len(draft) + 1``); :meth:`Scheduler.update` cuts the lists at a stop."""

    token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs | None]]


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        eos_token_ids: Iterable[int] = (),
        prefix_loader: PrefixLoader | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.config = config
        self.speculative = speculative
        # speculative decoding's counters: steps with a draft, draft tokens, accepted ones
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.block_manager = block_manager
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self.num_preemptions = 0
        self.prefix_loader = prefix_loader
        self._external: dict[str, ExternalPrefix] = {}  # fetched for a waiting sequence
        self._by_priority = config.scheduling_policy == "priority"
        self._num_arrived = 0  # sequences added: the next one's Sequence.arrival_index

    # ------------------------------------------------------------------ queue
    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._by_id:
            raise ValueError(f"duplicate request id {seq.seq_id!r}")
        self._by_id[seq.seq_id] = seq
        self._arrive(seq)
        self._queue(seq)

    def add_running(self, seq: Sequence) -> None:
        """Adds a sequence whose KV is already in its blocks (a decode-side import).

        ``seq.block_ids`` must hold ``seq.num_computed_tokens`` tokens of KV; the caller
        checked ``can_take_running`` and gave the blocks' references to the sequence.
        """
        if seq.seq_id in self._by_id:
            raise ValueError(f"duplicate request id {seq.seq_id!r}")
        self._by_id[seq.seq_id] = seq
        self._arrive(seq)
        seq.status = SequenceStatus.RUNNING
        if self._by_priority:
            bisect.insort(self.running, seq, key=self._rank)
        else:
            self.running.append(seq)
        self.block_manager.cache_full_blocks(seq)

    def _arrive(self, seq: Sequence) -> None:
        seq.arrival_index = self._num_arrived
        self._num_arrived += 1

    @staticmethod
    def _rank(seq: Sequence) -> tuple[int, int]:
        """Its place in the queues under the priority policy: urgency, then arrival."""
        return seq.params.priority, seq.arrival_index

    def _queue(self, seq: Sequence, front: bool = False) -> None:
        """Puts ``seq`` in the waiting queue: last (``front``: first) in arrival order, at
        its rank under the priority policy."""
        if not self._by_priority:
            if front:
                self.waiting.appendleft(seq)
            else:
                self.waiting.append(seq)
            return
        bisect.insort(self.waiting, seq, key=self._rank)

    def can_take_running(self) -> bool:
        return len(self.running) < self.config.max_num_seqs

    def detach(self, seq_id: str) -> Sequence | None:
        """Removes a running sequence without freeing its blocks (a prefill hand-off).

        The caller now owns one reference to each of ``seq.block_ids`` and must give them
        back with ``block_manager.release``.
        """
        seq = self._by_id.get(seq_id)
        if seq is None or seq.status is not SequenceStatus.RUNNING:
            return None
        del self._by_id[seq_id]
        self.running.remove(seq)
        return seq

    def get(self, seq_id: str) -> Sequence | None:
        return self._by_id.get(seq_id)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_prefill_work(self) -> bool:
        """A prompt waits or is partly computed (chunked, or recomputed after a preemption)."""
        return bool(self.waiting) or any(s.is_prefill for s in self.running)

    def num_prefill_tokens(self) -> int:
        """Prompt tokens still to compute: the rest of each running prompt (chunked, or
        recomputed after a preemption) and each waiting prompt less its device-cached prefix
        (a lower tier may hold more; that is found at admission). The router's placement
        weighs a cache hit against this queue (``LoadReport.num_prefill_tokens``)."""
        num = sum(s.num_tokens - s.num_computed_tokens for s in self.running if s.is_prefill)
        bm = self.block_manager
        for seq in self.waiting:
            num += seq.num_tokens - len(bm.find_cached_prefix(seq)) * bm.block_size
        return num

    def finish(self, seq_id: str, status: SequenceStatus) -> Sequence | None:
        """Ends a sequence now (abort, stop string) and frees its blocks; None if unknown."""
        seq = self._by_id.pop(seq_id, None)
        self._external.pop(seq_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free(seq)
        seq.status = status
        return seq

    # ------------------------------------------------------------------ step
    def schedule(self) -> StepPlan | None:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[str] = []
        if self._by_priority:
            self._make_room_for_waiting(preempted)
        made_room = len(preempted)
        queue = deque(self.running)
        kept: list[Sequence] = []
        spec = self.speculative
        drafting = spec is not None and (
            spec.disable_by_batch_size is None or len(queue) < spec.disable_by_batch_size
        )
        while queue and budget > 0:
            seq = queue.popleft()
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            sampling = num_new == 1 and seq.pool is None
            draft = self._draft(seq, budget) if drafting and sampling else ()
            # a draft's blocks only where every sequence after it keeps a block to grow into
            if draft and (
                self.block_manager.blocks_needed(seq, 1 + len(draft))
                > self.block_manager.num_free_blocks - len(queue)
                or not self.block_manager.allocate(seq, 1 + len(draft))
            ):
                draft = ()  # decode one token
            if not self._allocate_or_preempt(seq, num_new, queue, preempted):
                break
            num_new += len(draft)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new, draft))
            kept.append(seq)
            budget -= num_new
        kept.extend(queue)
        self.running = kept
        if len(preempted) == made_room:  # no block ran out for a running sequence
            budget -= self._admit_waiting(budget, scheduled)
            if self._by_priority:
                self.running.sort(key=self._rank)
        if not scheduled:
            return None
        num_tokens = self.config.max_num_batched_tokens - budget
        return StepPlan(tuple(scheduled), num_tokens, tuple(preempted))

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """An n-gram draft for a decoding sequence, cut to the budget, its max_tokens and the
        context window (the step may add the draft and one more token); () for none."""
        spec = self.speculative
        assert spec is not None
        room = min(
            spec.num_speculative_tokens,
            budget - 1,
            self.config.max_model_len - seq.num_tokens - 1,
        )
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)
        if room < 1:
            return ()
        if seq.spec_history is None:
            seq.spec_history = TokenHistory()
        tokens = seq.spec_history.sync(seq.token_ids)
        return tuple(ngram_draft(tokens, room, spec.prompt_lookup_min, spec.prompt_lookup_max))

    def _allocate_or_preempt(
        self, seq: Sequence, num_new: int, queue: deque[Sequence], preempted: list[str]
    ) -> bool:
        """Allocates for ``seq``, preempting the newest running sequences as needed."""
        while not self.block_manager.allocate(seq, num_new):
            victim = queue.pop() if queue else seq
            self._preempt(victim)
            preempted.append(victim.seq_id)
            if victim is seq:
                return False
        return True

    def _make_room_for_waiting(self, preempted: list[str]) -> None:
        """Priority policy: preempts the least urgent running sequences while the first
        waiting one is more urgent and finds no seat, or no blocks for its first chunk."""
        bm = self.block_manager
        while self.waiting and self.running:
            head, last = self.waiting[0], self.running[-1]
            if self._rank(last) <= self._rank(head):
                return
            first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
            needed = -(-first_chunk // bm.block_size)
            if len(self.running) < self.config.max_num_seqs and bm.num_free_blocks >= needed:
                return
            preempted.append(self._preempt_last())

    def preempt_less_urgent(self, priority: int) -> bool:
        """Priority policy: preempts the least urgent running sequence if it is less urgent
        than ``priority`` (a decode worker's hand-off waiting for a seat or blocks); False
        when none is, or under fcfs."""
        if not (self._by_priority and self.running):
            return False
        if self.running[-1].params.priority <= priority:
            return False
        self._preempt_last()
        return True

    def _preempt_last(self) -> str:
        """Preempts the last running sequence (the least urgent); returns its id."""
        seq = self.running.pop()
        self._preempt(seq)
        return seq.seq_id

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq, front=True)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        """Admits waiting sequences in order; returns the tokens of budget used.

        A waiting prompt's prefix hit counts the blocks that sequences scheduled before it
        in this step fill (``BlockManager.blocks_filled_by``): a burst sharing a prefix
        computes it once."""
        used = 0
        bm = self.block_manager
        filling: dict[BlockHash, int] = {}
        for item in scheduled:
            if not item.draft:  # a draft's blocks may be rejected
                filling.update(bm.blocks_filled_by(item.seq, item.start, item.num_new_tokens))
        while self.waiting and used < budget and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.find_cached_prefix(seq, filling)
            external = self._external_prefix(seq, len(cached))
            num_ext = external.num_blocks if external else 0
            num_new = min(seq.num_tokens - (len(cached) + num_ext) * bm.block_size, budget - used)
            if not bm.allocate(seq, num_new, cached, num_ext):
                break
            if external is not None:
                self._load_external(seq, external, len(cached))
            elif cached:
                seq.cached_tokens_by_tier = {"device": len(cached) * bm.block_size}
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, seq.num_computed_tokens, num_new))
            filling.update(bm.blocks_filled_by(seq, seq.num_computed_tokens, num_new))
            used += num_new
        return used

    def _external_prefix(self, seq: Sequence, num_cached: int) -> ExternalPrefix | None:
        """Blocks after the device-cached prefix that lower tiers hold (fetched once)."""
        if self.prefix_loader is None or seq.block_ids or seq.needs_every_prompt_token:
            return None
        limit = (seq.num_tokens - 1) // self.block_manager.block_size
        if num_cached >= limit:
            return None
        found = self._external.get(seq.seq_id)
        if found is None or found.start_block != num_cached:
            keys = seq.block_hashes[num_cached:limit]
            found = self.prefix_loader.fetch(keys, num_cached)
            if found is None or not found.num_blocks:
                return None
            self._external[seq.seq_id] = found
        return found

    def _load_external(self, seq: Sequence, found: ExternalPrefix, num_cached: int) -> None:
        assert self.prefix_loader is not None
        del self._external[seq.seq_id]
        block_ids = seq.block_ids[num_cached : num_cached + found.num_blocks]
        self.prefix_loader.write(found, block_ids)
        bs = self.block_manager.block_size
        by_tier = {"device": num_cached * bs}
        by_tier.update({tier: n * bs for tier, n in found.blocks_by_tier.items()})
        seq.cached_tokens_by_tier = by_tier
        seq.num_cached_tokens = max(seq.num_cached_tokens, sum(by_tier.values()))

    def update(self, plan: StepPlan, result: StepResult) -> list[Sequence]:
        """Applies a step's result; returns the sequences that finished in it.

        A sequence takes its tokens in order up to the first that stops it (the lists in
        ``result`` are cut there). With a draft, its KV is kept for the last token and the
        accepted draft tokens, and blocks past them go back to the pool."""
        finished: list[Sequence] = []
        bm = self.block_manager
        for item, token_ids, logprobs in zip(plan.scheduled, result.token_ids, result.logprobs):
            seq = item.seq
            if seq.is_finished:
                continue  # aborted while the step ran
            if item.draft:
                self.num_drafts += 1
                self.num_draft_tokens += len(item.draft)
                self.num_accepted_tokens += len(token_ids) - 1
            status = None
            for j, (token_id, token_logprobs) in enumerate(zip(token_ids, logprobs)):
                seq.token_ids.append(token_id)
                seq.output_logprobs.append(token_logprobs)
                status = self._stop_status(seq, token_id)
                if status is not None:
                    del token_ids[j + 1 :], logprobs[j + 1 :]
                    break
            # the rows computed less the draft's rejected ones (the newest token is not)
            computed = item.num_new_tokens - len(item.draft) + max(0, len(token_ids) - 1)
            seq.num_computed_tokens = item.start + computed
            bm.cache_full_blocks(seq)
            if seq.pool is not None and seq.num_computed_tokens == seq.num_tokens:
                status = SequenceStatus.FINISHED_STOPPED  # the prompt pooled: done
            if status is not None:
                self.finish(seq.seq_id, status)
                finished.append(seq)
            elif item.draft:
                bm.trim(seq)
        return finished

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.params
        num_out = seq.num_output_tokens
        if num_out >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        if params.max_tokens is not None and num_out >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None
