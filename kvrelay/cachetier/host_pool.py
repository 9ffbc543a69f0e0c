"""L1: one shared-memory pool of KV blocks per host, shared by every kvrelay process there.

Linux only (``/dev/shm`` and open-file-description locks). The pool is a set-associative
cache, like a CPU cache: ``S`` sets of ``W = 8`` ways; a key lives only in set
``int.from_bytes(key[:8], "little") % S``, so a lookup reads the 8 keys of one set: O(1).

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

Writers hold the set's lock: an open-file-description record lock (``F_OFD_SETLK``) on byte
``1 + set`` of ``/dev/shm/<name>.lock`` plus a ``threading.Lock`` of the instance. The kernel
drops an OFD lock when its holder dies, and OFD locks exclude each other even between two
instances in one process (plain POSIX record locks would not, and closing any descriptor of
the file would drop them all); a forked child opens a lock description of its own before
its first write. A writer that cannot take the lock within ``lock_timeout_s`` drops the
block (``dropped_puts``). Under the lock a ``WRITING`` way can only belong to a
writer that died mid-write: it is the first way reclaimed, so it never leaks. Byte 0 of the
lock file serialises opening, which makes creation race-free and lets the next opener finish
the initialisation of a creator that died before writing the magic (written last).

Readers take no lock (a seqlock): find the way, read ``seq`` (VALID or miss), copy the value,
re-read the key and ``seq`` (changed: retry once, then miss), then ``check_value``: so a
reader never returns a half-written or recycled block even where the seqlock alone would not
be enough (weakly ordered memory). A value that fails the check is re-checked in place under
the lock: still bad, it is invalidated and counted in ``errors``; else it was a torn copy.

LRU is per set: each use (a put, a hit, a put of a present key) stamps the way with its set's
clock + 1. Writers advance the clock under the lock; readers do it without one, so a race
between readers can lose a step (ties) — an approximation that never breaks correctness.
Victims: a way holding the key's bytes but not VALID, else the first EMPTY or dead WRITING
way, else the smallest tick (the first on ties).

Change log (``record_changes``, the placement feed): a writer knows at ``put`` time which
key it wrote and, when it took an occupied way, which key it evicted; it notes both in a
per-process dict (key -> stored or evicted, the later change wins) while it holds the set
lock anyway, and ``take_changes`` hands them over. The cost is one dict entry per newly
written key, plus reading the victim's 16-byte key when a way is evicted; a put of a present
key notes nothing, and a pool opened without the flag does no more than before. Each
writer reports only its own changes; the log is capped at ``_MAX_CHANGES`` keys between two
``take_changes`` (beyond it changes are not noted): the router's index of this pool is a
hint, and a stale entry costs a miss there, never a wrong block.

Lifetime: the segment is never registered with Python's resource tracker; it outlives every
process until an operator frees it (``kvrelay cache rm``: ``remove_host_pool``, which refuses
while a live process maps it; ``unlink_pool`` unconditionally). Every opener
must pass the same ``capacity_bytes`` and ``BlockFormat`` (checked against the header; the
creator also checks that ``/dev/shm`` has room, as touching a page past it is SIGBUS); a
different model must use another name (``default_pool_name`` derives one from the block
format and the model fingerprint).
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import logging
import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvrelay.cachetier.base import (
    DTYPE_CODES,
    HEADER_BYTES,
    BlockFormat,
    CorruptBlock,
    KvTier,
    TierChanges,
    TierStats,
    check_value,
    pack_header,
)
from kvrelay.cachetier.block_hash import HASH_BYTES, BlockHash
from kvrelay.cachetier.segments import segment_mappers

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
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
_SCOPE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")
_STATE_MASK, _EMPTY, _WRITING, _VALID = 3, 0, 1, 2
_PRESENT, _FREE, _EVICT = 0, 1, 2  # what _claim found
_MAX_CHANGES = 1 << 16  # keys noted between two take_changes (the worker takes every 0.2 s)


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


def default_pool_name(fmt: BlockFormat, fingerprint: bytes, scope: str = "host") -> str:
    """``kvrelay-l1-{scope}-{16 hex digits of (fingerprint, block format)}``."""
    if not _SCOPE.fullmatch(scope):
        raise ValueError(f"scope {scope!r}: use letters, digits, '_', '.', inner '-'")
    digest = hashlib.blake2b(fingerprint, digest_size=8)
    digest.update(repr(dataclasses.astuple(fmt)).encode())
    return f"kvrelay-l1-{scope}-{digest.hexdigest()}"


def unlink_pool(name: str) -> bool:
    """Removes the pool's segment and lock file; True if either existed. Mappings stay valid."""
    _check_name(name)
    removed = False
    for path in (SHM_DIR / name, _lock_path(name)):
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed = True
    return removed


