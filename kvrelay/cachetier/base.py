"""KV cache tiers below the device pool: the interface, the stored block format, the stats.

A tier stores whole blocks (every layer's K and V of ``block_size`` tokens) keyed by the
chained ``BlockHash`` (``block_hash.py``). Each stored value is a 64-byte header followed by
the block's raw bytes::

    offset  size  field
    0       4     magic b"KVRB"
    4       2     format version (1)
    6       2     dtype code (0 float32, 1 bfloat16, 2 float16)
    8       4     num_layers          12  4  block_size
    16      4     num_kv_heads        20  4  head_dim
    24      8     payload bytes
    32      8     xxh3-64 of the payload (0 in a sealed value)
    40      16    the block's key (BlockHash)
    56      1     seal: 0 unkeyed (the xxh3 checksum), 1 HMAC, 2 AEAD (``block_seal.py``)
    57      7     reserved (0)

A reader checks every field against what it expects before using the payload; anything
off is a miss, never an error to the request. The xxh3 checksum finds accidents (a torn
write, a bug), not forgeries: anyone who can write the store can recompute it. Values that
leave the process (L2) are sealed with a key instead, see ``block_seal.py``. Tiers are
caches: a ``get`` may miss what a ``lookup`` just reported (eviction in between), and callers
must handle that.
"""

from __future__ import annotations

import abc
import dataclasses
import struct
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from kvrelay.cachetier.block_hash import HASH_BYTES, BlockHash

MAGIC = b"KVRB"
FORMAT_VERSION = 1
HEADER_BYTES = 64
DTYPE_CODES = {"float32": 0, "bfloat16": 1, "float16": 2}
DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}
_HEADER = struct.Struct("<4sHHIIIIQQ16sB7x")
SEAL_CHECKSUM = 0  # unkeyed: xxh3-64 of the payload in the header
SEAL_MAC = 1  # HMAC-SHA256 trailer over header, key and payload
SEAL_AEAD = 2  # AES-256-GCM: nonce, ciphertext, tag after the header
assert _HEADER.size == HEADER_BYTES


class CorruptBlock(ValueError):
    """A stored block whose header or checksum does not match what the reader expects.

    ``reason`` labels the rejection in metrics: ``bad_header`` (format, size or key),
    ``bad_checksum``, ``bad_mac``, ``decrypt_failed``, ``unkeyed`` (an unsealed value where
    a key was expected) or ``wrong_seal``.
    """

    def __init__(self, message: str, reason: str = "bad_header") -> None:
        super().__init__(message)
        self.reason = reason


@dataclasses.dataclass(frozen=True, slots=True)
class BlockFormat:
    """The per-block layout every block of one model has (``KvLayout`` minus the count)."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_CODES)}, got {self.dtype!r}")

    @property
    def payload_bytes(self) -> int:
        """Bytes of one block: ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""
        elems = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return elems * DTYPE_SIZES[self.dtype]

    @property
    def value_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes


def pack_header(
    fmt: BlockFormat,
    key: BlockHash,
    payload: np.ndarray | memoryview | None,
    seal: int = SEAL_CHECKSUM,
) -> bytes:
    """The 64-byte header for ``payload`` (uint8, ``fmt.payload_bytes`` long) under ``key``;
    a sealed header (``payload`` None) carries no checksum."""
    checksum = 0
    if payload is not None:
        checksum = xxhash.xxh3_64_intdigest(memoryview(payload))  # type: ignore[arg-type]
    return _HEADER.pack(
        MAGIC,
        FORMAT_VERSION,
        DTYPE_CODES[fmt.dtype],
        fmt.num_layers,
        fmt.block_size,
        fmt.num_kv_heads,
        fmt.head_dim,
        fmt.payload_bytes,
        checksum,
        bytes(key),
        seal,
    )


def check_value(
    fmt: BlockFormat, key: BlockHash, value: bytes | memoryview | np.ndarray
) -> memoryview:
    """Returns the payload of a stored value after checking header and checksum.

    Raises CorruptBlock naming the first field that does not match.
    """
    buf = memoryview(value).cast("B")  # type: ignore[arg-type]
    if len(buf) != fmt.value_bytes:
        raise CorruptBlock(f"value is {len(buf)} bytes, expected {fmt.value_bytes}")
    seal, checksum = check_header(fmt, key, buf[:HEADER_BYTES])
    if seal != SEAL_CHECKSUM:
        raise CorruptBlock(
            f"a sealed value (seal {seal}) where a checksum was expected", "wrong_seal"
        )
    payload = buf[HEADER_BYTES:]
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        raise CorruptBlock("payload checksum mismatch", "bad_checksum")
    return payload


