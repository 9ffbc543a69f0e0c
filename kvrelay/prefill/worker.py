"""Prefill worker: computes prompts, sends the first token at once, leases the KV to decode.

Per request::

    GenerateRequest(decode=D) -> engine computes the prompt (chunked) and samples token 1
      finished already (eos, max_tokens=1)  -> TokenEvent(finished); the engine frees blocks
      otherwise -> detach with blocks held  -> TokenEvent(token 1, handed_off_to=D)
                                             -> KvReady(blocks, checksum, lease) to D
    KvAck(ok or not) from D  -> release the lease
    lease deadline passes    -> release (D's pull then fails and D recomputes)
    Abort from the router    -> abort in the engine, or release the lease
    KvPull (tcp transport)   -> KvSource replies with the leased blocks, or a refusal

A lease holds one reference to each block, so a block shared with the prefix cache stays
cached after release.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from kvrelay.engine.outputs import RequestOutput
from kvrelay.protocol.messages import GenerateRequest, KvAck, KvPull, KvReady, PeerInfo
from kvrelay.transport.blocks import PinnedStaging
from kvrelay.transport.copier import SlabCopier
from kvrelay.worker.router_links import token_event
from kvrelay.worker.runtime import Worker

logger = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class Lease:
    request_id: str
    block_ids: list[int]
    deadline: float  # wall clock, as sent in KvReady
    decode_id: str


class PrefillWorker(Worker):
    role_name = "prefill"
    # each first token goes out at once: a hand-off checksums the request's KV after it
    batch_events = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._targets: dict[str, PeerInfo] = {}
        self._origin_ids: dict[str, str] = {}  # request id -> its router (GenerateRequest.origin)
        self.leases: dict[str, Lease] = {}
        self._source: Any = None  # tcp KvSource, made on the first pull
        # the lease checksums' hashing threads (started on first use, kept between hand-offs),
        # and for a GPU pool the pinned host buffer its blocks are copied into
        self._copier = SlabCopier()
        self._staging = PinnedStaging() if self.device.type == "cuda" else None

    # ------------------------------------------------------------------ router side
    def on_generate(self, msg: GenerateRequest) -> None:
        if msg.decode is None:
            super().on_generate(msg)  # run it here end to end (a retry with no decode left)
            return
        self._targets[msg.request_id] = msg.decode
        self._origin_ids[msg.request_id] = msg.origin
        super().on_generate(msg)

    def _lease(self, lease: Lease) -> None:
        """Records ``lease``, first releasing an older attempt's lease of the same request: a
        router that re-ran the request after its decode died need not have aborted it here,
        and overwriting it lost its block references for good (a block leaked once in
        ``test_decode_killed_mid_stream_finishes_on_the_other``)."""
        self._release(lease.request_id)
        self.leases[lease.request_id] = lease

    def on_abort(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._origin_ids.pop(request_id, None)
        self.routers.origin.pop(request_id, None)
        self.engine.abort_request(request_id)
        self._release(request_id)

    def on_output(self, out: RequestOutput) -> None:
        target = self._targets.pop(out.request_id, None)
        origin = self._origin_ids.pop(out.request_id, "")
        attempt = self.routers.attempts.get(out.request_id, 0)  # send_event forgets it
        if target is None or out.finished:
            self.send_event(token_event(self.instance_id, out))
            return
        seq = self.engine.detach_request(out.request_id)
        assert seq is not None, "a request that just sampled is running"
        from kvrelay.transport.checksum import kv_checksum

        # the first token goes out before the lease checksum, which reads every KV byte
        self.send_event(token_event(self.instance_id, out, handed_off_to=target.instance_id))
        deadline = time.time() + self.config.lease_ttl
        self._lease(Lease(seq.seq_id, seq.block_ids, deadline, target.instance_id))
        ready = KvReady(
            request_id=seq.seq_id,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            params=seq.params,
            src=self.info,
            block_ids=list(seq.block_ids),
            num_tokens=seq.num_computed_tokens,
            checksum=kv_checksum(
                self.engine.runner.kv_cache, seq.block_ids, self._staging, self._copier
            ),
            lease_deadline=deadline,
            num_cached_tokens=seq.num_cached_tokens,
            cached_tokens_by_tier=seq.cached_tokens_by_tier,
            origin=origin,
            attempt=attempt,
        )
        self.send_peer(target.peer_addr, ready)

    # ------------------------------------------------------------------ peer side
    def on_peer_message(self, msg: Any, identity: bytes) -> None:
        if isinstance(msg, KvAck):
            if not msg.ok:
                logger.info(
                    "%s: %s not taken by decode: %s", self.instance_id, msg.request_id, msg.reason
                )
            self._release(msg.request_id)
        elif isinstance(msg, KvPull):
            self._kv_source().reply(self.peer, identity, msg)
        else:
            super().on_peer_message(msg, identity)

    def _kv_source(self) -> Any:
        if self._source is None:
            from kvrelay.transport.tcp import KvSource

            self._source = KvSource(self.engine.runner.kv_cache, self._leased_blocks)
        return self._source

    def _leased_blocks(self, request_id: str) -> list[int] | None:
        lease = self.leases.get(request_id)
        if lease is None or time.time() >= lease.deadline:
            return None
        return lease.block_ids

    # ------------------------------------------------------------------ leases
    def _release(self, request_id: str) -> None:
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self.engine.block_manager.release(lease.block_ids)

    def housekeeping(self) -> None:
        now = time.time()
        for lease in [lease for lease in self.leases.values() if now >= lease.deadline]:
            logger.warning(
                "%s: lease of %s to %s expired without an ack; freeing %d blocks",
                self.instance_id,
                lease.request_id,
                lease.decode_id,
                len(lease.block_ids),
            )
            self.metrics.leases_expired.inc()
            self._release(lease.request_id)
        super().housekeeping()

    def has_role_work(self) -> bool:
        return False

    def num_role_held_refs(self) -> int:
        return sum(len(lease.block_ids) for lease in self.leases.values())

    def num_pending_kv(self) -> int:
        return len(self.leases)

    def close_role(self) -> None:
        for request_id in list(self.leases):
            self._release(request_id)
        self._copier.close()
