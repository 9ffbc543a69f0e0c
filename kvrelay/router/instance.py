"""A worker as the router knows it (``Instance``: its registration, its last load report and
what the router sent it since), which prefill and decode instances may pair, and where a
request was placed (``Placement``). The registry (``registry.py``) owns the instances."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import NamedTuple

from kvrelay.protocol.messages import LoadReport, PeerInfo, Role
from kvrelay.protocol.sampling_params import FIELDS as SAMPLING_FIELDS


@dataclasses.dataclass(slots=True)
class Instance:
    info: PeerInfo
    model_name: str
    max_model_len: int
    pid: int
    load: LoadReport
    last_seen: float
    connection: bytes = b""  # the ZMQ routing id it registered from: its only voice
    num_assigned: int = 0  # requests sent that its last load report does not count yet
    num_assigned_tokens: int = 0  # their prompt tokens to compute (Placement.num_new_tokens)
    # (GenerateRequest.seq, tokens) of the requests sent to it that no report counts yet
    unreported: collections.deque[tuple[int, int]] = dataclasses.field(
        default_factory=collections.deque
    )
    draining: bool = False  # the router asked it to drain (its reports will say so too)
    sampling_fields: frozenset[str] = frozenset(SAMPLING_FIELDS)  # Register.sampling_fields
    # LoRA adapter name -> identity (Register.lora_adapters), less those in conflict
    lora_adapters: dict[str, bytes] = dataclasses.field(default_factory=dict)
    # names it registered with other files than the cluster's adapter of that name
    conflicting_lora_adapters: tuple[str, ...] = ()
    embedding_size: int = 0  # Register.embedding_size: 0, it cannot pool (an older worker)
    cpu_nice: int = 0  # Register.cpu_nice: it yields its cores, so it gets a longer silence

    @property
    def instance_id(self) -> str:
        return self.info.instance_id

    @property
    def role(self) -> Role:
        return self.info.role

    def queued_tokens(self) -> int:
        """Prompt tokens it computes before a new request's: as last reported, plus the
        router's estimate for the requests sent that the report does not count."""
        return self.load.num_prefill_tokens + self.num_assigned_tokens

    def load_score(self) -> float:
        """Requests on it (waiting, running, hand-offs, sent but not in the report) plus KV
        usage."""
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
            "model_identity": self.info.fingerprint.hex(),
            "seconds_since_report": round(time.monotonic() - self.last_seen, 3),
            **load,
            # placed on it since that report, which the report does not count yet
            "num_assigned": self.num_assigned,
            "num_assigned_tokens": self.num_assigned_tokens,
            "draining": self.draining or self.load.draining,
            # what the worker's last report says: it follows a Drain / Undrain a heartbeat
            # later (until then "draining" is this router's word alone)
            "draining_reported": self.load.draining,
            # this router's sampling fields the worker does not know (a rolling upgrade)
            "unknown_sampling_fields": [
                name for name in SAMPLING_FIELDS if name not in self.sampling_fields
            ],
            "lora_adapters": {name: fp.hex() for name, fp in sorted(self.lora_adapters.items())},
            "embedding_size": self.embedding_size,
            "cpu_nice": self.cpu_nice,
            "conflicting_lora_adapters": list(self.conflicting_lora_adapters),
        }


PairKey = tuple[int, bytes]


def pair_key(info: PeerInfo) -> PairKey:
    """What a prefill and a decode must share to pair: hand-off version and model identity."""
    return info.kv_version, info.fingerprint


def can_pair(prefill: PeerInfo, decode: PeerInfo) -> bool:
    """A decode can continue this prefill's requests: same hand-off version, same model."""
    return pair_key(prefill) == pair_key(decode)


class Placement(NamedTuple):
    prefill: Instance  # computes the prompt (or, with no decode, the whole request)
    decode: Instance | None  # continues after the hand-off; None: prefill does everything
    num_new_tokens: int = 0  # prompt tokens prefill computes: the prompt less its device hit
    local_prefill: bool = False  # a decode instance runs it end to end: prefill queue full

    @property
    def instances(self) -> tuple[Instance, ...]:
        """The instances the request runs on: prefill, then decode if any."""
        return (self.prefill,) if self.decode is None else (self.prefill, self.decode)
