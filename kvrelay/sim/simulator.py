"""The discrete-event loop: arrivals, engine steps, KV pulls, heartbeats, autoscaling.

One heap of ``(time, seq, kind, payload)`` events on a virtual clock; arrivals are read from
the sorted request list beside it (never all pushed). Per event kind::

    arrival      RouterView.place (the real Registry.place over CacheIndex.match), then the
                 chosen prefill instance queues it; an idle instance starts a step
    step end     SimInstance.end_step; prompts done are offered to their decode instance
    pull done    the decode instance has the KV; the prefill instance's lease ends
    heartbeat    every instance's LoadReport and cache deltas to the registry / index
    autoscale    Policy.decide over the autoscaler's observation; SimHook applies it
    ready        a started instance registers (start time per mode after the decision)

Deterministic: no wall clock, no unordered iteration, one seeded workload; equal inputs give
equal results.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from typing import Any, Literal

from kvrelay.autoscale.policy import Policy, PolicyConfig, ScaledRole
from kvrelay.router.registry import DEFAULT_PREFILL_QUEUE_LIMIT
from kvrelay.router.tracked import LatencySample
from kvrelay.sim.cache import SegmentLru
from kvrelay.sim.instance import SimInstance
from kvrelay.sim.profile import START_MODES, Profile
from kvrelay.sim.router_glue import (
    RouterView,
    SimHook,
)
from kvrelay.sim.workload import SimRequest

_STEP, _PULL, _READY, _HEARTBEAT, _AUTOSCALE = range(5)


@dataclasses.dataclass(frozen=True, slots=True)
class FleetConfig:
    prefill: int = 1  # instances at the start
    decode: int = 1
    colocated: int = 0
    autoscale: bool = False  # P/D only: the real policy moves prefill and decode
    policy: PolicyConfig = dataclasses.field(default_factory=PolicyConfig)
    autoscale_interval_s: float = 2.0
    start_mode: Literal["disk", "pool", "peer"] = "pool"  # how a new instance gets weights
    kv_gib: float = 1.0  # KV pool per instance
    host_pool_gib: float = 4.0  # L1 per host
    redis_gib: float = 0.0  # L2, global (0: off)
    instances_per_host: int = 8  # instances sharing one L1 pool and shm hand-offs
    placement: Literal["cache-aware", "load-only"] = "cache-aware"
    cache_weight: float = 1.0  # DispatcherSettings.cache_weight
    prefill_queue_limit: float = DEFAULT_PREFILL_QUEUE_LIMIT  # DispatcherSettings's
    heartbeat_s: float = 0.2  # WorkerConfig.heartbeat_interval
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 200.0

    def __post_init__(self) -> None:
        if self.start_mode not in START_MODES:
            raise ValueError(f"start_mode must be one of {START_MODES}, got {self.start_mode!r}")
        if self.placement not in ("cache-aware", "load-only"):
            raise ValueError(f"placement must be cache-aware or load-only, got {self.placement!r}")
        if self.prefill + self.decode + self.colocated < 1:
            raise ValueError("the fleet needs at least one instance")
        if self.autoscale and self.colocated:
            raise ValueError("autoscaling moves prefill and decode; a colocated fleet is fixed")


class Simulator:
    def __init__(self, profile: Profile, fleet: FleetConfig, requests: list[SimRequest]) -> None:
        self.profile = profile
        self.fleet = fleet
        self.requests = requests
        self.router = RouterView(
            fleet.cache_weight, fleet.placement == "cache-aware", fleet.prefill_queue_limit
        )
        self.policy = Policy(fleet.policy)
        self.hook = SimHook(self._start_instance, self._remove_instance, self._count)
        self.now = 0.0
        self._events: list[tuple[float, int, int, Any]] = []
        self._seq = 0
        self.instances: dict[str, SimInstance] = {}
        self._starting: dict[str, int] = {"prefill": 0, "decode": 0}
        self._num_started = 0
        self._hosts: dict[str, SegmentLru] = {}
        self._host_reporters: dict[str, str] = {}
        gib_blocks = profile.kv_blocks_per_gib
        self._kv_blocks = max(1, int(fleet.kv_gib * gib_blocks))
        self._global = SegmentLru(int(fleet.redis_gib * gib_blocks)) if fleet.redis_gib else None
        self._samples: deque[LatencySample] = deque()
        self._joined: dict[str, float] = {}
        self._joining: dict[ScaledRole, int] = {}
        self._pending_drain: tuple[Any, ...] | None = None  # a decision waiting for drains
        self.num_unfinished = 0
        self.rejected: list[SimRequest] = []
        self.timeline: list[tuple[float, int, int, int]] = []  # (t, prefill, decode, colocated)
        self.scale_ups: list[tuple[float, float]] = []  # (decided, last instance ready)
        self.decisions: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, payload: Any) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self) -> None:
        for role in ("prefill", "decode", "colocated"):
            for _ in range(getattr(self.fleet, role)):
                self._add_instance(role)
        self._record_fleet()
        self.num_unfinished = len(self.requests)
        self._push(self.fleet.heartbeat_s, _HEARTBEAT, None)
        if self.fleet.autoscale:
            self._push(self.fleet.autoscale_interval_s, _AUTOSCALE, None)
        requests, n, i = self.requests, len(self.requests), 0
        events = self._events
        while i < n or self.num_unfinished:
            if i < n and (not events or requests[i].arrival_s <= events[0][0]):
                self.now = requests[i].arrival_s
                self._arrive(requests[i])
                i += 1
                continue
            if not events:
                break
            t, _, kind, payload = heapq.heappop(events)
            self.now = t
            if kind == _STEP:
                self._step_end(payload)
            elif kind == _PULL:
                self._pull_done(*payload)
            elif kind == _HEARTBEAT:
                self.router.heartbeat(self.instances.values(), t, self._host_reporters)
                if self.num_unfinished:
                    self._push(t + self.fleet.heartbeat_s, _HEARTBEAT, None)
            elif kind == _AUTOSCALE:
                self._autoscale()
                if self.num_unfinished:
                    self._push(t + self.fleet.autoscale_interval_s, _AUTOSCALE, None)
            else:
                self._ready(payload)

    def _arrive(self, req: SimRequest) -> None:
        placement = self.router.route(req.segments, req.prompt_len)
        if placement is None:
            self.rejected.append(req)
            self.num_unfinished -= 1
            return
        inst = self.instances[placement.prefill.instance_id]
        decode = None if placement.decode is None else self.instances[placement.decode.instance_id]
        inst.enqueue(req, decode)
        self._kick(inst)

    def _kick(self, inst: SimInstance) -> None:
        if not inst.busy:
            duration = inst.start_step()
            if duration is not None:
                self._push(self.now + duration, _STEP, inst)

    def _step_end(self, inst: SimInstance) -> None:
        finished, handoffs = inst.end_step(self.now)
        for req in finished:
            self._finish(req)
        for entry in handoffs:
            assert entry.decode is not None
            entry.decode.offer(entry.req, inst)
            self._start_pulls(entry.decode)
        inst.busy = False
        self._kick(inst)

    def _start_pulls(self, decode: SimInstance) -> None:
        for req, source in decode.pulls_to_start():
            transport = "shm" if source.host_id == decode.host_id else "tcp"
            blocks = -(-(req.prompt_len + 1) // decode.block_size)
            self._push(
                self.now + self.profile.handoff_s(transport, blocks), _PULL, (decode, req, source)
            )

    def _pull_done(self, decode: SimInstance, req: SimRequest, source: SimInstance) -> None:
        source.released(req)
        decode.pulled(req)
        self._kick(decode)
        self._kick(source)  # its freed blocks may admit a waiting prompt

    def _finish(self, req: SimRequest) -> None:
        self.num_unfinished -= 1
        tpot = req.tpot_s if req.output_len > 1 else None
        self._samples.append(LatencySample(req.finish_s, req.ttft_s, tpot))
        # a finished decode frees blocks: hand-offs waiting for room may start
        inst = self.instances.get(req.decode_id or req.prefill_id)
        if inst is not None and inst.pending:
            self._start_pulls(inst)

    # ------------------------------------------------------------------ fleet
    def _add_instance(self, role: str) -> SimInstance:
        num = self._num_started
        self._num_started += 1
        host_id = f"host-{num // self.fleet.instances_per_host}"
        host = self._hosts.get(host_id)
        if host is None:
            host = self._hosts[host_id] = SegmentLru(
                int(self.fleet.host_pool_gib * self.profile.kv_blocks_per_gib)
            )
        inst = SimInstance(
            f"{role}-{num}", role, host_id, self._kv_blocks, self.profile, host, self._global
        )
        self.instances[inst.instance_id] = inst
        self._host_reporters.setdefault(host_id, inst.instance_id)
        self._joined[inst.instance_id] = self.now
        self.router.register(inst, self.now)
        return inst

    def _start_instance(self, role: str) -> None:
        self._starting[role] += 1
        self._push(self.now + self.profile.start_s[self.fleet.start_mode], _READY, role)

    def _ready(self, role: str) -> None:
        self._starting[role] -= 1
        self._add_instance(role)
        self._record_fleet()
        if self.scale_ups and not any(self._starting.values()):
            decided, _ = self.scale_ups[-1]
            self.scale_ups[-1] = (decided, self.now)

    def _remove_instance(self, instance_id: str) -> None:
        inst = self.instances.pop(instance_id)
        assert inst.is_idle(), f"{instance_id} removed while busy"
        self.router.remove(instance_id)
        self._joined.pop(instance_id, None)
        if self._host_reporters.get(inst.host_id) == instance_id:
            others = [i.instance_id for i in self.instances.values() if i.host_id == inst.host_id]
            if others:
                self._host_reporters[inst.host_id] = others[0]
            else:
                del self._host_reporters[inst.host_id]
        self._record_fleet()

    def _count(self, role: str) -> int:
        live = sum(1 for i in self.instances.values() if i.role == role and not i.draining)
        return live + self._starting.get(role, 0)

    def _record_fleet(self) -> None:
        counts = [
            sum(1 for i in self.instances.values() if i.role == r)
            for r in ("prefill", "decode", "colocated")
        ]
        self.timeline.append((self.now, counts[0], counts[1], counts[2]))

    # ------------------------------------------------------------------ autoscaling
    def _autoscale(self) -> None:
        now = self.now
        window = self.policy.config.window_s
        while self._samples and self._samples[0].finished_at < now - window:
            self._samples.popleft()
        if self._pending_drain is not None:
            decision, ids = self._pending_drain
            if all(self.instances[i].is_idle() for i in ids):
                self._pending_drain = None
                self._apply(decision)
            return
        holds: dict[ScaledRole, str] = {}
        for role in ("prefill", "decode"):
            if self._starting[role]:
                holds[role] = f"waiting for {self._starting[role]} instance(s) to join"
            elif role in self._joining:
                del self._joining[role]
                self.policy.settled(role, now)
        ages = {iid: now - t for iid, t in self._joined.items()}
        obs = self.router.observe(list(self._samples), ages, len(self._samples) / window)
        decision = self.policy.decide(obs, now, hold=holds)
        if not decision.is_change:
            return
        self.decisions.append({"t": round(now, 3), "reasons": list(decision.reasons)})
        if decision.drain:
            for iid in decision.drain:
                self.router.drain(iid)
                self.instances[iid].draining = True
            self._pending_drain = (decision, decision.drain)
            return
        self._apply(decision)

    def _apply(self, decision: Any) -> None:
        before = dict(self._starting)
        self.hook.apply(decision)
        for role, (current, desired) in (
            ("prefill", (decision.current_prefill, decision.prefill)),
            ("decode", (decision.current_decode, decision.decode)),
        ):
            if desired != current:
                self.policy.settled(role, self.now)  # type: ignore[arg-type]
            if desired > current:
                self._joining[role] = desired  # type: ignore[index]
        if self._starting != before:
            self.scale_ups.append((self.now, math.nan))

    def check_integrity(self) -> None:
        for inst in self.instances.values():
            inst.check_integrity()
        self.router.registry.check_integrity()
