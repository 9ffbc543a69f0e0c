"""L1 host pool segment: geometry, header, and opening (creating, initialising) a segment.

Decides where a pool's tables lie for one (capacity, ``BlockFormat``) and how a segment comes
to exist; the tier over it is ``host_pool``, the operator functions ``host_ops``.

Segment ``/dev/shm/<name>`` (all integers little-endian, every table 8-byte aligned)::

    offset        size           contents
    0             4096           header: magic, layout version, geometry, BlockFormat
    4096          S*W*16         key of each way                     [S*W] x 16 bytes
    seq_off       S*W*8          seq of each way (u64)               generation << 2 | state
    tick_off      S*W*8          last use of each way (u64)          a value of its set's clock
    clock_off     S*8            per-set logical clock (u64)
    data_off      S*W*slot       values: 64-byte header + payload (``base.py``), slot bytes =
    (page aligned)               value_bytes rounded up to 64; way i uses slot i

    way state (low 2 bits of seq):  0 EMPTY   1 WRITING   2 VALID
    write:    seq -> (gen+1)<<2 | WRITING, key, header, payload, seq -> (gen+1)<<2 | VALID
    evict:    the writer overwrites the way in place (same steps)
    corrupt:  seq -> (gen+1)<<2 | EMPTY

Every state change bumps the generation, so ``seq`` never repeats for a way.

The lock file ``/dev/shm/<name>.lock`` holds OFD record locks: byte ``1 + set`` is that set's
writer lock (``host_pool``); byte 0 serialises opening, which makes creation race-free and lets
the next opener finish the initialisation of a creator that died before writing the magic
(written last). Every opener must pass the same ``capacity_bytes`` and ``BlockFormat`` (checked
against the header; the creator also checks that ``/dev/shm`` has room, as touching a page past
it is SIGBUS).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import mmap
import os
import re
import struct
import time
from pathlib import Path
from typing import Any

from kvrelay.cachetier.base import DTYPE_CODES, BlockFormat
from kvrelay.cachetier.block_hash import HASH_BYTES
from kvrelay.cachetier.segments import SHM_DIR, shm_room

logger = logging.getLogger(__name__)

NUM_WAYS = 8
_POOL_MAGIC = b"KVRLHP01"
_LAYOUT_VERSION = 1
_HEADER_REGION = 4096
_SLOT_ALIGN = 64
_POOL_HEADER = struct.Struct("<8sIIQQQIIIIIQQ")
_HEADER_FIELDS = (
    "magic", "layout_version", "num_ways", "num_sets", "slot_bytes", "capacity_bytes",
    "num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "payload_bytes",
    "total_bytes",
)  # fmt: skip
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux): type, whence, start, len, pid
_INIT_LOCK = 0
_OPEN_TIMEOUT_S = 10.0
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")
_STATE_MASK, _EMPTY, _WRITING, _VALID = 3, 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class _Geometry:
    """Where everything lies in a segment for one (capacity, format); see the diagram."""

    capacity_bytes: int
    fmt: BlockFormat
    num_sets: int
    num_slots: int
    slot_bytes: int
    seq_off: int
    tick_off: int
    clock_off: int
    data_off: int
    total_bytes: int

    @classmethod
    def of(cls, capacity_bytes: int, fmt: BlockFormat) -> _Geometry:
        slot_bytes = _round_up(fmt.value_bytes, _SLOT_ALIGN)
        num_sets = capacity_bytes // slot_bytes // NUM_WAYS
        if num_sets < 1:
            raise ValueError(
                f"capacity_bytes {capacity_bytes} holds no set of {NUM_WAYS} "
                f"{slot_bytes}-byte slots (need at least {NUM_WAYS * slot_bytes})"
            )
        n = num_sets * NUM_WAYS
        seq_off = _HEADER_REGION + n * HASH_BYTES
        clock_off = seq_off + 2 * n * 8
        data_off = _round_up(clock_off + num_sets * 8, mmap.PAGESIZE)
        return cls(
            capacity_bytes, fmt, num_sets, n, slot_bytes, seq_off, seq_off + n * 8, clock_off,
            data_off, data_off + n * slot_bytes,
        )  # fmt: skip

    def header(self) -> tuple[Any, ...]:
        fmt = self.fmt
        return (
            _POOL_MAGIC, _LAYOUT_VERSION, NUM_WAYS, self.num_sets, self.slot_bytes,
            self.capacity_bytes, fmt.num_layers, fmt.block_size, fmt.num_kv_heads, fmt.head_dim,
            DTYPE_CODES[fmt.dtype], fmt.payload_bytes, self.total_bytes,
        )  # fmt: skip


def _open_segment(
    name: str, capacity_bytes: int, fmt: BlockFormat, create: bool
) -> tuple[_Geometry, mmap.mmap, int]:
    """Maps pool ``name`` under the open lock, creating and initialising it if absent and
    ``create``; returns its geometry, the mapping and a new description of its lock file.

    Raises:
        ValueError: the pool exists with another format or capacity, or does not fit.
        FileNotFoundError: no such (initialised) pool and not ``create``.
        TimeoutError: another opener held the open lock for ``_OPEN_TIMEOUT_S``.
    """
    _check_name(name)
    geo = _Geometry.of(capacity_bytes, fmt)
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    lock_fd = os.open(_lock_path(name), flags, 0o600)
    try:
        if not _lock(lock_fd, _INIT_LOCK, _OPEN_TIMEOUT_S):
            raise TimeoutError(f"pool {name}: open lock held for {_OPEN_TIMEOUT_S} s")
        try:
            mapping = _map_segment(name, geo, create)
        finally:
            _unlock(lock_fd, _INIT_LOCK)
    except BaseException:
        os.close(lock_fd)
        raise
    return geo, mapping, lock_fd


def _map_segment(name: str, geo: _Geometry, create: bool) -> mmap.mmap:
    """Under the open lock: maps the segment, initialising it if it has no magic yet."""
    path = SHM_DIR / name
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        if not create:
            raise
        fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if os.pread(fd, len(_POOL_MAGIC), 0) != _POOL_MAGIC:
            if not create:
                raise FileNotFoundError(f"pool {name} was never initialised")
            _initialise(fd, name, geo)
        stored = _POOL_HEADER.unpack(os.pread(fd, _POOL_HEADER.size, 0))
        diff = [
            f"{field} {have} (expected {want})"
            for field, have, want in zip(_HEADER_FIELDS, stored, geo.header())
            if have != want
        ]
        if diff:
            raise ValueError(f"pool {name} holds another format or capacity: {', '.join(diff)}")
        return mmap.mmap(fd, geo.total_bytes)
    finally:
        os.close(fd)


def _initialise(fd: int, name: str, geo: _Geometry) -> None:
    """Sizes a new (or abandoned) segment and writes its header, the magic last."""
    room = shm_room()
    free = None if room is None else room + os.fstat(fd).st_size  # its own pages count too
    if free is not None and geo.total_bytes > free:
        raise ValueError(f"pool {name} needs {geo.total_bytes} bytes; {SHM_DIR} has {free} free")
    os.ftruncate(fd, 0)  # zero every table: all ways EMPTY
    os.ftruncate(fd, geo.total_bytes)
    header = _POOL_HEADER.pack(*geo.header())
    os.pwrite(fd, header[len(_POOL_MAGIC) :], len(_POOL_MAGIC))
    os.pwrite(fd, _POOL_MAGIC, 0)
    logger.info("created host pool %s (%d blocks)", name, geo.num_slots)


def _lock(fd: int, offset: int, timeout_s: float) -> bool:
    """Takes the OFD write lock on byte ``offset``, waiting up to ``timeout_s``."""
    request = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, offset, 1, 0)
    deadline = time.monotonic() + timeout_s
    pause = 1e-5
    while True:
        try:
            fcntl.fcntl(fd, fcntl.F_OFD_SETLK, request)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)


def _unlock(fd: int, offset: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _lock_path(name: str) -> Path:
    return SHM_DIR / f"{name}.lock"


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"pool name {name!r}: use up to 200 letters, digits, '_', '.', '-'")
