"""Parameter pool segment format: header, manifest, data layout, chunk checksums.

Decides how a pool's bytes lie in its ``/dev/shm`` segment and how they are checked; creating,
reading and unlinking one segment file. Who may use a segment is ``param_locks``; naming and
collecting segments is ``param_ops``; attaching to one is ``param_pool``.

Segment ``/dev/shm/kvrelay-params-[<scope>-]<fingerprint hex16>-<dtype>`` (little-endian)::

    offset       size            contents
    0            104 (of 128)    fixed header: magic "KVRLPRM1", version, state, fingerprint
                                 (16 B), dtype, data_off, total_bytes, chunk_bytes,
                                 manifest_len, builder pid, created, last_used (unix s)
    128          256 x 16        user slots: pid u64, attached_at f64 (pid 0: free)
    4224         manifest_len    manifest (msgpack, ``Manifest``): fingerprint, dtype,
                                 total_bytes, chunk_bytes, tensors [name, dtype, shape,
                                 offset, nbytes], checksums (xxh3-64 of each chunk, u64 LE),
                                 source (the checkpoint directory)
    data_off     total_bytes     data: every tensor at a 64-byte aligned offset;
    (page aligned)               chunk i = data[i * chunk_bytes : (i + 1) * chunk_bytes]

    state:  EMPTY 0 (header not written yet) -> BUILDING 1 -> READY 2
            not READY while nobody holds the build lock = stale (its builder died): the next
            attach or gc unlinks it

The header carries a format version (``_VERSION``), bumped when the runtime weight layout
changes; a segment of another version reads as ``OutdatedPool``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import math
import mmap
import os
import struct
import time
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from kvrelay.cachetier.segments import SHM_DIR, shm_room

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

CHUNK_BYTES = 4 << 20
MAX_USERS = 256
TENSOR_ALIGN = 64

EMPTY, BUILDING, READY = 0, 1, 2
ITEM_SIZES = {
    "float32": 4, "float16": 2, "bfloat16": 2, "float64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}  # fmt: skip

_MAGIC = b"KVRLPRM1"
_VERSION = 2  # 2: projection weights stored [in, out]
_FIXED = struct.Struct("<8sII16s16sQQQQQdd")
_STATE = struct.Struct("<I")
_STATE_POS = 12
_LAST_USED = struct.Struct("<d")
_LAST_USED_POS = 96
_SLOT = struct.Struct("<Qd")
_SLOTS_POS = 128
_MANIFEST_POS = _SLOTS_POS + MAX_USERS * _SLOT.size


class CorruptPool(ValueError):
    """A manifest, header or chunk that fails its checks."""


class OutdatedPool(CorruptPool):
    """A pool written by another version of this format (say, before a weight-layout change).

    Never attached. ``attach_or_create`` replaces it (processes that map it keep their
    mapping); ``gc`` and ``remove`` free it once no live process maps it.
    """

    def __init__(self, version: int) -> None:
        super().__init__(f"pool of format version {version}, this is version {_VERSION}")
        self.version = version


@dataclasses.dataclass(frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str  # a key of ITEM_SIZES
    shape: tuple[int, ...]
    offset: int  # in the data region, a multiple of TENSOR_ALIGN
    nbytes: int


@dataclasses.dataclass(frozen=True, slots=True)
class Manifest:
    """Everything needed to lay out and check a pool's data (the peer-transfer header)."""

    fingerprint: bytes  # 16 bytes, ``identity.model_identity`` (every byte, dtype)
    dtype: str  # the pool's dtype (part of its name)
    total_bytes: int  # data region size
    chunk_bytes: int  # checksum (and transfer) unit
    tensors: tuple[TensorEntry, ...]
    checksums: tuple[int, ...]  # xxh3-64 of each chunk; zeros until the data is written
    source: str = ""  # the checkpoint directory it was built from (on the builder's host)

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    @classmethod
    def plan(
        cls,
        fingerprint: bytes,
        dtype: str,
        tensors: Mapping[str, torch.Tensor],
        chunk_bytes: int,
        source: str = "",
    ) -> Manifest:
        """The layout of ``tensors`` in order, 64-byte aligned; checksums zero."""
        entries, offset = [], 0
        for name, t in tensors.items():
            tdtype = str(t.dtype).removeprefix("torch.")
            nbytes = t.numel() * t.element_size()
            entries.append(TensorEntry(name, tdtype, tuple(t.shape), offset, nbytes))
            offset = _round_up(offset + nbytes, TENSOR_ALIGN)
        total = entries[-1].offset + entries[-1].nbytes if entries else 0
        num_chunks = -(-total // chunk_bytes)
        sums = (0,) * num_chunks
        return cls(fingerprint, dtype, total, chunk_bytes, tuple(entries), sums, source)

    def encode(self) -> bytes:
        """msgpack; its length does not depend on the checksum values."""
        return msgpack.packb(
            {
                "version": _VERSION,
                "fingerprint": self.fingerprint,
                "dtype": self.dtype,
                "total_bytes": self.total_bytes,
                "chunk_bytes": self.chunk_bytes,
                "tensors": [
                    [e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.tensors
                ],
                "checksums": struct.pack(f"<{len(self.checksums)}Q", *self.checksums),
                "source": self.source,
            }
        )

    @classmethod
    def decode(cls, data: bytes) -> Manifest:
        """Raises CorruptPool for anything but a consistent manifest of this version."""
        try:
            d = msgpack.unpackb(data)
            if d["version"] != _VERSION:
                raise CorruptPool(f"manifest version {d['version']}, expected {_VERSION}")
            sums = d["checksums"]
            manifest = cls(
                bytes(d["fingerprint"]),
                str(d["dtype"]),
                int(d["total_bytes"]),
                int(d["chunk_bytes"]),
                tuple(
                    TensorEntry(str(n), str(t), tuple(map(int, s)), int(o), int(b))
                    for n, t, s, o, b in d["tensors"]
                ),
                struct.unpack(f"<{len(sums) // 8}Q", sums),
                str(d.get("source", "")),
            )
        except CorruptPool:
            raise
        except (ValueError, TypeError, KeyError, struct.error, msgpack.UnpackException) as exc:
            raise CorruptPool(f"unreadable manifest: {exc!r}") from None
        manifest.check()
        return manifest

    def check(self) -> None:
        """Raises CorruptPool if the manifest does not describe a valid data region."""
        if len(self.fingerprint) != 16 or self.dtype not in ITEM_SIZES or self.chunk_bytes <= 0:
            raise CorruptPool(f"bad manifest: {self.fingerprint!r} {self.dtype} {self.chunk_bytes}")
        if len(self.checksums) != self.num_chunks:
            raise CorruptPool(f"{len(self.checksums)} checksums for {self.num_chunks} chunks")
        for e in self.tensors:
            is_sized = e.nbytes == ITEM_SIZES.get(e.dtype, -1) * math.prod(e.shape)
            is_placed = (
                e.offset % TENSOR_ALIGN == 0 and 0 <= e.offset <= self.total_bytes - e.nbytes
            )
            if not (is_sized and is_placed):
                raise CorruptPool(f"bad tensor entry {e}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Header:
    state: int
    fingerprint: bytes
    dtype: str
    data_off: int
    total_bytes: int
    chunk_bytes: int
    manifest_len: int
    builder_pid: int
    created: float
    last_used: float

    def pack(self) -> bytes:
        return _FIXED.pack(
            _MAGIC, _VERSION, self.state, self.fingerprint, self.dtype.encode(), self.data_off,
            self.total_bytes, self.chunk_bytes, self.manifest_len, self.builder_pid,
            self.created, self.last_used,
        )  # fmt: skip

    @classmethod
    def read(cls, fd: int) -> _Header | None:
        """The header, or None if it was never written (EMPTY).

        Raises:
            CorruptPool: another format or version wrote the segment.
        """
        raw = os.pread(fd, _FIXED.size, 0)
        if len(raw) < _FIXED.size or raw[: len(_MAGIC)] == bytes(len(_MAGIC)):
            return None
        magic, version, state, fp, dtype, *rest = _FIXED.unpack(raw)
        if magic == _MAGIC and version != _VERSION:
            raise OutdatedPool(version)
        if magic != _MAGIC:
            raise CorruptPool(f"segment of another format: {magic!r} version {version}")
        return cls(state, fp, dtype.rstrip(b"\0").decode(), *rest)

    @property
    def size(self) -> int:
        return self.data_off + self.total_bytes


def _create_segment(name: str, manifest: Manifest) -> tuple[int, _Header]:
    """A new BUILDING segment holding ``manifest``; raises FileExistsError if ``name`` is."""
    blob = manifest.encode()
    data_off = _round_up(_MANIFEST_POS + len(blob), mmap.PAGESIZE)
    now = time.time()
    header = _Header(
        BUILDING, manifest.fingerprint, manifest.dtype, data_off, manifest.total_bytes,
        manifest.chunk_bytes, len(blob), os.getpid(), now, now,
    )  # fmt: skip
    free = shm_room()
    if free is not None and header.size > free:
        raise OSError(errno.ENOSPC, f"pool {name} needs {header.size} bytes; {SHM_DIR} has {free}")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    fd = os.open(SHM_DIR / name, flags, 0o600)
    try:
        os.ftruncate(fd, header.size)
        os.pwrite(fd, header.pack(), 0)
        os.pwrite(fd, blob, _MANIFEST_POS)
    except BaseException:
        os.close(fd)
        _unlink(name)
        raise
    return fd, header


def _write_tensors(fd: int, data_off: int, manifest: Manifest, tensors: dict[str, Any]) -> None:
    """Copies each tensor to its place (one copy) and drops it from ``tensors`` at once."""
    import torch

    for entry in manifest.tensors:
        t = tensors.pop(entry.name).detach().cpu().contiguous()
        view = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        done = 0
        while done < entry.nbytes:
            done += os.pwrite(fd, view[done:], data_off + entry.offset + done)


def _tensors(mapping: mmap.mmap, data_off: int, manifest: Manifest) -> dict[str, torch.Tensor]:
    """Zero-copy views, one ``frombuffer`` for the whole data region."""
    import torch

    if manifest.total_bytes == 0:
        return {
            e.name: torch.empty(e.shape, dtype=getattr(torch, e.dtype)) for e in manifest.tensors
        }
    with warnings.catch_warnings():  # read-only mapping: writes fault, see ``param_pool``
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        # through a memoryview: torch keeps a reference to the object it is given but not a
        # buffer export, so over the mmap itself ``mmap.close()`` unmapped the weights under
        # live tensors (an engine's background packing read them and died with SIGSEGV);
        # the view's export makes that close a BufferError until the last tensor goes
        flat = torch.frombuffer(
            memoryview(mapping), dtype=torch.uint8, count=manifest.total_bytes, offset=data_off
        )
    return {
        e.name: flat[e.offset : e.offset + e.nbytes].view(getattr(torch, e.dtype)).view(e.shape)
        for e in manifest.tensors
    }


def _chunk_checksums(data: memoryview, chunk_bytes: int) -> tuple[int, ...]:
    return tuple(
        xxhash.xxh3_64_intdigest(data[start : start + chunk_bytes])
        for start in range(0, len(data), chunk_bytes)
    )


def _read_manifest(fd: int, header: _Header) -> Manifest:
    manifest = Manifest.decode(os.pread(fd, header.manifest_len, _MANIFEST_POS))
    if manifest.total_bytes != header.total_bytes or os.fstat(fd).st_size < header.size:
        raise CorruptPool(f"header and manifest disagree: {header}")
    return manifest


def _open_segment(name: str) -> int | None:
    try:
        return os.open(SHM_DIR / name, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None


def _state_of(name: str) -> int | None:
    fd = _open_segment(name)
    if fd is None:
        return None
    try:
        header = _Header.read(fd)
        return header.state if header else EMPTY
    finally:
        os.close(fd)


def _is_linked(fd: int, name: str) -> bool:
    """Whether ``name`` still names the segment open as ``fd`` (not unlinked or replaced)."""
    try:
        st = os.stat(SHM_DIR / name, follow_symlinks=False)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()


def _close_mapping(mapping: mmap.mmap, name: str) -> None:
    try:
        mapping.close()
    except BufferError:  # tensors over it still live: unmapped when the last one goes
        logger.debug("pool %s: mapping still viewed at close", name)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
