"""L2 global tier: whole KV blocks in Redis, shared by every host (``--redis-url``).

Layout, one Redis string per block::

    key    namespace + BlockHash          b"kvrelay:" + 16 raw bytes, never a joined string
    value  a sealed block                 ``block_seal.py``: header + payload + HMAC, or
                                          header + nonce + AES-GCM ciphertext + tag (default),
                                          or header(xxh3) + payload without a credential

Redis is outside the trust boundary: every value read is opened with the cluster's key
(``BlockSealer.open_value``) before the engine sees it. One that fails (a forged, replayed,
foreign or unkeyed block) is a miss: counted under ``errors_by_reason`` (``bad_mac``,
``decrypt_failed``, ``unkeyed``, ...), logged (at most one line a minute), deleted, and the
engine recomputes the block.

Every value is written with ``SET key value EX ttl NX``: a block is never rewritten (equal keys
mean equal KV), its TTL is refreshed when it is written again, and the server evicts the least
recently used blocks on its own (``maxmemory-policy allkeys-lru``).

Reads are on the caller's thread: ``lookup`` one pipelined round trip, ``get`` one ``MGET`` per
``batch_blocks`` keys, stopping at the first gap (a reply of a long prefix would otherwise be
one 50+ MB reply that no per-call timeout fits). Writes are write-behind: ``put`` copies the
payloads into a bounded queue and returns; a daemon thread (``kvrelay-redis-writer``) drains
it in pipelined batches, so no write is ever on the TTFT path. A Redis that is absent, slow
or down is a miss, never a failed request:

    closed ──failure──▶ open: every call skips Redis (reads miss, puts drop) for the backoff
      ▲                  │    (0.5 s after the first failure, doubling up to 10 s)
      │                  ▼ backoff elapsed
      └──success──── half-open: the next call tries Redis ──failure──▶ open, backoff doubled
      ▲                  │
      └── PING answers ◀─┘ a probe thread (``kvrelay-redis-probe``) PINGs every
                           ``probe_interval`` while open: with no traffic, or a backoff grown to
                           10 s, the tier is back within one probe interval of Redis

``errors`` counts each failed call (and each corrupt value); calls skipped while open count in
``skipped_calls``. One warning is logged per outage and one info line on recovery.

Threads: ``lookup``/``get``/``put``/``stats``/``flush``/``close`` are called from the worker's
loop thread (``stats`` may also come from an admin thread); the writer thread is internal. The
breaker, the queue, the counters and the INFO cache are each guarded by a lock; the redis-py
connection pool is thread-safe. Memory: the queue holds at most ``queue_blocks`` copies of
``BlockSealer.value_bytes`` each, owned by the tier until written or dropped.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import numpy as np
from redis.exceptions import RedisError

from kvrelay.cachetier.base import (
    BlockFormat,
    CorruptBlock,
    KvTier,
    TierStats,
    key_bytes,
)
from kvrelay.cachetier.block_hash import BlockHash
from kvrelay.cachetier.block_seal import BlockSealer
from kvrelay.cachetier.redis_conn import CircuitBreaker, RedisEndpoint, create_client, redact_url

if TYPE_CHECKING:
    from kvrelay.protocol.credential import ClusterCredential

logger = logging.getLogger(__name__)

T = TypeVar("T")

INFO_CACHE_S = 1.0
CORRUPT_LOG_INTERVAL_S = 60.0
PROBE_INTERVAL_S = 1.0
CLOSE_FLUSH_S = 1.0
_FAILURES = (RedisError, OSError)


class _Write(NamedTuple):
    """One queued block: ``value`` holds the payload at ``BlockSealer.payload_offset``; the
    writer seals it. ``value`` None means: delete the key (a corrupt value a reader found)."""

    key: BlockHash
    value: bytearray | None


class RedisTier(KvTier):
    """Whole KV blocks in a Redis shared by every host; see the module docstring.

    Args:
        url: ``redis://[:password@]host:port/db`` (``rediss://``, ``unix://`` too), or a
            ``RedisEndpoint`` with a password file and TLS files.
        fmt: the block format of the model; values of another format read as corrupt.
        credential: the cluster credential whose keys seal the blocks; None: unkeyed blocks
            (anyone who can write Redis can forge KV; a trusted network only).
        encrypt: encrypt the blocks (AEAD) instead of only authenticating them.
        namespace: key prefix, so two clusters (or models) can share one Redis.
        ttl_seconds: expiry of a block, refreshed whenever it is written again.
        timeout: socket connect and read timeout of every call, in seconds.
        queue_blocks: blocks the write-behind queue holds; more are dropped and counted.
        batch_blocks: blocks the writer sends per pipeline, and a read asks for per MGET.
        probe_interval: seconds between PINGs while Redis is unavailable.
    """

    name = "redis"

    def __init__(
        self,
        url: str | RedisEndpoint,
        fmt: BlockFormat,
        credential: ClusterCredential | None = None,
        encrypt: bool = False,
        namespace: bytes = b"kvrelay:",
        ttl_seconds: int = 3600,
        timeout: float = 0.25,
        queue_blocks: int = 1024,
        batch_blocks: int = 32,
        probe_interval: float = PROBE_INTERVAL_S,
    ) -> None:
        for field, value in (
            ("probe_interval", probe_interval),
            ("ttl_seconds", ttl_seconds),
            ("timeout", timeout),
            ("queue_blocks", queue_blocks),
            ("batch_blocks", batch_blocks),
        ):
            if value <= 0:
                raise ValueError(f"{field} must be > 0, got {value!r}")
        endpoint = url if isinstance(url, RedisEndpoint) else RedisEndpoint(url)
        self._fmt = fmt
        self._sealer = BlockSealer(fmt, credential, encrypt)
        self._namespace = bytes(namespace)
        self._ttl = ttl_seconds
        self._queue_blocks = queue_blocks
        self._batch_blocks = batch_blocks
        self._url = redact_url(endpoint.url)
        self._client = create_client(endpoint, timeout)
        if credential is None:
            logger.warning(
                "redis tier %s: no cluster secret, so L2 blocks are unauthenticated: anyone "
                "who can write this Redis can make workers serve forged KV, and anyone who can "
                "read it reads users' KV (a trusted network only)",
                self._url,
            )
        self._last_corrupt_log = -CORRUPT_LOG_INTERVAL_S
        self._num_unlogged_corrupt = 0
        self._join_timeout = CLOSE_FLUSH_S + 8 * timeout  # a batch is a few bounded calls
        self._stats = TierStats()
        self._stats.counters.update(skipped_calls=0, refreshed_blocks=0)
        self._breaker = CircuitBreaker(self._url)
        self._info_lock = threading.Lock()
        self._info: tuple[float, dict[str, int]] = (-INFO_CACHE_S, {})
        # Write-behind queue: appended by put (loop thread), drained by the writer thread.
        self._cond = threading.Condition()
        self._queue: collections.deque[_Write] = collections.deque()
        self._num_in_flight = 0
        # Value buffers the writer is done with, reused by put: fresh memory costs page faults
        # that make a copy several times slower than memcpy. At most 2 batches are kept.
        self._free: list[bytearray] = []
        self._is_closing = False
        self._writer = threading.Thread(
            target=self._write_loop, name="kvrelay-redis-writer", daemon=True
        )
        self._writer.start()
        if self._call("connect", self._client.ping) is not None:
            logger.info(
                "redis tier %s: connected; blocks sealed with %s",
                self._url,
                self._sealer.seal.name,
            )
        self._probe_interval = probe_interval
        self._stop_probe = threading.Event()
        self._probe = threading.Thread(
            target=self._probe_loop, name="kvrelay-redis-probe", daemon=True
        )
        self._probe.start()

    # -- reads (caller's thread) -------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        self._stats.add(lookups=1, query_blocks=len(keys))
        if not keys:
            return 0
        start = time.perf_counter()
        present = self._call("lookup", lambda: self._exists(keys))
        if present is None:
            return 0
        num_hit = _leading_true(present)
        self._stats.add(hit_blocks=num_hit)
        self._stats.observe(time.perf_counter() - start)
        return num_hit

    def get(self, keys: Sequence[BlockHash]) -> list[np.ndarray]:
        self._stats.add(lookups=1, query_blocks=len(keys))
        if not keys:
            return []
        start = time.perf_counter()
        out: list[np.ndarray] = []
        for first in range(0, len(keys), self._batch_blocks):
            chunk = keys[first : first + self._batch_blocks]
            values = self._call("get", functools.partial(self._mget, chunk))
            if values is None or not self._open_prefix(chunk, values, out):
                break
        self._stats.add(hit_blocks=len(out), bytes_read=len(out) * self._fmt.payload_bytes)
        self._stats.observe(time.perf_counter() - start)
        return out

    def _open_prefix(
        self, keys: Sequence[BlockHash], values: Sequence[bytes | None], out: list[np.ndarray]
    ) -> bool:
        """Appends the payloads of the leading valid values to ``out``; False at a gap."""
        for i, (key, value) in enumerate(zip(keys, values)):
            if value is None:
                return False
            try:
                out.append(self._sealer.open_value(key, value))
            except CorruptBlock as exc:
                self._discard_corrupt(key, exc)
                self._sweep(keys[i + 1 :], values[i + 1 :])
                return False
        return True

    def _mget(self, keys: Sequence[BlockHash]) -> list[bytes | None]:
        return self._client.mget([self._key(k) for k in keys])  # type: ignore[return-value]

    def _exists(self, keys: Sequence[BlockHash]) -> list[Any]:
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.exists(self._key(key))
        return pipe.execute()

    def _sweep(self, keys: Sequence[BlockHash], values: Sequence[bytes | None]) -> None:
        """Checks the values after a rejected one and discards the bad ones too: where one
        block was forged, others likely were, and the writer's ``SET NX`` would otherwise
        keep them (only refreshing their TTL) however often the good block is recomputed.
        Costs nothing unless a value was already rejected."""
        for key, value in zip(keys, values):
            if value is not None:
                try:
                    self._sealer.open_value(key, value)
                except CorruptBlock as exc:
                    self._discard_corrupt(key, exc)

    def _discard_corrupt(self, key: BlockHash, exc: CorruptBlock) -> None:
        """Counts the error and has the writer delete the value (NX would keep it forever);
        logs at most one line per ``CORRUPT_LOG_INTERVAL_S``, with the count since the last."""
        self._stats.error(exc.reason)
        now = time.monotonic()
        if now - self._last_corrupt_log < CORRUPT_LOG_INTERVAL_S:
            self._num_unlogged_corrupt += 1
        else:
            logger.warning(
                "redis tier %s: rejected block %s (%s: %s; %d more rejected since the last "
                "line): read as a miss and recomputed",
                self._url,
                key.hex(),
                exc.reason,
                exc,
                self._num_unlogged_corrupt,
            )
            self._last_corrupt_log = now
            self._num_unlogged_corrupt = 0
        with self._cond:
            self._queue.append(_Write(key, None))
            self._cond.notify()

    # -- writes ------------------------------------------------------------------------------

    def put(self, items: Sequence[tuple[BlockHash, np.ndarray]]) -> int:
        """Queues copies of the payloads and returns at once; see ``flush``."""
        for _, payload in items:
            if payload.dtype != np.uint8 or payload.nbytes != self._fmt.payload_bytes:
                raise ValueError(
                    f"payload must be uint8 of {self._fmt.payload_bytes} bytes, "
                    f"got {payload.dtype} of {payload.nbytes}"
                )
        if not self._breaker.allows():
            self._stats.add(skipped_calls=1, dropped_puts=len(items))
            return 0
        with self._cond:
            room = 0 if self._is_closing else self._queue_blocks - len(self._queue)
            accepted = items[: max(room, 0)]
            buffers = [self._free.pop() for _ in range(min(len(accepted), len(self._free)))]
        writes = [self._copy(key, payload, buffers) for key, payload in accepted]
        with self._cond:
            self._queue.extend(writes)
            self._cond.notify()
        self._stats.add(dropped_puts=len(items) - len(writes))
        return len(writes)

    def flush(self, timeout: float = 5.0) -> bool:
        """Waits until every queued write was sent (or dropped); False if ``timeout`` ran out."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._num_in_flight, timeout=timeout
            )

    def _copy(self, key: BlockHash, payload: np.ndarray, buffers: list[bytearray]) -> _Write:
        value = buffers.pop() if buffers else bytearray(self._sealer.value_bytes)
        start = self._sealer.payload_offset
        end = start + self._fmt.payload_bytes
        np.frombuffer(value, dtype=np.uint8)[start:end] = payload.reshape(-1)
        return _Write(key, value)

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._is_closing)
                if self._is_closing:
                    self._stats.add(dropped_puts=sum(w.value is not None for w in self._queue))
                    self._queue.clear()
                    self._cond.notify_all()
                    return
                batch = [
                    self._queue.popleft() for _ in range(min(self._batch_blocks, len(self._queue)))
                ]
                self._num_in_flight = len(batch)
            try:
                self._write_batch(batch)
            finally:
                with self._cond:
                    self._num_in_flight = 0
                    self._recycle(batch)
                    self._cond.notify_all()

    def _recycle(self, batch: list[_Write]) -> None:
        """Keeps finished value buffers for reuse (caller holds ``_cond``)."""
        room = 2 * self._batch_blocks - len(self._free)
        self._free.extend([w.value for w in batch if w.value is not None][: max(room, 0)])

    def _write_batch(self, batch: list[_Write]) -> None:
        if self._call("put", lambda: self._send(batch)) is None:
            self._stats.add(dropped_puts=sum(w.value is not None for w in batch))

    def _send(self, batch: list[_Write]) -> bool:
        """Two round trips: EXPIRE every key (refreshes the TTL, and tells which exist), then
        ``SET NX EX`` only the missing ones, so a shared block is not sent again."""
        deletes = [self._key(w.key) for w in batch if w.value is None]
        writes = [w for w in batch if w.value is not None]
        pipe = self._client.pipeline(transaction=False)
        if deletes:
            pipe.delete(*deletes)
        for w in writes:
            pipe.expire(self._key(w.key), self._ttl)
        replies = pipe.execute()[1 if deletes else 0 :]
        missing = [w for w, exists in zip(writes, replies) if not exists]
        for w in missing:
            assert w.value is not None
            value = self._sealer.seal_value(w.key, w.value)
            pipe.set(self._key(w.key), memoryview(value), ex=self._ttl, nx=True)
        stored = sum(bool(r) for r in pipe.execute()) if missing else 0
        self._stats.add(
            put_blocks=stored,
            bytes_written=stored * self._sealer.value_bytes,
            refreshed_blocks=len(writes) - stored,
        )
        return True

    # -- stats and lifetime ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        out = self._stats.snapshot()
        with self._cond:
            queue_depth = len(self._queue) + self._num_in_flight
        out.update(
            available=self._breaker.is_available,
            url=self._url,
            queue_depth=queue_depth,
            seal=self._sealer.seal.name.lower(),
        )
        out.update(self._server_info())
        return out

    def _server_info(self) -> dict[str, int]:
        """``used_bytes``/``maxmemory``/``evicted_keys`` from INFO, at most once a second."""
        with self._info_lock:
            fetched_at, info = self._info
            if time.monotonic() - fetched_at < INFO_CACHE_S:
                return info
            if not self._breaker.allows():
                return {}

            def fetch() -> list[Any]:
                pipe = self._client.pipeline(transaction=False)
                pipe.info("memory")
                pipe.info("stats")
                return pipe.execute()

            replies = self._call("info", fetch)
            if replies is None:
                return {}
            memory, stats = replies
            info = {
                "used_bytes": int(memory.get("used_memory", 0)),
                "maxmemory": int(memory.get("maxmemory", 0)),
                "evicted_keys": int(stats.get("evicted_keys", 0)),
            }
            self._info = (time.monotonic(), info)
            return info

    def _probe_loop(self) -> None:
        """While the breaker is open, PINGs Redis every interval; an answer closes it. A failed
        probe is neither an error nor a longer backoff: the outage is already counted."""
        while not self._stop_probe.wait(self._probe_interval):
            if self._breaker.is_available:
                continue
            try:
                self._client.ping()
            except _FAILURES:
                continue
            self._breaker.record_success()

    def close(self) -> None:
        """Flushes for up to a second, drops what is left (counted), stops the writer."""
        self._stop_probe.set()
        self._probe.join(timeout=self._join_timeout)
        if self._writer.is_alive():
            self.flush(CLOSE_FLUSH_S)
            with self._cond:
                self._is_closing = True
                self._cond.notify_all()
            self._writer.join(timeout=self._join_timeout)
        self._client.close()

    # -- helpers -----------------------------------------------------------------------------

    def _key(self, key: BlockHash) -> bytes:
        return self._namespace + key_bytes(key)

    def _call(self, op: str, fn: Callable[[], T]) -> T | None:
        """``fn()`` guarded by the breaker: None when skipped or failed (counted, logged once)."""
        if not self._breaker.allows():
            self._stats.add(skipped_calls=1)
            return None
        try:
            result = fn()
        except _FAILURES as exc:
            self._stats.error("unavailable")
            self._breaker.record_failure(op, exc)
            return None
        self._breaker.record_success()
        return result


def _leading_true(flags: Sequence[Any]) -> int:
    for i, flag in enumerate(flags):
        if not flag:
            return i
    return len(flags)
