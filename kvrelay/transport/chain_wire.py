"""The chain transfer's wire: what an object is (``ChainMeta``) and the messages that move it.

Decides what a receiver is told before the data (name, header, sizes, per-chunk xxh3-64
checksums), how sources are ordered in a chain (``plan_chain``), and the message kinds both
ends speak. ``chain_server`` serves an object, ``chain_fetch`` pulls one.

Wire (ZMQ; the receiver's DEALER talks to the server's ROUTER, which adds/strips identity)::

    DEALER [b"M"]              -->  ROUTER   <--  [b"M", msgpack(meta fields)]
    DEALER [b"C", u64 index]   -->  ROUTER   <--  [b"C", u64 index, chunk bytes]
                                             <--  [b"W", u64 available]  (while held; heartbeat)
                                             <--  [b"E", reason]
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvrelay.protocol.errors import TransferError

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np

    BufferLike: TypeAlias = "memoryview | np.ndarray | bytearray"

DEFAULT_CHUNK_BYTES = 4 << 20
HEARTBEAT_S = 0.25  # a server's W interval; a receiver's timeout must be well above it

MSG_META, MSG_CHUNK, MSG_WAIT, MSG_ERROR = b"M", b"C", b"W", b"E"
U64 = struct.Struct("<Q")


class ChainError(TransferError):
    """No source could deliver the object; the destination buffer holds nothing valid."""


@dataclasses.dataclass(frozen=True)
class ChainMeta:
    """What a receiver needs before the data: identity, sizes and per-chunk checksums."""

    name: str
    """Object name, e.g. the model fingerprint."""
    header: bytes
    """Opaque bytes the owner needs to use the data (e.g. the pool's tensor table)."""
    total_bytes: int
    """Data size; the last chunk may be short."""
    chunk_bytes: int
    """Bytes per chunk (the unit of forwarding and of checksums)."""
    checksums: Sequence[int]
    """xxh3-64 of each chunk, in order (stored as a tuple)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "checksums", tuple(self.checksums))
        if not isinstance(self.name, str) or not isinstance(self.header, bytes):
            raise ValueError(f"name must be str and header bytes, got {self.name!r}")
        if self.chunk_bytes <= 0 or self.total_bytes < 0:
            raise ValueError(f"bad sizes: total {self.total_bytes}, chunk {self.chunk_bytes}")
        if len(self.checksums) != self.num_chunks:
            raise ValueError(f"{len(self.checksums)} checksums for {self.num_chunks} chunks")

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``index``."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)


def chunk_checksums(buffer: memoryview | np.ndarray | bytes, chunk_bytes: int) -> list[int]:
    """xxh3-64 of each ``chunk_bytes`` piece of ``buffer``."""
    view = memoryview(buffer).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    return [
        xxhash.xxh3_64_intdigest(view[start : start + chunk_bytes])
        for start in range(0, view.nbytes, chunk_bytes)
    ]


def create_meta(
    name: str,
    header: bytes,
    buffer: memoryview | np.ndarray | bytes,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ChainMeta:
    """The ``ChainMeta`` of a complete buffer (checksums computed here)."""
    total_bytes = memoryview(buffer).nbytes  # type: ignore[arg-type]  # numpy arrays are buffers
    return ChainMeta(name, header, total_bytes, chunk_bytes, chunk_checksums(buffer, chunk_bytes))


def plan_chain(origin: str, receivers: Sequence[str]) -> dict[str, list[str]]:
    """Sources for each receiver: its predecessor first, then earlier hops, the origin last.

    ``plan_chain("A", ["B", "C", "D"])["D"] == ["C", "B", "A"]``.
    """
    hops = [origin, *receivers]
    if len(set(hops)) != len(hops):
        raise ValueError(f"addresses must be distinct: {hops}")
    return {hops[k]: hops[k - 1 :: -1] for k in range(1, len(hops))}


def byte_view(buffer: BufferLike, nbytes: int, writable: bool) -> memoryview:
    view = memoryview(buffer)  # type: ignore[arg-type]  # numpy arrays are buffers
    if not view.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"buffer of {view.nbytes} bytes, the object has {nbytes}")
    if writable and view.readonly:
        raise ValueError("the destination buffer is read-only")
    return view
