"""Decode worker: takes KV hand-offs when it has room, pulls, verifies, continues decoding.

Per hand-off (``KvReady`` from a prefill worker)::

    pending (FIFO; by priority under --scheduling-policy priority, where a less urgent
    running stream is preempted to make room) --room? (a slot and the blocks)--> take blocks
        pull through the transport chosen for the pair (shm / tcp / cuda_ipc)
          verified (fingerprint, layout, checksum) -> KvAck(ok) -> import into the engine
          failed (checksum, lease gone, peer dead) -> release blocks, KvAck(not ok),
                                                      recompute the prompt here
    lease deadline passed while waiting for room -> KvAck(not ok), recompute here
    Abort while pending -> KvAck(not ok) so prefill frees at once; nothing is imported

Back-pressure lives here: prefill keeps the blocks until decode has room, and the router
sees ``num_pending_kv`` in the load report. No path imports unverified blocks.
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from typing import Any

from kvrelay.engine.admission import RequestError
from kvrelay.protocol.messages import KvAck, KvReady
from kvrelay.worker.runtime import Worker

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role_name = "decode"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pending: collections.deque[KvReady] = collections.deque()
        self._transports: dict[str, Any] = {}
        self._corrupt_left = self.config.corrupt_transfers
        self.num_recomputed = 0

    def on_peer_message(self, msg: Any, identity: bytes) -> None:
        if isinstance(msg, KvReady):
            self.adopt_origin(msg.request_id, msg.origin)
            self.routers.attempts[msg.request_id] = msg.attempt
            # in priority order (stable: arrival within a priority); under fcfs every
            # priority is 0 (the engine refuses others), so this is arrival order
            bisect.insort(self.pending, msg, key=lambda ready: ready.params.priority)
        else:
            super().on_peer_message(msg, identity)

    def on_abort(self, request_id: str) -> None:
        for ready in [r for r in self.pending if r.request_id == request_id]:
            self.pending.remove(ready)
            self.send_peer(ready.src.peer_addr, KvAck(request_id, False, "aborted"))
        self.routers.origin.pop(request_id, None)
        self.engine.abort_request(request_id)

    def request_ids(self) -> list[str]:
        return [*super().request_ids(), *(ready.request_id for ready in self.pending)]

    def has_role_work(self) -> bool:
        return bool(self.pending) and self.engine.scheduler.can_take_running()

    def num_pending_kv(self) -> int:
        return len(self.pending)

    def housekeeping(self) -> None:
        self._take_pending()
        super().housekeeping()

    # ------------------------------------------------------------------ intake
    def _take_pending(self) -> None:
        bm = self.engine.block_manager
        scheduler = self.engine.scheduler
        while self.pending:
            ready = self.pending[0]
            if time.time() >= ready.lease_deadline:
                self.pending.popleft()
                self._recompute(ready, "lease expired before decode had room")
                continue
            num_blocks = -(-ready.num_tokens // bm.block_size)
            blocks = bm.take_blocks(num_blocks) if scheduler.can_take_running() else None
            if blocks is None:
                # no room: a less urgent stream makes room under the priority policy, else
                # prefill keeps holding the blocks (back-pressure)
                if scheduler.preempt_less_urgent(ready.params.priority):
                    continue
                return
            self.pending.popleft()
            self._pull(ready, blocks)

    def _pull(self, ready: KvReady, blocks: list[int]) -> None:
        from kvrelay.protocol.errors import TransferError
        from kvrelay.transport.base import PullSpec
        from kvrelay.transport.registry import choose_transport

        name = choose_transport(ready.src, self.info, self.config.transport)
        try:
            stats = self._transport(name).pull(
                PullSpec.from_ready(ready),
                self.engine.runner.kv_cache,
                blocks,
                self.layout,
                self.engine.fingerprint,
                self.config.transfer_timeout,
            )
            self._maybe_corrupt(ready, blocks)
        except TransferError as e:
            self.engine.block_manager.release(blocks)
            self.metrics.transfer_failures.labels(name, type(e).__name__).inc()
            self._recompute(ready, f"{name} pull failed: {e}")
            return
        self.metrics.transfer_seconds.labels(name).observe(stats.seconds)
        self.metrics.transfer_bytes.labels(name).inc(stats.num_bytes)
        self.send_peer(ready.src.peer_addr, KvAck(ready.request_id, True))
        try:
            self.engine.import_request(
                ready.request_id,
                ready.prompt_token_ids,
                ready.output_token_ids,
                ready.params,
                blocks,
                ready.num_cached_tokens,
                ready.cached_tokens_by_tier,
            )
        except RequestError as e:
            self.engine.block_manager.release(blocks)
            self._recompute(ready, str(e))

    def _maybe_corrupt(self, ready: KvReady, blocks: list[int]) -> None:
        """Test hook: flip bytes of a verified transfer, then verify again, as a bad wire would."""
        if self._corrupt_left <= 0:
            return
        from kvrelay.protocol.errors import ChecksumMismatch
        from kvrelay.transport.checksum import kv_checksum

        self._corrupt_left -= 1
        pool = self.engine.runner.kv_cache
        pool[0, 0, blocks[0]].view(-1)[0] += 1.0
        if kv_checksum(pool, blocks) != ready.checksum:
            raise ChecksumMismatch(
                f"{ready.request_id}: checksum mismatch (corrupted by test hook)"
            )

    def _recompute(self, ready: KvReady, reason: str) -> None:
        """Falls back to computing the prompt here; tells prefill to free its lease."""
        logger.warning("%s: recomputing %s: %s", self.instance_id, ready.request_id, reason)
        self.send_peer(ready.src.peer_addr, KvAck(ready.request_id, False, reason))
        self.num_recomputed += 1
        try:
            self.engine.add_request(
                ready.request_id,
                ready.prompt_token_ids,
                ready.params,
                output_token_ids=ready.output_token_ids,
            )
        except (RequestError, ValueError) as e:
            logger.error("%s: cannot recompute %s: %s", self.instance_id, ready.request_id, e)

    def _transport(self, name: str) -> Any:
        transport = self._transports.get(name)
        if transport is None:
            from kvrelay.transport.registry import create_transport

            kwargs = {"context": self.ctx, "security": self.security} if name == "tcp" else {}
            transport = self._transports[name] = create_transport(name, **kwargs)
        return transport

    def stats(self) -> dict[str, Any]:
        return {
            **super().stats(),
            "num_pending_kv": len(self.pending),
            "num_recomputed": self.num_recomputed,
        }

    def close_role(self) -> None:
        for transport in self._transports.values():
            transport.close()