@dataclasses.dataclass(frozen=True, slots=True)
class HostPoolInfo:
    """What ``list_host_pools`` reports of one segment."""

    name: str
    total_bytes: int  # the segment's size
    fmt: BlockFormat | None  # None: never initialised, or written by another layout version
    num_slots: int  # blocks it can hold
    valid_slots: int  # blocks it holds now
    pids: tuple[int, ...]  # live processes that map it


def list_host_pools() -> list[HostPoolInfo]:
    """Every L1 pool segment in ``/dev/shm``, by name; reads headers only, changes nothing.

    A pool is recognised by its magic, whatever its name; ``pids`` come from
    ``/proc/*/maps`` (processes of other users may be invisible without privileges).
    """
    mappers = segment_mappers()
    out = []
    for path in sorted(SHM_DIR.iterdir()):
        if path.suffix == ".lock" or not path.is_file() or not _NAME.fullmatch(path.name):
            continue
        try:
            info = _describe(path, mappers.get(path.name, ()))
        except OSError:
            continue  # removed meanwhile, or not ours to read
        if info is not None:
            out.append(info)
    return out


class PoolInUse(RuntimeError):
    """``remove_host_pool`` without ``force`` while live processes map the pool."""


def remove_host_pool(name: str, force: bool = False) -> bool:
    """Unlinks an L1 pool (``unlink_pool``) unless live processes map it; True if it existed.

    Processes that map it keep their mapping; the next opener creates a fresh, empty pool.

    Raises:
        PoolInUse: (unless ``force``) processes map it; their pids are in the message.
    """
    _check_name(name)
    pids = segment_mappers().get(name, ())
    if pids and not force:
        pid_list = ", ".join(map(str, pids))
        raise PoolInUse(f"pool {name} is mapped by live processes {pid_list} (--force frees it)")
    return unlink_pool(name)


def _describe(path: Path, pids: tuple[int, ...]) -> HostPoolInfo | None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        size = os.fstat(fd).st_size
        raw = os.pread(fd, _POOL_HEADER.size, 0)
        if len(raw) < len(_POOL_MAGIC) or raw[: len(_POOL_MAGIC)] != _POOL_MAGIC:
            return None
        if len(raw) < _POOL_HEADER.size:
            return HostPoolInfo(path.name, size, None, 0, 0, pids)
        h = dict(zip(_HEADER_FIELDS, _POOL_HEADER.unpack(raw), strict=True))
        dtypes = {code: name for name, code in DTYPE_CODES.items()}
        if h["layout_version"] != _LAYOUT_VERSION or h["dtype"] not in dtypes:
            return HostPoolInfo(path.name, size, None, 0, 0, pids)
        fmt = BlockFormat(
            h["num_layers"], h["block_size"], h["num_kv_heads"], h["head_dim"], dtypes[h["dtype"]]
        )
        geo = _Geometry.of(h["capacity_bytes"], fmt)
        seq = np.frombuffer(os.pread(fd, geo.num_slots * 8, geo.seq_off), np.uint64)
        valid = int(np.count_nonzero((seq & _STATE_MASK) == _VALID))
        return HostPoolInfo(path.name, size, fmt, geo.num_slots, valid, pids)
    finally:
        os.close(fd)


