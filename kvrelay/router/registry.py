"""The router's view of the cluster: which instances exist, how loaded, and where to place.

The registry owns worker membership. Instances join with ``Register``, stay alive by sending
a ``LoadReport`` every heartbeat, and are dropped when silent for ``dead_after`` seconds.

Placement (DistServe-style, decode pulls):
- prefill: the live, non-draining prefill instance with the lowest
  ``load - cache_weight * credit`` (load: waiting + running + pending hand-offs + KV usage;
  credit: the prompt blocks it would not compute, device hits plus the L1 hits on its host
  after them, weighted by tier: ``prefix_index.TIER_WEIGHTS``). The load term is not
  capped, so an instance with more queued requests than its cache credit loses to an idle
  one; with no match anywhere this is simply the least loaded one.
- decode: most free KV blocks, then fewest running sequences.
- no prefill/decode pair: a colocated instance, else any surviving worker, end to end.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from kvrelay.cluster.messages import LoadReport, PeerInfo, Register, Role
from kvrelay.router.prefix_index import PrefixMatch


@dataclasses.dataclass(slots=True)
class Instance:
    info: PeerInfo
    model_name: str
    max_model_len: int
    pid: int
    load: LoadReport
    last_seen: float
    num_assigned: int = 0  # requests sent since the last load report (not yet counted by it)
    draining: bool = False  # the router asked it to drain (its reports will say so too)

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> Role:
        return self.info.role

    def load_score(self) -> float:
        load = self.load
        queued = load.num_waiting + load.num_running + load.num_pending_kv + self.num_assigned
        usage = 1.0 - load.num_free_blocks / max(1, load.num_total_blocks)
        return queued + usage

    def as_dict(self) -> dict[str, object]:
        load = dataclasses.asdict(self.load)
        load.pop("instance_id")
        return {
            "instance_id": self.instance_id,
            "role": self.role.value,
            "model": self.model_name,
            "pid": self.pid,
            "host_id": self.info.host_id,
            "peer_addr": self.info.peer_addr,
            "status_url": self.info.status_url,
            "kv_segment": self.info.kv_segment,
            "transport": self.info.transport,
            "kv_version": self.info.kv_version,
            "seconds_since_report": round(time.monotonic() - self.last_seen, 3),
            **load,
            "draining": self.draining or self.load.draining,
        }


class Placement(NamedTuple):
    prefill: Instance  # computes the prompt (or, with no decode, the whole request)
    decode: Instance | None  # continues after the hand-off; None: prefill does everything


class Registry:
    def __init__(self, dead_after: float = 2.0, cache_weight: float = 1.0) -> None:
        self.dead_after = dead_after
        self.cache_weight = cache_weight
        self._instances: dict[str, Instance] = {}

    def register(self, msg: Register, now: float | None = None) -> Instance:
        now = time.monotonic() if now is None else now
        info = msg.info
        empty = LoadReport(info.instance_id, 0, 0, info.layout.num_blocks, info.layout.num_blocks)
        inst = Instance(info, msg.model_name, msg.max_model_len, msg.pid, empty, now)
        self._instances[info.instance_id] = inst
        return inst

    def report(self, load: LoadReport, now: float | None = None) -> Instance | None:
        """Records a heartbeat; None when the instance is unknown (it must register again)."""
        inst = self._instances.get(load.instance_id)
        if inst is None:
            return None
        inst.load = load
        inst.last_seen = time.monotonic() if now is None else now
        inst.num_assigned = 0
        return inst

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def remove(self, instance_id: str) -> Instance | None:
        return self._instances.pop(instance_id, None)

    def reap(self, now: float | None = None) -> list[Instance]:
        """Removes and returns the instances silent for longer than ``dead_after``."""
        now = time.monotonic() if now is None else now
        dead = [i for i in self._instances.values() if now - i.last_seen > self.dead_after]
        for inst in dead:
            del self._instances[inst.instance_id]
        return dead

    def instances(self, role: Role | None = None) -> list[Instance]:
        return [i for i in self._instances.values() if role is None or i.role is role]

    def _live(self, role: Role, exclude: Iterable[str]) -> list[Instance]:
        skip = set(exclude)
        return [
            i
            for i in self.instances(role)
            if not (i.load.draining or i.draining) and i.instance_id not in skip
        ]

    def is_ready(self) -> bool:
        return self.place() is not None

    def assign(self, placement: Placement) -> None:
        """Counts a request sent to the placement's instances (in their load until their
        next report)."""
        placement.prefill.num_assigned += 1
        if placement.decode is not None:
            placement.decode.num_assigned += 1

    def place(
        self, exclude: Iterable[str] = (), matched: Mapping[str, PrefixMatch] | None = None
    ) -> Placement | None:
        """Chooses where a new request runs; None when no instance can take it.

        ``matched``: per instance, the prompt blocks it holds (``CacheIndex.match``).
        """
        exclude = list(exclude)
        matched = matched or {}

        def cost(inst: Instance) -> float:
            match = matched.get(inst.instance_id)
            credit = match.credit if match is not None else 0.0
            return inst.load_score() - self.cache_weight * credit

        prefills = self._live(Role.PREFILL, exclude)
        decodes = self._live(Role.DECODE, exclude)
        # a pair must share the KV hand-off version (a rolling upgrade mixes them): the
        # cheapest prefill that has a decode of its version, else no hand-off at all
        for prefill in sorted(prefills, key=cost):
            peers = [d for d in decodes if d.info.kv_version == prefill.info.kv_version]
            if peers:
                decode = min(
                    peers,
                    key=lambda d: (-d.load.num_free_blocks, d.load.num_running + d.num_assigned),
                )
                return Placement(prefill, decode)
        # a colocated instance, or any survivor: every worker can run a request end to end
        for pool in (self._live(Role.COLOCATED, exclude), prefills + decodes):
            if pool:
                return Placement(min(pool, key=cost), None)
        return None
