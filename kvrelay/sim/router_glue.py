"""The simulator's one door to the real router and autoscaler code (and their message types).

Placement is ``Registry.place`` over ``CacheIndex.match``, fed ``Register``, ``LoadReport``
and ``CacheEvent`` values exactly as the router is; scaling is ``Policy.decide`` over the
observation ``autoscaler.role_observation`` builds, carried out by a ``ScalingHook``. Nothing
here decides: it only converts simulated state into those values (every import of the
router's and the workers' modules is in this file, so a move of them touches one place).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from kvrelay.autoscale.autoscaler import live_instances, role_observation
from kvrelay.autoscale.base import ScaleDecision, ScalingHook
from kvrelay.autoscale.policy import Observation, Policy, PolicyConfig, ScaledRole
from kvrelay.protocol.messages import CacheEvent, KvLayout, LoadReport, PeerInfo, Register, Role
from kvrelay.router.instance import Placement
from kvrelay.router.prefix_index import CacheIndex
from kvrelay.router.registry import DEFAULT_PREFILL_QUEUE_LIMIT, Registry
from kvrelay.router.tracked import LatencySample
from kvrelay.sim.instance import SimInstance
from kvrelay.sim.workload import segment_keys

__all__ = [
    "LatencySample",
    "Observation",
    "Placement",
    "Policy",
    "PolicyConfig",
    "Role",
    "RouterView",
    "ScaleDecision",
    "ScaledRole",
    "ScalingHook",
]

ROLE = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.COLOCATED}


class RouterView:
    """The real ``Registry`` and ``CacheIndex``, and the calls the router makes on them."""

    def __init__(
        self,
        cache_weight: float,
        is_cache_aware: bool,
        prefill_queue_limit: float = DEFAULT_PREFILL_QUEUE_LIMIT,
    ) -> None:
        self.registry = Registry(math.inf, cache_weight, prefill_queue_limit)
        self.cache_index = CacheIndex()
        self.is_cache_aware = is_cache_aware

    def register(self, inst: SimInstance, now: float) -> None:
        layout = KvLayout(1, inst.total_blocks, inst.block_size, 1, 1, "float32")
        info = PeerInfo(
            inst.instance_id, ROLE[inst.role], inst.host_id, "", "", None, layout, b"sim"
        )
        connection = inst.instance_id.encode()  # one per instance, as a worker's socket
        self.registry.register(Register(info, "sim", 1 << 20, 0), connection, now)
        self.cache_index.add_instance(inst.instance_id, inst.host_id)

    def remove(self, instance_id: str) -> None:
        self.registry.remove(instance_id)
        self.cache_index.remove_instance(instance_id)

    def route(self, segments: Sequence[tuple[int, int]], prompt_len: int) -> Placement | None:
        """Where the router sends a prompt (cache-aware: with the blocks each instance holds)."""
        matched = None
        if self.is_cache_aware and segments:
            keys = [k for seg, n in segments for k in segment_keys(seg, n)]
            matched = self.cache_index.match(keys)  # type: ignore[arg-type]
        placement = self.registry.place(matched=matched, num_prompt_tokens=prompt_len)
        if placement is not None:
            self.registry.assign(placement)
        return placement

    def heartbeat(
        self, instances: Iterable[SimInstance], now: float, host_reporters: dict[str, str]
    ) -> None:
        """Every instance's LoadReport and cache deltas, as its heartbeat sends them. A report
        equal to the last one, with nothing assigned since, is skipped: it would change
        nothing the registry uses (``last_seen`` only matters to ``reap``, never called)."""
        registry = self.registry
        for inst in instances:
            state = (
                inst.num_waiting,
                inst.num_running,
                inst.free_blocks,
                inst.num_pending_kv,
                inst.draining,
                inst.num_prefill_tokens,
            )
            known = registry.get(inst.instance_id)
            if known is None or state != inst.reported or known.num_assigned:
                inst.reported = state
                report = LoadReport(
                    inst.instance_id, state[0], state[1], state[2], inst.total_blocks, state[3],
                    draining=state[4], num_prefill_tokens=state[5],
                )  # fmt: skip
                registry.report(report, now)
            if not self.is_cache_aware:
                continue
            stored, evicted = inst.device.drain_events()
            if stored or evicted:
                self.cache_index.apply(CacheEvent(inst.instance_id, _keys(stored), _keys(evicted)))
            if host_reporters.get(inst.host_id) == inst.instance_id:
                stored, evicted = inst.host_cache.drain_events()
                if stored or evicted:
                    event = CacheEvent(
                        inst.instance_id,
                        _keys(stored),
                        _keys(evicted),
                        tier="host",
                        host_id=inst.host_id,
                    )
                    self.cache_index.apply(event)

    def drain(self, instance_id: str) -> None:
        inst = self.registry.get(instance_id)
        if inst is not None:
            inst.draining = True

    def observe(
        self, samples: Sequence[LatencySample], ages: dict[str, float], request_rate: float
    ) -> Observation:
        """The autoscaler's observation (``role_observation``, the autoscaler's own)."""
        return Observation(
            prefill=role_observation(
                Role.PREFILL, live_instances(self.registry, Role.PREFILL), samples, ages, _always
            ),
            decode=role_observation(
                Role.DECODE, live_instances(self.registry, Role.DECODE), samples, ages, _always
            ),
            request_rate=request_rate,
        )


def _always(_instance_id: str) -> bool:
    return True


def _keys(segments: list[tuple[int, int]]) -> list[bytes]:
    return [k for seg, n in segments for k in segment_keys(seg, n)]


class SimHook(ScalingHook):
    """Carries decisions out in the simulation: starts instances (ready after the start
    mode's time) and removes exactly the drained ones; idempotent over what it started."""

    name = "sim"

    def __init__(
        self,
        start: Callable[[str], None],
        remove: Callable[[str], None],
        count: Callable[[str], int],
    ) -> None:
        self._start = start  # starts one instance of a role
        self._remove = remove  # removes one (drained, idle) instance
        self._count = count  # a role's instances, starting ones included, draining not

    def apply(self, decision: ScaleDecision) -> None:
        for instance_id in decision.drain:
            self._remove(instance_id)
        for role, desired in (("prefill", decision.prefill), ("decode", decision.decode)):
            for _ in range(desired - self._count(role)):
                self._start(role)
