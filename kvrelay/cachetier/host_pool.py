"""L1: one shared-memory pool of KV blocks per host, shared by every kvrelay process there.

Linux only (``/dev/shm`` and open-file-description locks). The pool is a set-associative
cache, like a CPU cache: ``S`` sets of ``W = 8`` ways; a key lives only in set
``int.from_bytes(key[:8], "little") % S``, so a lookup reads the 8 keys of one set: O(1).

This module decides the tier: ``HostPool``'s reads, writes and LRU. The segment's layout and
opening are ``host_segment`` (the diagram and the way states are there); the change log that
feeds placement (``record_changes``) is ``host_changes``; the operator functions
(``list_host_pools``, ``remove_host_pool``, ``unlink_pool``, ``default_pool_name``) are
``host_ops``.

Writers hold the set's lock: an open-file-description record lock (``F_OFD_SETLK``) on byte
``1 + set`` of ``/dev/shm/<name>.lock`` plus a ``threading.Lock`` of the instance. The kernel
drops an OFD lock when its holder dies, and OFD locks exclude each other even between two
instances in one process (plain POSIX record locks would not, and closing any descriptor of
the file would drop them all); a forked child opens a lock description of its own before
its first write. A writer that cannot take the lock within ``lock_timeout_s`` drops the
block (``dropped_puts``). Under the lock a ``WRITING`` way can only belong to a writer that
died mid-write: it is the first way reclaimed, so it never leaks.

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
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvrelay.cachetier.base import (
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
from kvrelay.cachetier.host_changes import ChangeLog
from kvrelay.cachetier.host_segment import (
    _EMPTY,
    _HEADER_REGION,
    _STATE_MASK,
    _VALID,
    _WRITING,
    NUM_WAYS,
    _Geometry,
    _lock,
    _lock_path,
    _open_segment,
    _unlock,
)

logger = logging.getLogger(__name__)

_PRESENT, _FREE, _EVICT = 0, 1, 2  # what _claim found


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
        self._changes = ChangeLog() if record_changes else None  # None: not recorded
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
        geo, mapping, lock_fd = _open_segment(name, capacity_bytes, fmt, create)
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
                    self._changes.note(self._key_at(i) if found == _EVICT else None, kb)
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
        """The keys this process stored and evicted since the last call (``host_changes``);
        None unless opened with ``record_changes``."""
        if self._changes is None:
            return None
        with self._thread_lock:  # put notes changes under it
            changes, self._changes = self._changes, ChangeLog()
        return changes.as_tier_changes()

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
            self._stats.error("lock_timeout")  # cannot tell: count it
            return
        try:
            if int(self._seq[i]) != seq or self._key_at(i) != key:
                return
            try:
                check_value(self.fmt, BlockHash(key), self._data[i, : self._value_bytes])
            except CorruptBlock:
                self._seq[i] = ((seq >> 2) + 1) << 2 | _EMPTY
                if self._changes is not None:
                    self._changes.note(key, None)
                self._stats.error(exc.reason)
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


def _key(key: BlockHash | bytes) -> bytes:
    if len(key) != HASH_BYTES:
        raise ValueError(f"a key is {HASH_BYTES} bytes, got {len(key)}")
    return bytes(key)