class HostPool(KvTier):
    """The L1 tier: a fixed-capacity, LRU, set-associative block cache in shared memory.

    Every method may be called from any thread or process; ``put`` takes one set lock at a
    time (never longer than ``lock_timeout_s`` to wait), reads take none. ``get`` returns
    fresh arrays the caller owns. ``lookup``/``get`` count in ``lookups``; only ``get``
    counts ``query_blocks``, ``hit_blocks``, ``bytes_read`` and a latency sample.
    """

    name = "host"

    def __init__(
        self,
        pool_name: str,
        geo: _Geometry,
        mapping: mmap.mmap,
        lock_fd: int,
        timeout_s: float,
        record_changes: bool = False,
    ) -> None:
        """Use ``open``."""
        self.pool_name = pool_name
        self.fmt = geo.fmt
        self.lock_timeout_s = timeout_s
        self._geo = geo
        self._mmap = mapping
        self._lock_fd = lock_fd
        self._pid = os.getpid()
        self._thread_lock = threading.Lock()
        self._stats = TierStats()
        self._payload_bytes = geo.fmt.payload_bytes
        self._value_bytes = geo.fmt.value_bytes
        self._is_closed = False
        # key -> True (stored) / False (evicted) by this process; None: not recorded
        self._changes: dict[bytes, bool] | None = {} if record_changes else None
        n = geo.num_slots
        self._seq = np.frombuffer(mapping, np.uint64, n, geo.seq_off)
        self._tick = np.frombuffer(mapping, np.uint64, n, geo.tick_off)
        self._clock = np.frombuffer(mapping, np.uint64, geo.num_sets, geo.clock_off)
        self._data = np.frombuffer(mapping, np.uint8, n * geo.slot_bytes, geo.data_off)
        self._data = self._data.reshape(n, geo.slot_bytes)

    @classmethod
    def open(
        cls,
        name: str,
        capacity_bytes: int,
        fmt: BlockFormat,
        create: bool = True,
        lock_timeout_s: float = 0.1,
        record_changes: bool = False,
    ) -> HostPool:
        """Attaches to the pool ``name``, creating it first if absent and ``create``.

        ``record_changes``: note the keys this process stores and evicts for
        ``take_changes`` (a worker does, for the router's placement index).

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
        return cls(name, geo, mapping, lock_fd, lock_timeout_s, record_changes)

    def set_index(self, key: BlockHash | bytes) -> int:
        """The set ``key`` lives in."""
        return int.from_bytes(key[:8], "little") % self._geo.num_sets

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        self._check_open()
        num_present = 0
        for key in keys:
            i = self._locate(self.set_index(key), _key(key))
            if i < 0 or int(self._seq[i]) & _STATE_MASK != _VALID:
                break
            num_present += 1
        self._stats.add(lookups=1)
        return num_present

    def get(self, keys: Sequence[BlockHash]) -> list[np.ndarray]:
        self._check_open()
        start = time.perf_counter()
        out: list[np.ndarray] = []
        for key in keys:
            payload = self._read(_key(key))
            if payload is None:
                break
            out.append(payload)
        self._stats.add(
            lookups=1,
            query_blocks=len(keys),
            hit_blocks=len(out),
            bytes_read=len(out) * self._payload_bytes,
        )
        self._stats.observe(time.perf_counter() - start)
        return out

    def put(self, items: Sequence[tuple[BlockHash, np.ndarray]]) -> int:
        """Stores the blocks not present yet; returns how many were newly written."""
        self._check_open()
        num_new = num_evicted = num_dropped = 0
        for key, value in items:
            kb = _key(key)
            s = self.set_index(kb)
            i = self._locate(s, kb)
            if i >= 0 and int(self._seq[i]) & _STATE_MASK == _VALID:
                self._touch(i, s)
                continue
            payload = self._as_payload(value)
            header = pack_header(self.fmt, key, payload)  # checksum outside the lock
            if not self._acquire(s):
                num_dropped += 1
                continue
            try:
                i, found = self._claim(s, kb)
                if found == _PRESENT:
                    self._touch(i, s)
                    continue
                if self._changes is not None:
                    self._note(self._key_at(i) if found == _EVICT else None, kb)
                self._begin_write(i, kb)
                self._fill(i, header, payload)
                self._end_write(i, s)
            finally:
                self._release(s)
            num_new += 1
            num_evicted += found == _EVICT
        self._stats.add(
            put_blocks=num_new,
            bytes_written=num_new * self._payload_bytes,
            evictions=num_evicted,
            dropped_puts=num_dropped,
        )
        return num_new

    def take_changes(self) -> TierChanges | None:
        """The keys this process stored and evicted since the last call (see the module
        docstring); None unless opened with ``record_changes``."""
        if self._changes is None:
            return None
        with self._thread_lock:  # put notes changes under it
            changes, self._changes = self._changes, {}
        stored = [key for key, is_stored in changes.items() if is_stored]
        return TierChanges(stored, [key for key, is_stored in changes.items() if not is_stored])

    def stats(self) -> dict[str, Any]:
        self._check_open()
        out = self._stats.snapshot()
        used = int(np.count_nonzero(self._seq & np.uint64(_STATE_MASK) == _VALID))
        out.update(
            name=self.name,
            pool_name=self.pool_name,
            capacity_bytes=self._geo.capacity_bytes,
            capacity_blocks=self._geo.num_slots,
            used_blocks=used,
            used_bytes=used * self._geo.slot_bytes,
        )
        return out

    def check_integrity(self, allow_dead_writes: bool = False) -> int:
        """Checks every set under its lock; returns the number of valid blocks.

        Raises AssertionError if a set's lock cannot be had, a valid way's key or stored
        header is in the wrong place, a key is valid twice in a set, or (unless
        ``allow_dead_writes``) a way is left WRITING by a writer that died.
        """
        self._check_open()
        num_valid = 0
        for s in range(self._geo.num_sets):
            if not self._acquire(s):
                raise AssertionError(f"set {s}: lock held for over {self.lock_timeout_s} s")
            try:
                num_valid += self._check_set(s, allow_dead_writes)
            finally:
                self._release(s)
        return num_valid

    def close(self) -> None:
        """Detaches this instance (the pool and its blocks stay); idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        empty = np.zeros(0, np.uint64)
        self._seq = self._tick = self._clock = empty
        self._data = np.zeros((0, 0), np.uint8)
        try:
            self._mmap.close()
        except BufferError:  # a view still exists; unmapped when it is freed
            logger.debug("pool %s: mapping still viewed at close", self.pool_name)
        os.close(self._lock_fd)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._is_closed else "open"
        return f"HostPool({self.pool_name!r}, {self._geo.num_slots} blocks, {state})"

    # -- reads ---------------------------------------------------------------------------------

    def _read(self, key: bytes) -> np.ndarray | None:
        """A copy of ``key``'s payload, or None (miss, concurrent rewrite, corrupt value)."""
        s = self.set_index(key)
        for _ in range(2):
            i = self._locate(s, key)
            if i < 0:
                return None
            seq = int(self._seq[i])
            if seq & _STATE_MASK != _VALID:
                return None
            value = self._data[i, : self._value_bytes].copy()
            if self._key_at(i) != key or int(self._seq[i]) != seq:
                continue  # rewritten while copied
            try:
                check_value(self.fmt, BlockHash(key), value)
            except CorruptBlock as exc:
                self._on_bad_copy(i, s, seq, key, exc)
                return None
            self._touch(i, s)
            return value[HEADER_BYTES:]
        return None

    def _on_bad_copy(self, i: int, s: int, seq: int, key: bytes, exc: CorruptBlock) -> None:
        """Re-checks the value in place under the set lock: still bad, it is invalidated and
        counted as an error; rewritten or fine, the copy was torn (a plain miss)."""
        if not self._acquire(s):
            self._stats.add(errors=1)  # cannot tell: count it
            return
        try:
            if int(self._seq[i]) != seq or self._key_at(i) != key:
                return
            try:
                check_value(self.fmt, BlockHash(key), self._data[i, : self._value_bytes])
            except CorruptBlock:
                self._seq[i] = ((seq >> 2) + 1) << 2 | _EMPTY
                if self._changes is not None:
                    self._note(key, None)
                self._stats.add(errors=1)
                logger.warning("pool %s: corrupt block %s: %s", self.pool_name, key.hex(), exc)
        finally:
            self._release(s)

    # -- the set index -------------------------------------------------------------------------

    def _locate(self, s: int, key: bytes) -> int:
        """The way of set ``s`` holding ``key`` VALID, else holding its bytes in another
        state (a dead or invalidated write), else -1."""
        lo = self._key_off(s * NUM_WAYS)
        hi = lo + NUM_WAYS * HASH_BYTES
        other = -1
        pos = self._mmap.find(key, lo, hi)
        while pos >= 0:
            if (pos - lo) % HASH_BYTES == 0:
                i = s * NUM_WAYS + (pos - lo) // HASH_BYTES
                if int(self._seq[i]) & _STATE_MASK == _VALID:
                    return i
                other = i if other < 0 else other
            pos = self._mmap.find(key, pos + 1, hi)
        return other

    def _claim(self, s: int, key: bytes) -> tuple[int, int]:
        """Under the set lock: the way to (re)write ``key`` into, and what it holds now."""
        i = self._locate(s, key)
        if i >= 0:
            return i, _PRESENT if int(self._seq[i]) & _STATE_MASK == _VALID else _FREE
        base = s * NUM_WAYS
        for way, seq in enumerate(self._seq[base : base + NUM_WAYS].tolist()):
            if seq & _STATE_MASK != _VALID:
                return base + way, _FREE
        ticks = self._tick[base : base + NUM_WAYS].tolist()
        return base + ticks.index(min(ticks)), _EVICT

    def _check_set(self, s: int, allow_dead_writes: bool) -> int:
        keys = []
        for i in range(s * NUM_WAYS, (s + 1) * NUM_WAYS):
            state = int(self._seq[i]) & _STATE_MASK
            assert state != 3, f"way {i}: bad state"
            assert allow_dead_writes or state != _WRITING, f"way {i}: left WRITING"
            if state == _VALID:
                key = self._key_at(i)
                assert self.set_index(key) == s, f"way {i}: key {key.hex()} not of set {s}"
                stored = bytes(self._data[i, 40:56])
                assert stored == key, f"way {i}: header names {stored.hex()}"
                keys.append(key)
        assert len(set(keys)) == len(keys), f"set {s}: a key is valid twice"
        return len(keys)

    # -- writes (caller holds the set lock) ----------------------------------------------------

    def _note(self, evicted: bytes | None, stored: bytes | None) -> None:
        changes = self._changes
        assert changes is not None
        if len(changes) >= _MAX_CHANGES:
            return
        if evicted is not None:
            changes[evicted] = False
        if stored is not None:
            changes[stored] = True

    def _begin_write(self, i: int, key: bytes) -> None:
        self._seq[i] = ((int(self._seq[i]) >> 2) + 1) << 2 | _WRITING
        off = self._key_off(i)
        self._mmap[off : off + HASH_BYTES] = key

    def _fill(self, i: int, header: bytes, payload: np.ndarray) -> None:
        off = self._geo.data_off + i * self._geo.slot_bytes
        self._mmap[off : off + HEADER_BYTES] = header
        self._data[i, HEADER_BYTES : self._value_bytes] = payload

    def _end_write(self, i: int, s: int) -> None:
        self._seq[i] = int(self._seq[i]) + 1  # WRITING -> VALID, same generation
        self._touch(i, s)

    def _touch(self, i: int, s: int) -> None:
        tick = int(self._clock[s]) + 1
        self._clock[s] = tick
        self._tick[i] = tick

    def _key_off(self, i: int) -> int:
        return _HEADER_REGION + i * HASH_BYTES

    def _key_at(self, i: int) -> bytes:
        off = self._key_off(i)
        return self._mmap[off : off + HASH_BYTES]

    def _as_payload(self, value: np.ndarray) -> np.ndarray:
        payload = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        if payload.size != self._payload_bytes:
            raise ValueError(f"payload is {payload.size} bytes, expected {self._payload_bytes}")
        return payload

    # -- locks ---------------------------------------------------------------------------------

    def _acquire(self, s: int) -> bool:
        if os.getpid() != self._pid:
            self._after_fork()
        if not self._thread_lock.acquire(timeout=self.lock_timeout_s):
            return False
        if _lock(self._lock_fd, 1 + s, self.lock_timeout_s):
            return True
        self._thread_lock.release()
        return False

    def _release(self, s: int) -> None:
        _unlock(self._lock_fd, 1 + s)
        self._thread_lock.release()

    def _after_fork(self) -> None:
        """A forked child shares its parent's lock description: it needs its own."""
        os.close(self._lock_fd)
        self._lock_fd = os.open(_lock_path(self.pool_name), os.O_RDWR | os.O_CLOEXEC)
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()

    def _check_open(self) -> None:
        if self._is_closed:
            raise ValueError(f"pool {self.pool_name} is closed")


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
    vfs = os.statvfs(SHM_DIR)
    free = vfs.f_bavail * vfs.f_frsize + os.fstat(fd).st_size
    if geo.total_bytes > free:
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


def _key(key: BlockHash | bytes) -> bytes:
    if len(key) != HASH_BYTES:
        raise ValueError(f"a key is {HASH_BYTES} bytes, got {len(key)}")
    return bytes(key)


def _lock_path(name: str) -> Path:
    return SHM_DIR / f"{name}.lock"


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"pool name {name!r}: use up to 200 letters, digits, '_', '.', '-'")
