"""The router's view of the cluster: which instances exist, how loaded, and where to place.

The registry owns worker membership. Instances join with ``Register``, stay alive by sending
a ``LoadReport`` every heartbeat, and are dropped when silent for ``dead_after`` seconds;
a worker that lowered its CPU priority (``Register.cpu_nice``: a decode worker yielding shared
cores to prefill) gets ``LOWERED_SILENCE_FACTOR`` times that. Its heartbeat thread is as low
as the rest of it, and needs the GIL from a loop thread that is as starved: while other
processes keep the cores busy its beats come late (on 2 vCPUs with four busy processes, a
nice-19 Python beat every 0.2 s was up to 1.2-3.3 s late, against 0.45 s at nice 10), and a
router that called it dead then re-ran its streams elsewhere and an autoscaler added another.

Placement (DistServe-style, decode pulls):
- prefill: the live, non-draining prefill instance whose queue plus this prompt is the least
  prefill work, in tokens, once its cache hit is taken off::

      cost = queued_tokens + num_prompt_tokens - cache_weight * block_size * credit

  ``queued_tokens``: the prompt tokens it still has to compute (``LoadReport.
  num_prefill_tokens``) plus those of the requests sent that the report does not count yet
  (``LoadReport.last_taken``: the ``seq`` of the last request it had taken in); ``credit``: the
  prompt blocks it would not compute, device hits plus the L1 hits on its host after them,
  weighted by tier (``prefix_index.TIER_WEIGHTS``). The request waits for the queue, then
  computes what is not cached, so with ``cache_weight`` 1 both terms are time at one
  instance's prefill rate: a cache holder wins while its queue exceeds the others' by
  less than the tokens its hit saves, and loses once the excess is larger. With no
  match anywhere (or ``cache_weight`` 0) it is the instance with the least queued prefill
  work. Ties (idle instances) go to the fewest requests, then KV usage (``load_score``).
- decode: most free KV blocks, then fewest running sequences.
- a full prefill queue (conditional disaggregation): once the chosen prefill instance has
  ``prefill_queue_limit`` or more prompt tokens queued, its decode instance is a candidate
  too, ranked by the same cost (its own queue, its own cache hit): when it would start the
  prompt sooner it computes the request end to end, with no hand-off. Below the limit a
  prompt is always handed off (decode steps carry no prefill). The default, ``inf``, never
  falls back: a decode step that carries a prompt is a long step for every stream on it
  (the simulator's fleet: TTFT halves, TPOT p50 20 -> 470 ms). It pays where a burst
  outruns the prefill fleet and throughput counts more than TPOT (BENCHMARKS.md "1P+1D:
  prefill first on shared cores").
- a pair shares the KV hand-off version and the model identity (``PeerInfo.fingerprint``:
  every byte of the weights, config and tokenizer, and the dtype); instances of different
  weights never pair, and ``register`` logs it when such a one joins.
- no prefill/decode pair: a colocated instance, else any surviving worker, end to end.
- a request that sets a sampling field some workers do not know (``SamplingParams.
  fields_set``: a router newer than them, in a rolling upgrade) goes only to workers that
  list it (``Register.sampling_fields``); an older worker would drop the field and run
  another request than the one asked for.
- a request through a LoRA adapter (``SamplingParams.lora_name``) goes only to workers that
  registered that adapter (``Register.lora_adapters``) with the identity the router knows it
  by: the first live worker to register a name sets it, and a later worker whose files
  differ under that name is not placed for it (logged, and shown in ``/admin/instances``);
  a hand-off pairs only workers with the same adapter, whose KV is the adapter's.
- ties left: the first registered (a re-registered id keeps its place).

Cost per request: O(matched + log instances), not O(instances). Each role's instances are
kept in ``LoadOrder``s (``load_order.py``), re-filed whenever a report or an assignment
changes their load: prefill work with nothing cached per role, free KV blocks per decode
pair key. With nothing saved, the cost ascends with that order, so a request ranks the
instances its prompt matched (``CacheIndex.match`` lists only holders) and the first of
the others in order, which is the same choice as ranking them all.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from kvrelay.protocol.messages import LoadReport, Register, Role
from kvrelay.protocol.sampling_params import FIELDS as SAMPLING_FIELDS
from kvrelay.router.instance import Instance, PairKey, Placement, pair_key
from kvrelay.router.load_order import LoadOrder
from kvrelay.router.lora_catalog import LoraCatalog
from kvrelay.router.prefix_index import PrefixMatch

logger = logging.getLogger(__name__)


def _work_key(inst: Instance) -> tuple[int, float]:
    """Prefill ranking with nothing cached (``Registry._cost`` less the prompt's length)."""
    return inst.queued_tokens(), inst.load_score()


def _free_key(inst: Instance) -> tuple[int, int]:
    """Decode ranking: most free KV blocks, then fewest running sequences."""
    return -inst.load.num_free_blocks, inst.load.num_running + inst.num_assigned


DEFAULT_PREFILL_QUEUE_LIMIT = math.inf  # prompt tokens (DispatcherSettings.prefill_queue_limit)
LOWERED_SILENCE_FACTOR = 4  # x dead_after: the silence a worker with cpu_nice > 0 may keep
MAX_NICE = 19  # the lowest priority Linux has (a Register.cpu_nice above it is held to it)


class Registry:
    def __init__(
        self,
        dead_after: float = 2.0,
        cache_weight: float = 1.0,
        prefill_queue_limit: float = DEFAULT_PREFILL_QUEUE_LIMIT,
        router_id: str = "",
    ) -> None:
        self.dead_after = dead_after
        self.router_id = router_id  # the origin its requests carry (LoadReport.last_taken)
        self._num_sent = 0  # GenerateRequests sent to any instance: the last one's seq
        self.cache_weight = cache_weight
        self.prefill_queue_limit = prefill_queue_limit
        self._instances: dict[str, Instance] = {}
        self._order: dict[str, int] = {}  # registration order (kept on a re-register)
        self._num_registered = 0
        self._by_work = {role: LoadOrder(_work_key) for role in Role}
        self._by_free: dict[PairKey, LoadOrder] = {}  # decodes, per pair key
        self.loras = LoraCatalog()  # the adapters live workers hold (lora_catalog.py)

    def register(
        self, msg: Register, connection: bytes = b"", now: float | None = None
    ) -> Instance | None:
        """Adds (or, from its own connection, refreshes) an instance; None when the id is
        live on another connection: a second process under a live id is refused, never a
        takeover (the first one is reaped when silent, then the id is free again)."""
        now = time.monotonic() if now is None else now
        info = msg.info
        live = self._instances.get(info.instance_id)
        if live is not None and live.connection != connection:
            return None
        empty = LoadReport(info.instance_id, 0, 0, info.layout.num_blocks, info.layout.num_blocks)
        inst = Instance(info, msg.model_name, msg.max_model_len, msg.pid, empty, now, connection)
        inst.sampling_fields = frozenset(msg.sampling_fields)
        inst.embedding_size = msg.embedding_size
        inst.cpu_nice = min(MAX_NICE, max(0, int(msg.cpu_nice)))
        if live is not None:
            self._forget(live)
        self.loras.admit(inst, msg.lora_adapters or {})
        self._instances[info.instance_id] = inst
        if info.instance_id not in self._order:
            self._order[info.instance_id] = self._num_registered
            self._num_registered += 1
        self._file(inst)
        self._log_unpairable(inst)
        return inst

    def set_lora_adapters(
        self, instance_id: str, connection: bytes, adapters: Mapping[str, bytes]
    ) -> bool:
        """Replaces an instance's LoRA adapters (``LoRAState``, after a runtime load or
        unload); False when it is not registered from ``connection``."""
        inst = self.get_from(instance_id, connection)
        if inst is None:
            return False
        self.loras.release(inst)
        self.loras.admit(inst, adapters)
        return True

    def lora_adapters(self) -> dict[str, bytes]:
        """The LoRA adapters some live worker holds, name -> identity (sorted by name)."""
        return self.loras.adapters()

    def lora_adapter(self, name: str) -> bytes | None:
        """The identity of the LoRA adapter ``name`` as live workers hold it; None if none."""
        return self.loras.identity(name)

    def _log_unpairable(self, inst: Instance) -> None:
        """Logs the other-role instances ``inst`` will never pair with: other weights."""
        other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(inst.role)
        if other is None:
            return
        for peer in self.instances(other):
            if peer.info.fingerprint != inst.info.fingerprint:
                logger.warning(
                    "%s %s (model identity %s) and %s %s (model identity %s) serve different "
                    "weights: they never pair for a KV hand-off",
                    inst.role.value, inst.instance_id, inst.info.fingerprint.hex()[:16],
                    peer.role.value, peer.instance_id, peer.info.fingerprint.hex()[:16],
                )  # fmt: skip

    def get_from(self, instance_id: str, connection: bytes) -> Instance | None:
        """The instance, if it is live and registered from ``connection``; else None."""
        inst = self._instances.get(instance_id)
        return inst if inst is not None and inst.connection == connection else None

    def report(self, load: LoadReport, now: float | None = None) -> Instance | None:
        """Records a heartbeat; None when the instance is unknown (it must register again)."""
        inst = self._instances.get(load.instance_id)
        if inst is None:
            return None
        inst.load = load
        inst.last_seen = time.monotonic() if now is None else now
        # what the report counts leaves the router's estimate: the requests it took in (a
        # report made before a request arrived, say sent by the heartbeat thread during a
        # long step, keeps that request counted); an older worker's: all of them
        last = load.last_taken
        taken = self._num_sent if last is None else last.get(self.router_id, 0)
        unreported = inst.unreported
        while unreported and unreported[0][0] <= taken:
            inst.num_assigned_tokens -= unreported.popleft()[1]
        inst.num_assigned = len(unreported)  # hand-offs to a decode: counted by any report
        if not unreported:
            inst.num_assigned_tokens = 0
        self._file(inst)
        return inst

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def remove(self, instance_id: str) -> Instance | None:
        inst = self._instances.pop(instance_id, None)
        if inst is not None:
            self._forget(inst)
            del self._order[instance_id]
        return inst

    def _file(self, inst: Instance) -> None:
        """Files ``inst`` under its load as it is now, in its role's load orders (unless it
        left meanwhile: a placement can outlive its instances)."""
        if self._instances.get(inst.instance_id) is not inst:
            return
        order = self._order[inst.instance_id]
        self._by_work[inst.role].update(inst, order)
        if inst.role is Role.DECODE:
            key = pair_key(inst.info)
            self._by_free.setdefault(key, LoadOrder(_free_key)).update(inst, order)

    def _forget(self, inst: Instance) -> None:
        self.loras.release(inst)
        self._by_work[inst.role].discard(inst.instance_id)
        if inst.role is Role.DECODE:
            key = pair_key(inst.info)
            by_free = self._by_free[key]
            by_free.discard(inst.instance_id)
            if not by_free:
                del self._by_free[key]

    def silence_limit(self, inst: Instance) -> float:
        """How long ``inst`` may be silent before it is dead: ``dead_after``, times
        ``LOWERED_SILENCE_FACTOR`` for a worker that lowered its CPU priority."""
        return self.dead_after * (LOWERED_SILENCE_FACTOR if inst.cpu_nice else 1)

    def reap(self, now: float | None = None) -> list[Instance]:
        """Removes and returns the instances silent for longer than their ``silence_limit``."""
        now = time.monotonic() if now is None else now
        dead = [i for i in self._instances.values() if now - i.last_seen > self.silence_limit(i)]
        for inst in dead:
            self.remove(inst.instance_id)
        return dead

    def excuse(self, seconds: float) -> None:
        """Does not count ``seconds`` of silence against any instance: the router itself was
        stalled, and their heartbeats waited unread."""
        now = time.monotonic()
        for inst in self._instances.values():
            inst.last_seen = min(now, inst.last_seen + seconds)

    def instances(self, role: Role | None = None) -> list[Instance]:
        return [i for i in self._instances.values() if role is None or i.role is role]

    def first_instance(self) -> Instance | None:
        """The earliest registered instance still here (``instances()[0]``, in O(1))."""
        return next(iter(self._instances.values()), None)

    def is_ready(self) -> bool:
        return self.place() is not None

    def assign(self, placement: Placement) -> int:
        """Counts a request sent to the placement's instances (in their load until a report
        counts it): one more request on each, its new tokens in the prefill's queue. Returns
        the ``GenerateRequest.seq`` to send it with."""
        self._num_sent += 1
        prefill = placement.prefill
        prefill.num_assigned += 1
        prefill.num_assigned_tokens += placement.num_new_tokens
        prefill.unreported.append((self._num_sent, placement.num_new_tokens))
        self._file(placement.prefill)
        if placement.decode is not None:
            placement.decode.num_assigned += 1
            self._file(placement.decode)
        return self._num_sent

    def place(
        self,
        exclude: Iterable[str] = (),
        matched: Mapping[str, PrefixMatch] | None = None,
        num_prompt_tokens: int = 0,
        needs: frozenset[str] = frozenset(),
        lora: tuple[str, bytes] | None = None,
        pooled: bool = False,
    ) -> Placement | None:
        """Chooses where a new request runs; None when no instance can take it.

        Looks only at the instances in ``matched`` and, per role, the first ones of the load
        orders: O(matched + log instances), not O(instances), but the same choice as ranking
        every instance by ``_cost`` (ties to the first registered).

        Args:
            exclude: instance ids not to use (a re-run avoids the ones that failed it).
            matched: per instance, the prompt blocks it holds (``CacheIndex.match``).
            num_prompt_tokens: the prompt's length (the new tokens the chosen prefill is
                charged until its next report; ranking does not depend on it).
            needs: the request's sampling fields a worker must know (``SamplingParams.
                fields_set``); instances that do not list one are passed over.
            lora: the request's LoRA adapter (name, identity); only the instances that
                registered it are used.
            pooled: an embedding request: it computes its prompt and nothing after, so it
                goes to the cheapest prefill or colocated instance that can pool, never in
                a pair (a decode instance only when no other is left).
        """
        request = _Request(set(exclude), matched or {}, num_prompt_tokens, needs, lora, pooled)
        if pooled:
            inst = self._cheapest_of(
                self._cheapest(Role.PREFILL, request),
                self._cheapest(Role.COLOCATED, request),
                request,
            ) or self._cheapest(Role.DECODE, request)
            return None if inst is None else request.placed(inst, None)
        # a pair must share the KV hand-off version (a rolling upgrade mixes them) and the
        # model identity: the cheapest prefill that has such a decode, else no hand-off
        decodes: dict[PairKey, Instance | None] = {}

        def decode_for(inst: Instance) -> Instance | None:
            key = pair_key(inst.info)
            if key not in decodes:
                decodes[key] = self._least_busy_decode(key, request)
            return decodes[key]

        prefill = self._cheapest(Role.PREFILL, request, lambda i: decode_for(i) is not None)
        if prefill is not None:
            decode = decode_for(prefill)
            assert decode is not None
            if prefill.queued_tokens() >= self.prefill_queue_limit and self._work(
                decode, request.matched.get(decode.instance_id), request
            ) < self._work(prefill, request.matched.get(prefill.instance_id), request):
                return request.placed(decode, None)._replace(local_prefill=True)
            return request.placed(prefill, decode)
        # a colocated instance, or any survivor: every worker can run a request end to end
        inst = self._cheapest(Role.COLOCATED, request)
        if inst is None:
            inst = self._cheapest_of(
                self._cheapest(Role.PREFILL, request), self._cheapest(Role.DECODE, request), request
            )
        return None if inst is None else request.placed(inst, None)

    def _cost(self, inst: Instance, request: _Request) -> tuple[float, float]:
        """Prefill work on ``inst`` before the request's first token, then its load."""
        return self._work(inst, request.matched.get(inst.instance_id), request), inst.load_score()

    def _work(self, inst: Instance, match: PrefixMatch | None, request: _Request) -> float:
        """Prompt tokens ``inst`` computes before the request's first token, less what its
        cache hit saves (in queued tokens per cached token, ``cache_weight``)."""
        saved = 0.0 if match is None else match.credit * inst.info.layout.block_size
        return inst.queued_tokens() + request.num_prompt_tokens - self.cache_weight * saved

    def _cheapest(
        self,
        role: Role,
        request: _Request,
        can_take: Callable[[Instance], bool] = lambda _: True,
    ) -> Instance | None:
        """The live ``role`` instance of least ``(_cost, registration order)`` that
        ``can_take`` the request: the first in load order of those ``request.matched``
        omits (with nothing saved, ``_cost`` ascends with it), else a matched one that costs
        less. A matched one that does more work than the best so far is ranked no further."""
        chosen = next(
            (
                i
                for i in self._by_work[role].in_order()
                if i.instance_id not in request.matched and request.is_usable(i) and can_take(i)
            ),
            None,
        )
        best = None if chosen is None else self._rank(chosen, request)
        for instance_id, match in request.matched.items():
            inst = self._instances.get(instance_id)
            if inst is None or inst.role is not role:
                continue
            work = self._work(inst, match, request)
            if best is not None and work > best[0]:
                continue
            if request.is_usable(inst) and can_take(inst):
                rank = (work, inst.load_score(), self._order[instance_id])
                if best is None or rank < best:
                    chosen, best = inst, rank
        return chosen

    def _rank(self, inst: Instance, request: _Request) -> tuple[float, float, int]:
        """``_cost``, ties to the first registered."""
        return *self._cost(inst, request), self._order[inst.instance_id]

    def _cheapest_of(
        self, prefill: Instance | None, decode: Instance | None, request: _Request
    ) -> Instance | None:
        """The cheaper of the two; a tie to the prefill (the survivors are ranked prefills
        first)."""
        if prefill is None or decode is None:
            return prefill or decode
        return decode if self._cost(decode, request) < self._cost(prefill, request) else prefill

    def _least_busy_decode(self, key: PairKey, request: _Request) -> Instance | None:
        """The live decode of that pair key with the most free KV blocks, then the fewest
        running sequences, then the first registered."""
        order = self._by_free.get(key)
        if order is None:
            return None
        return next((d for d in order.in_order() if request.is_usable(d)), None)

    def unknown_field(self, needs: frozenset[str]) -> str | None:
        """The first of ``needs`` (in wire order) that a live, usable worker does not know,
        None when each one knows them all: why a request ``place`` found no worker for
        would have found one without its fields."""
        request = _Request(set(), {}, 0)
        for name in SAMPLING_FIELDS:
            if name in needs and any(
                request.is_usable(i) and name not in i.sampling_fields
                for i in self._instances.values()
            ):
                return name
        return None

    def check_integrity(self) -> None:
        """Every instance filed once in its role's load orders, under its current load."""
        for role, order in self._by_work.items():
            assert len(order) == len(self.instances(role)), role
            order.check_integrity()
        num_decodes = sum(len(order) for order in self._by_free.values())
        assert num_decodes == len(self.instances(Role.DECODE))
        for order in self._by_free.values():
            order.check_integrity()
        assert self._order.keys() == self._instances.keys()
        held: collections.Counter[str] = collections.Counter()
        for inst in self._instances.values():
            held.update(inst.lora_adapters.keys())
        assert self.loras.holders() == dict(held)


class _Request(NamedTuple):
    """One placement's inputs (``Registry.place``)."""

    exclude: set[str]
    matched: Mapping[str, PrefixMatch]
    num_prompt_tokens: int
    needs: frozenset[str] = frozenset()  # sampling fields the worker must know
    lora: tuple[str, bytes] | None = None  # the LoRA adapter the worker must hold
    pooled: bool = False  # an embedding request: the worker must pool

    def is_usable(self, inst: Instance) -> bool:
        """Not draining, not excluded, it knows the request's sampling fields, holds its
        LoRA adapter and pools when the request is an embedding."""
        return (
            not (inst.load.draining or inst.draining)
            and inst.instance_id not in self.exclude
            and self.needs <= inst.sampling_fields
            and (not self.pooled or inst.embedding_size > 0)
            and (self.lora is None or inst.lora_adapters.get(self.lora[0]) == self.lora[1])
        )

    def placed(self, prefill: Instance, decode: Instance | None) -> Placement:
        match = self.matched.get(prefill.instance_id)
        hit = 0 if match is None else match.device_blocks * prefill.info.layout.block_size
        return Placement(prefill, decode, max(0, self.num_prompt_tokens - hit))