def check_header(fmt: BlockFormat, key: BlockHash, header: memoryview) -> tuple[int, int]:
    """``(seal, checksum)`` of a 64-byte header after checking it names ``fmt`` and ``key``."""
    magic, version, dtype, layers, bs, heads, dim, nbytes, checksum, stored_key, seal = (
        _HEADER.unpack(header)
    )
    expected = (MAGIC, FORMAT_VERSION, DTYPE_CODES[fmt.dtype], fmt.num_layers, fmt.block_size)
    if (magic, version, dtype, layers, bs) != expected or (heads, dim) != (
        fmt.num_kv_heads,
        fmt.head_dim,
    ):
        raise CorruptBlock("header does not match the expected block format")
    if nbytes != fmt.payload_bytes or stored_key != bytes(key):
        raise CorruptBlock("header names another key or size")
    return seal, checksum


class TierStats:
    """Counters of one tier in one process; thread-safe; latencies kept as a bounded sample."""

    _SAMPLES = 2048

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(
            (
                "lookups",  # lookup/get calls
                "query_blocks",  # blocks asked for
                "hit_blocks",  # blocks returned
                "put_blocks",  # blocks stored
                "bytes_read",
                "bytes_written",
                "evictions",
                "errors",  # failed operations (tier down, timeouts, corrupt values)
                "dropped_puts",  # writes given up (queue full, tier down)
            ),
            0,
        )
        self.errors_by_reason: dict[str, int] = {}  # the ``errors`` counter split by reason
        self._latencies: list[float] = []
        self._next = 0

    def error(self, reason: str) -> None:
        """Counts one failed operation or rejected value under ``reason`` (a metric label)."""
        with self._lock:
            self.counters["errors"] += 1
            self.errors_by_reason[reason] = self.errors_by_reason.get(reason, 0) + 1

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, value in deltas.items():
                self.counters[name] += value

    def observe(self, seconds: float) -> None:
        with self._lock:
            if len(self._latencies) < self._SAMPLES:
                self._latencies.append(seconds)
            else:
                self._latencies[self._next] = seconds
                self._next = (self._next + 1) % self._SAMPLES

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self.counters)
            out["errors_by_reason"] = dict(self.errors_by_reason)
            lat = sorted(self._latencies)
        out["hit_rate"] = out["hit_blocks"] / out["query_blocks"] if out["query_blocks"] else 0.0
        out["latency_p50_ms"] = _quantile(lat, 0.5) * 1e3
        out["latency_p99_ms"] = _quantile(lat, 0.99) * 1e3
        return out


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


class TierChanges(NamedTuple):
    """Keys one process wrote into and evicted from a tier since it last asked (the feed of
    the router's placement index). A key in neither list is unchanged as far as this
    process knows; one key is never in both (the later of its changes wins)."""

    stored: list[bytes]
    evicted: list[bytes]


class KvTier(abc.ABC):
    """A store of whole KV blocks keyed by block hash, shared beyond one instance.

    Contract:
    - Keys are 16-byte ``BlockHash`` values; every value is checked on read (header and
      checksum, ``check_value``; a tier outside the trust boundary checks a keyed tag,
      ``block_seal.py``); a bad value counts as an error (``TierStats.error`` with its
      reason) and reads as a miss.
    - ``lookup`` and ``get`` answer for the longest *prefix* of ``keys``: a chain of blocks
      is only useful up to its first gap.
    - ``get`` returns fresh copies (the caller owns them); the tier keeps nothing borrowed.
    - ``put`` may be asynchronous (write-behind) and may drop blocks; it never raises for a
      tier that is down — it counts the error and returns.
    - Every method is safe to call from the worker's loop thread; a tier that runs a thread
      of its own says so. Nothing blocks longer than the tier's configured timeout.
    """

    name: str  # "host" | "redis"

    @abc.abstractmethod
    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """Number of leading ``keys`` present now (a hint)."""

    @abc.abstractmethod
    def get(self, keys: Sequence[BlockHash]) -> list[np.ndarray]:
        """Payloads (uint8, ``payload_bytes`` each) of the longest present, valid prefix."""

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[BlockHash, np.ndarray]]) -> int:
        """Stores payloads (uint8, ``payload_bytes`` each); returns how many were accepted."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters (``TierStats.snapshot``) plus capacity/used figures where known."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases the tier's resources in this process (never the shared data)."""

    def take_changes(self) -> TierChanges | None:
        """What this process stored and evicted since the last call, then forgets it.

        None: the tier does not report its contents (the default; Redis is global, so it
        tells placement nothing). A reporting tier says only what *this* process did;
        another writer reports its own changes.
        """
        return None


def key_bytes(key: BlockHash) -> bytes:
    assert len(key) == HASH_BYTES
    return bytes(key)
