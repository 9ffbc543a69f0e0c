"""One simulated instance: an engine's step loop over virtual time, costed by a ``Profile``.

Every role runs the same loop (as every worker runs the same engine); the role decides only
what the router sends it. One step at a time, as a real engine::

    start_step   joining sequences enter the decode batch; waiting prompts are admitted
                 while KV blocks and max_num_seqs allow (FIFO; the head blocks the rest);
                 the prefill budget (max_num_batched_tokens - decoding sequences) is cut
                 into chunks in FIFO order; duration = Profile.step_s(...) + tier reads
    end_step     every decoding sequence gains a token (one event for the whole batch: a
                 sequence stores the step it finishes at, no per-token work); chunks
                 advance; a finished prompt yields the first token, writes the tiers, then
                 joins this batch (colocated, or no decode chosen) or is handed off

KV blocks: ``used_blocks`` are reserved whole at admission (prompt, plus output where the
sequence decodes here) and freed at finish or when decode's pull completes; the device
cache (``SegmentLru``) holds at most ``total_blocks - used_blocks``. No preemption.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import TYPE_CHECKING, Any

from kvrelay.sim.cache import SegmentLru

if TYPE_CHECKING:
    from kvrelay.sim.profile import Profile
    from kvrelay.sim.workload import SimRequest


class Prefill:
    """A prompt being computed here."""

    __slots__ = ("decode", "done", "load_s", "remaining", "req", "waiting_tokens")

    def __init__(
        self,
        req: SimRequest,
        decode: SimInstance | None,
        remaining: int,
        done: int,
        load_s: float,
        waiting_tokens: int,
    ) -> None:
        self.req = req
        self.decode = decode  # where it decodes; None: here
        self.remaining = remaining  # tokens still to compute
        self.done = done  # tokens in its KV so far (tier hits included)
        self.load_s = load_s  # tier reads, charged to its first step
        self.waiting_tokens = waiting_tokens  # reported while waiting: prompt - device hit


class SimInstance:
    def __init__(
        self,
        instance_id: str,
        role: str,
        host_id: str,
        total_blocks: int,
        profile: Profile,
        host_cache: SegmentLru,
        global_cache: SegmentLru | None,
    ) -> None:
        self.instance_id = instance_id
        self.role = role  # prefill | decode | colocated
        self.host_id = host_id
        self.total_blocks = total_blocks
        self.profile = profile
        self.block_size = profile.block_size
        self.device = SegmentLru(total_blocks)
        self.host_cache = host_cache
        self.global_cache = global_cache
        self.used_blocks = 0
        self.num_prefill_tokens = 0  # LoadReport.num_prefill_tokens (see check_integrity)
        self.waiting: deque[Prefill] = deque()  # placed here, not admitted
        self.prefilling: list[Prefill] = []
        self.num_leased = 0  # handed-off prompts whose blocks decode has not pulled yet
        self.pending: deque[tuple[SimRequest, SimInstance]] = deque()  # hand-offs (decode side)
        self.num_pulling = 0
        self.joining: list[SimRequest] = []
        self._finishing: list[tuple[int, int, SimRequest]] = []  # (finish step, rid, request)
        self.step_no = 0
        self.context = 0  # sum of the decode batch's lengths
        self.num_decoding = 0
        self.busy = False
        self.draining = False
        self._plan: list[tuple[Prefill, int]] = []
        self.reported: tuple[int, int, int, int, bool, int] | None = None  # the last LoadReport

    # ------------------------------------------------------------------ load (LoadReport)
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.prefilling) + self.num_decoding + len(self.joining)

    @property
    def num_pending_kv(self) -> int:
        return self.num_leased + len(self.pending) + self.num_pulling

    @property
    def free_blocks(self) -> int:
        return self.total_blocks - self.used_blocks

    def is_idle(self) -> bool:
        return not (self.busy or self.waiting or self.num_running or self.num_pending_kv)

    # ------------------------------------------------------------------ prefill side
    def enqueue(self, req: SimRequest, decode: SimInstance | None) -> Prefill:
        """A request placed here: looks its prompt up in the tiers (device, L1, L2)."""
        segs = req.segments
        n_dev = self.device.leading(segs, 0)
        n_host = self.host_cache.leading(segs, n_dev)
        n_glob = self.global_cache.leading(segs, n_dev + n_host) if self.global_cache else 0
        blocks = [
            sum(b for _, b in segs[lo:hi])
            for lo, hi in (
                (0, n_dev),
                (n_dev, n_dev + n_host),
                (n_dev + n_host, n_dev + n_host + n_glob),
            )
        ]
        req.hit_blocks = (blocks[0], blocks[1], blocks[2])
        hit_tokens = min(sum(blocks) * self.block_size, req.prompt_len - 1)
        req.computed_tokens = req.prompt_len - hit_tokens
        p = self.profile
        load_s = 0.0
        if blocks[1]:
            load_s += p.handoff_s("shm", blocks[1])
        if blocks[2]:
            load_s += p.handoff_s("tcp", blocks[2])
        req.prefill_id = self.instance_id
        # as a worker reports a waiting prompt: less its device-cached prefix only (the
        # lower tiers are looked up at admission)
        waiting_tokens = req.prompt_len - min(blocks[0] * self.block_size, hit_tokens)
        entry = Prefill(req, decode, req.computed_tokens, hit_tokens, load_s, waiting_tokens)
        self.waiting.append(entry)
        self.num_prefill_tokens += waiting_tokens
        return entry

    def _blocks_for(self, entry: Prefill) -> int:
        req = entry.req
        tokens = req.prompt_len + (req.output_len if entry.decode is None else 1)
        return -(-tokens // self.block_size)

    def _admit(self) -> None:
        max_seqs = self.profile.max_num_seqs
        while self.waiting and self.num_running < max_seqs:
            need = self._blocks_for(self.waiting[0])
            if need > self.free_blocks:
                break
            self.used_blocks += need
            self.device.shrink(self.free_blocks)
            entry = self.waiting.popleft()
            self.num_prefill_tokens += entry.remaining - entry.waiting_tokens
            self.prefilling.append(entry)

    def _write_tiers(self, req: SimRequest) -> None:
        limit = self.free_blocks
        for cache, cap in (
            (self.device, limit),
            (self.host_cache, None),
            (self.global_cache, None),
        ):
            if cache is None:
                continue
            for key, blocks in req.segments:
                cache.put(key, blocks, cap)
            if req.unique_blocks:
                cache.put(-(req.rid + 1), req.unique_blocks, cap)

    # ------------------------------------------------------------------ decode side
    def offer(self, req: SimRequest, source: SimInstance) -> None:
        """A prompt's KV is ready on ``source``; pulled when there is room."""
        self.pending.append((req, source))

    def pulls_to_start(self) -> list[tuple[SimRequest, SimInstance]]:
        """Reserves room for the pending hand-offs that fit now, in order."""
        out = []
        max_seqs = self.profile.max_num_seqs
        while self.pending and self.num_running + self.num_pulling < max_seqs:
            req, source = self.pending[0]
            need = -(-(req.prompt_len + req.output_len) // self.block_size)
            if need > self.free_blocks:
                break
            self.pending.popleft()
            self.used_blocks += need
            self.device.shrink(self.free_blocks)
            self.num_pulling += 1
            out.append((req, source))
        return out

    def pulled(self, req: SimRequest) -> None:
        self.num_pulling -= 1
        req.decode_id = self.instance_id
        self.joining.append(req)

    def released(self, req: SimRequest) -> None:
        """Decode pulled ``req``'s KV: the lease ends."""
        self.num_leased -= 1
        self.used_blocks -= -(-(req.prompt_len + 1) // self.block_size)

    # ------------------------------------------------------------------ the step loop
    def start_step(self) -> float | None:
        """Plans the next step; its duration, or None when there is nothing to do."""
        for req in self.joining:
            heapq.heappush(self._finishing, (self.step_no + req.output_len - 1, req.rid, req))
            self.context += req.prompt_len + 1
        self.num_decoding += len(self.joining)
        self.joining.clear()
        self._admit()
        budget = self.profile.max_num_batched_tokens - self.num_decoding
        tokens, attn, load_s = 0, 0.0, 0.0
        plan = []
        for entry in self.prefilling:
            if budget <= 0:
                break
            chunk = min(entry.remaining, budget)
            plan.append((entry, chunk))
            tokens += chunk
            attn += chunk * (entry.done + chunk / 2)
            budget -= chunk
            load_s += entry.load_s
            entry.load_s = 0.0
        self._plan = plan
        if not tokens and not self.num_decoding:
            self.busy = False
            return None
        self.busy = True
        return self.profile.step_s(tokens, attn, self.num_decoding, self.context) + load_s

    def end_step(self, now: float) -> tuple[list[SimRequest], list[Prefill]]:
        """Completes the step at ``now``: (requests finished, prompts to hand off)."""
        self.step_no += 1
        self.context += self.num_decoding
        finished = []
        heap = self._finishing
        while heap and heap[0][0] <= self.step_no:
            req = heapq.heappop(heap)[2]
            req.finish_s = now
            self.context -= req.prompt_len + req.output_len
            self.used_blocks -= -(-(req.prompt_len + req.output_len) // self.block_size)
            finished.append(req)
        self.num_decoding -= len(finished)
        handoffs = []
        for entry, chunk in self._plan:
            entry.remaining -= chunk
            entry.done += chunk
            self.num_prefill_tokens -= chunk
            if entry.remaining:
                continue
            self.prefilling.remove(entry)
            req = entry.req
            req.first_token_s = now
            self._write_tiers(req)
            if req.output_len == 1:
                req.finish_s = now
                self.used_blocks -= self._blocks_for(entry)
                finished.append(req)
            elif entry.decode is None:
                self.joining.append(req)
                req.decode_id = self.instance_id
            else:
                self.num_leased += 1  # its prompt blocks stay reserved until pulled
                handoffs.append(entry)
        self._plan = []
        return finished, handoffs

    def check_integrity(self) -> None:
        assert 0 <= self.used_blocks <= self.total_blocks, (self.instance_id, self.used_blocks)
        self.device.check_integrity()
        assert self.num_decoding == len(self._finishing)
        queued = sum(e.waiting_tokens for e in self.waiting)
        queued += sum(e.remaining for e in self.prefilling)
        assert self.num_prefill_tokens == queued, (self.instance_id, self.num_prefill_tokens)

    def describe(self) -> dict[str, Any]:
        return {"id": self.instance_id, "role": self.role, "host": self.host_id}
