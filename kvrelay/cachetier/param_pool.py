"""Parameter pool: a checkpoint's runtime weights, materialised once per host in shared memory.

The first instance on a host that needs a checkpoint in a dtype builds its pool: ``build()``
(``load_weights`` by default) is written into one ``/dev/shm`` segment. Every other instance
attaches: one ``mmap`` and read-only tensor views over it, no copy, so attaching does not
grow with the model and N instances hold one copy of the weights (shared pages).

Segment ``/dev/shm/kvrelay-params-[<scope>-]<fingerprint hex16>-<dtype>`` (little-endian)::

    offset       size            contents
    0            104 (of 128)    fixed header: magic "KVRLPRM1", version, state, fingerprint
                                 (16 B), dtype, data_off, total_bytes, chunk_bytes,
                                 manifest_len, builder pid, created, last_used (unix s)
    128          256 x 16        user slots: pid u64, attached_at f64 (pid 0: free)
    4224         manifest_len    manifest (msgpack, ``Manifest``): fingerprint, dtype,
                                 total_bytes, chunk_bytes, tensors [name, dtype, shape,
                                 offset, nbytes], checksums (xxh3-64 of each chunk, u64 LE)
    data_off     total_bytes     data: every tensor at a 64-byte aligned offset;
    (page aligned)               chunk i = data[i * chunk_bytes : (i + 1) * chunk_bytes]

    state:  EMPTY 0 (header not written yet) -> BUILDING 1 -> READY 2
            not READY while nobody holds the build lock = stale (its builder died): the next
            attach or gc unlinks it

The manifest describes the data completely, so it is what a peer transfer sends first
(``pool.header``); the receiver lays out the same segment with ``open_for_fill``, writes
chunks into ``pool.buffer``, checks them (``verify_chunk``) and calls ``mark_ready``.

Locks are OFD byte locks on one host-wide file, ``/dev/shm/kvrelay-params.lock`` (never
removed, so no unlink races), at offsets derived from the pool name,
``base = (48 bits of blake2b(name)) << 9``::

    base + 0        build lock: held for a whole build or fill; creators wait on it
    base + 1        table lock: held briefly to change the state or the user slots, or unlink
    base + 2 + i    user slot i: held by the attachment in slot i for as long as it lasts

The kernel drops an OFD lock when its holder dies, so liveness needs no pid checks and is
right across pid namespaces and pid reuse: a slot whose lock is free belongs to a dead user
and is cleared whenever the table is changed; a segment that is not READY while its build lock
is free is stale. Lock order: build before table; never two pools' locks at once.

Lifetime: no process owns a segment (none registers it with a resource tracker). ``gc`` unlinks
a pool with no live user that has been idle for ``grace_s`` (``last_used`` is stamped at every
attach and detach, and when a dead user is found) and any stale one; ``remove`` unlinks one on
request; every ``attach_or_create`` runs ``gc`` first. Unlinking only removes the name: mapped
memory stays valid until its last mapper unmaps it.

Tensors are read-only by construction: attached pools map the segment ``PROT_READ``, so a
stray in-place op on a weight faults (SIGSEGV) instead of corrupting every instance's copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import logging
import math
import mmap
import os
import re
import struct
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgpack
import xxhash

from kvrelay.cachetier.segments import segment_mappers

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
PREFIX = "kvrelay-params-"
LOCK_FILE = "kvrelay-params.lock"
DEFAULT_GRACE_S = 300.0
CHUNK_BYTES = 4 << 20
MAX_USERS = 256
TENSOR_ALIGN = 64

EMPTY, BUILDING, READY = 0, 1, 2
PoolState = Literal["building", "ready", "stale", "outdated"]  # outdated: another version's
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
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux): type, whence, start, len, pid
_LOCK_TIMEOUT_S = 10.0
_SCOPE = re.compile(r"[A-Za-z0-9_.]{1,64}")
_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_.-]{1,180}")


class PoolBusy(RuntimeError):
    """The pool has live users or a live builder (``force`` overrides), or no free slot."""


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

    fingerprint: bytes  # 16 bytes, ``loader.model_fingerprint``
    dtype: str  # the pool's dtype (part of its name)
    total_bytes: int  # data region size
    chunk_bytes: int  # checksum (and transfer) unit
    tensors: tuple[TensorEntry, ...]
    checksums: tuple[int, ...]  # xxh3-64 of each chunk; zeros until the data is written

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    @classmethod
    def plan(
        cls, fingerprint: bytes, dtype: str, tensors: Mapping[str, torch.Tensor], chunk_bytes: int
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
        return cls(fingerprint, dtype, total, chunk_bytes, tuple(entries), (0,) * num_chunks)

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
class PoolInfo:
    name: str
    fingerprint: str  # hex of the 16-byte model fingerprint ("" before the header is written)
    dtype: str
    num_bytes: int  # segment size
    state: PoolState
    user_pids: tuple[int, ...]  # live users (pids as their own namespace saw them)
    last_used: float  # unix time of the last attach, detach or dead user found

    def idle_s(self, now: float | None = None) -> float | None:
        """Seconds since last use, or None while the pool has users."""
        return None if self.user_pids else (now or time.time()) - self.last_used


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


class ParamPool:
    """One process's attachment to a pool: read-only ``weights`` over the shared segment.

    Made by ``attach_or_create`` (or ``open_for_fill`` for a peer transfer). ``close()``
    detaches; the segment itself is freed by ``gc`` or ``remove``, never by a user. Not
    thread-safe; a forked child may use the tensors but its ``close()`` only drops them.
    """

    def __init__(
        self,
        name: str,
        fd: int,
        header: _Header,
        manifest: Manifest,
        mapping: mmap.mmap,
        *,
        user: tuple[_LockFile, int] | None = None,
        fill_locks: _LockFile | None = None,
    ) -> None:
        """Use ``attach_or_create`` or ``open_for_fill``."""
        self.name = name
        self.manifest = manifest
        self._fd = fd
        self._header = header
        self._mapping = mapping
        self._user = user
        self._fill_locks = fill_locks
        self._verified: set[int] = set()
        self._pid = os.getpid()
        self._is_closed = False
        self._weights = None if fill_locks else _tensors(mapping, header.data_off, manifest)
        self._pinned_at: int | None = None  # address registered with CUDA (``pin``)

    @classmethod
    def attach_or_create(
        cls,
        model_dir: str | Path,
        dtype: str,
        build: Callable[[], Mapping[str, torch.Tensor]] | None = None,
        *,
        scope: str = "",
        wait_s: float = 600.0,
        grace_s: float = DEFAULT_GRACE_S,
    ) -> ParamPool:
        """Attaches to the host's pool of ``model_dir`` in ``dtype``, building it if needed.

        Exactly one of several concurrent callers builds; the others wait for it and attach.
        A builder that dies is replaced by the next caller.

        Args:
            build: returns the runtime weights; default ``load_weights(model_dir, ...)``.
            scope: namespaces the pool name (tests); "" for the host-wide pool.
            wait_s: how long to wait for another process's build.
            grace_s: for the ``gc`` sweep run first.

        Raises:
            TimeoutError: another process was still building after ``wait_s``.
            CorruptPool: the existing pool is unreadable or holds another model.
        """
        from kvrelay.engine.loader import model_fingerprint

        fingerprint = model_fingerprint(model_dir)
        name = pool_name(fingerprint, dtype, scope)
        gc(grace_s, scope=scope)
        build = build or functools.partial(_load_from_disk, model_dir, dtype)
        deadline = time.monotonic() + wait_s
        pause = 1e-3
        with _LockFile() as locks:
            while True:
                pool = cls._attach(name, fingerprint, dtype, locks)
                if pool is not None:
                    return pool
                if locks.try_lock(_build_pos(name)):
                    try:
                        pool = cls._attach(name, fingerprint, dtype, locks)
                        return pool or cls._build(name, fingerprint, dtype, build, locks)
                    finally:
                        locks.unlock(_build_pos(name))
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"pool {name}: another process still builds it after {wait_s} s"
                    )
                time.sleep(pause)
                pause = min(2 * pause, 0.02)

    @classmethod
    def open_for_fill(cls, name: str, header: bytes, total_bytes: int) -> ParamPool:
        """A new BUILDING pool laid out by ``header`` (a source pool's ``header``) to fill.

        Write the data into ``buffer`` (writable here), then ``mark_ready()``; ``close()``
        before that abandons the pool (unlinked). A process killed meanwhile leaves a stale
        segment that the next attach or ``gc`` removes.

        Raises:
            CorruptPool: ``header`` is not a manifest of ``total_bytes`` for pool ``name``.
            FileExistsError: the pool is ready, or another live process builds it.
        """
        manifest = Manifest.decode(header)
        if manifest.total_bytes != total_bytes:
            raise CorruptPool(f"header describes {manifest.total_bytes} bytes, not {total_bytes}")
        suffix = f"-{manifest.fingerprint[:8].hex()}-{manifest.dtype}"
        if not name.endswith(suffix):
            raise CorruptPool(f"pool name {name!r} does not end with {suffix!r}")
        _check_name(name)
        locks = _LockFile()
        try:
            if not locks.try_lock(_build_pos(name)):
                raise FileExistsError(f"pool {name} is being built by another process")
            if _state_of(name) == READY:
                raise FileExistsError(f"pool {name} is ready: attach to it")
            _unlink(name)  # stale: its builder is dead, as we hold the build lock
            fd, hdr = _create_segment(name, manifest)
        except BaseException:
            locks.close()
            raise
        mapping = mmap.mmap(fd, hdr.size, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return cls(name, fd, hdr, manifest, mapping, fill_locks=locks)

    # -- the pool's data -----------------------------------------------------------------------

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        """Runtime name -> tensor over the segment (read-only; do not write)."""
        if self._weights is None:
            raise ValueError(f"pool {self.name} is {'closed' if self._is_closed else 'not ready'}")
        return self._weights

    @property
    def is_pinned(self) -> bool:
        return self._pinned_at is not None

    def pin(self) -> None:
        """Registers the data region with CUDA as pinned (page-locked) host memory, so copies
        of ``weights`` to a GPU are DMA straight from the segment (``param_device``).
        Idempotent; ``close()`` unregisters. Raises ``param_device.PinError`` if CUDA
        refuses (the pool stays usable, unpinned)."""
        weights = self.weights
        if self._pinned_at is not None or self.total_bytes == 0:
            return
        from kvrelay.cachetier.param_device import register_host_memory

        address = next(iter(weights.values())).untyped_storage().data_ptr()  # the data region
        register_host_memory(address, self.total_bytes)
        self._pinned_at = address

    @property
    def buffer(self) -> memoryview:
        """The data region (``total_bytes``); writable only while filling."""
        off = self._header.data_off
        return memoryview(self._mapping)[off : off + self.total_bytes]

    @property
    def header(self) -> bytes:
        """The manifest bytes a peer needs for ``open_for_fill``."""
        return self.manifest.encode()

    @property
    def total_bytes(self) -> int:
        return self.manifest.total_bytes

    @property
    def chunk_bytes(self) -> int:
        return self.manifest.chunk_bytes

    @property
    def chunk_checksums(self) -> tuple[int, ...]:
        return self.manifest.checksums

    @property
    def num_chunks(self) -> int:
        return self.manifest.num_chunks

    def verify_chunk(self, index: int) -> bool:
        """Whether chunk ``index`` of the data matches its checksum."""
        start = self._header.data_off + index * self.chunk_bytes
        stop = min(start + self.chunk_bytes, self._header.size)
        with memoryview(self._mapping)[start:stop] as data:
            is_ok = xxhash.xxh3_64_intdigest(data) == self.manifest.checksums[index]
        if is_ok:
            self._verified.add(index)
        return is_ok

    def mark_ready(self) -> None:
        """Ends a fill: checks every chunk not verified yet, marks the pool READY, attaches.

        Raises:
            CorruptPool: chunks fail their checksums (the pool stays BUILDING; ``close()``).
        """
        locks = self._fill_locks
        if locks is None:
            raise ValueError(f"pool {self.name} is not being filled")
        bad = [
            i
            for i in range(self.num_chunks)
            if i not in self._verified and not self.verify_chunk(i)
        ]
        if bad:
            raise CorruptPool(f"pool {self.name}: chunks {bad[:8]} (of {len(bad)}) fail checksums")
        with locks.held(_table_pos(self.name)):
            os.pwrite(self._fd, _STATE.pack(READY), _STATE_POS)
            self._user = _register(self._fd, self.name, locks)
        locks.close()
        self._fill_locks = None
        writable = self._mapping
        self._mapping = mmap.mmap(self._fd, self._header.size, prot=mmap.PROT_READ)
        _close_mapping(writable, self.name)
        self._weights = _tensors(self._mapping, self._header.data_off, self.manifest)

    # -- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Detaches (or abandons an unfinished fill); idempotent. Tensors still held elsewhere
        stay valid: the mapping goes when the last of them does."""
        if self._is_closed:
            return
        self._is_closed = True
        self._weights = None
        is_owner = os.getpid() == self._pid
        if self._fill_locks is not None:
            if is_owner:
                _unlink(self.name)
            self._fill_locks.close()
        if self._user is not None:
            user_locks, slot = self._user
            if is_owner:
                _deregister(self._fd, self.name, slot)
            user_locks.close()
        if self._pinned_at is not None:
            if is_owner:  # a forked child did not register it
                from kvrelay.cachetier.param_device import unregister_host_memory

                unregister_host_memory(self._pinned_at)
            self._pinned_at = None
        os.close(self._fd)
        _close_mapping(self._mapping, self.name)

    def __enter__(self) -> ParamPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._is_closed else "filling" if self._fill_locks else "attached"
        return f"ParamPool({self.name!r}, {self.total_bytes} bytes, {state})"

    # -- attach and build (the caller holds ``locks``' description) ----------------------------

    @classmethod
    def _attach(
        cls, name: str, fingerprint: bytes, dtype: str, locks: _LockFile
    ) -> ParamPool | None:
        """Attaches if the pool is READY; None if absent, unfinished or just unlinked."""
        fd = _open_segment(name)
        if fd is None:
            return None
        user = None
        try:
            with locks.held(_table_pos(name)):
                try:
                    header = _Header.read(fd)
                except OutdatedPool as exc:
                    logger.warning("pool %s: %s; replacing it", name, exc)
                    header = None
                if header is None or header.state != READY or not _is_linked(fd, name):
                    os.close(fd)
                    return None
                manifest = _read_manifest(fd, header)
                if manifest.fingerprint != fingerprint or manifest.dtype != dtype:
                    raise CorruptPool(
                        f"pool {name} holds {manifest.fingerprint.hex()} {manifest.dtype}"
                    )
                user = _register(fd, name, locks)
            mapping = mmap.mmap(fd, header.size, prot=mmap.PROT_READ)
            return cls(name, fd, header, manifest, mapping, user=user)
        except BaseException:
            if user is not None:
                user[0].close()
            with contextlib.suppress(OSError):
                os.close(fd)
            raise

    @classmethod
    def _build(
        cls,
        name: str,
        fingerprint: bytes,
        dtype: str,
        build: Callable[[], Mapping[str, torch.Tensor]],
        locks: _LockFile,
    ) -> ParamPool:
        """Under the build lock: (re)creates the segment from ``build()`` and attaches."""
        started = time.perf_counter()
        _unlink(name)  # stale: its builder is dead, as we hold the build lock
        tensors = dict(build())
        manifest = Manifest.plan(fingerprint, dtype, tensors, CHUNK_BYTES)
        fd, header = _create_segment(name, manifest)
        user = None
        try:
            _write_tensors(fd, header.data_off, manifest, tensors)
            mapping = mmap.mmap(fd, header.size, prot=mmap.PROT_READ)
            with memoryview(mapping) as view:
                sums = _chunk_checksums(view[header.data_off :], manifest.chunk_bytes)
            manifest = dataclasses.replace(manifest, checksums=sums)
            os.pwrite(fd, manifest.encode(), _MANIFEST_POS)
            with locks.held(_table_pos(name)):
                os.pwrite(fd, _STATE.pack(READY), _STATE_POS)
                user = _register(fd, name, locks)
            pool = cls(name, fd, header, manifest, mapping, user=user)
        except BaseException:
            if user is not None:
                user[0].close()
            os.close(fd)
            _unlink(name)
            raise
        logger.info(
            "built parameter pool %s: %d tensors, %.1f MiB in %.2f s",
            name, len(manifest.tensors), manifest.total_bytes / 2**20,
            time.perf_counter() - started,
        )  # fmt: skip
        return pool


# -- host-wide operations ----------------------------------------------------------------------


def pool_name(fingerprint: bytes, dtype: str, scope: str = "") -> str:
    """``kvrelay-params-[<scope>-]<16 hex digits of fingerprint>-<dtype>``."""
    if dtype not in ITEM_SIZES:
        raise ValueError(f"dtype {dtype!r}: use one of {sorted(ITEM_SIZES)}")
    if scope and not _SCOPE.fullmatch(scope):
        raise ValueError(f"scope {scope!r}: use up to 64 letters, digits, '_', '.'")
    return f"{PREFIX}{scope + '-' if scope else ''}{fingerprint[:8].hex()}-{dtype}"


def list_pools(scope: str = "") -> list[PoolInfo]:
    """The pools of ``scope`` ("" for every pool on the host), by name; changes nothing."""
    out = []
    with _LockFile() as locks:
        for name in _pool_names(scope):
            fd = _open_segment(name)
            if fd is None:
                continue
            try:
                with locks.held(_table_pos(name)):
                    header = _Header.read(fd)
                    users = _live_users(fd, name, locks, prune=False)
                size = os.fstat(fd).st_size
            except OutdatedPool:
                pids = segment_mappers().get(name, ())
                out.append(PoolInfo(name, "", "", os.fstat(fd).st_size, "outdated", pids, 0.0))
                continue
            except CorruptPool as exc:
                logger.warning("skipping %s: %s", name, exc)
                continue
            finally:
                os.close(fd)
            state: PoolState = "ready"
            if header is None or header.state != READY:
                state = "building" if locks.is_held(_build_pos(name)) else "stale"
            fp, dtype, last = (
                (header.fingerprint.hex(), header.dtype, header.last_used)
                if header
                else ("", "", 0.0)
            )
            out.append(PoolInfo(name, fp, dtype, size, state, tuple(users), last))
    return out


def gc(grace_s: float = DEFAULT_GRACE_S, scope: str = "") -> list[str]:
    """Unlinks the stale pools of ``scope`` and the ready ones with no live user idle for
    ``grace_s``; returns their names. Pools being built are left alone."""
    removed = []
    now = time.time()
    with _LockFile() as locks:
        for name in _pool_names(scope):
            if not locks.try_lock(_build_pos(name)):
                continue  # a live builder
            try:
                with locks.held(_table_pos(name)):
                    if _is_collectable(name, grace_s, now, locks):
                        _unlink(name)
                        removed.append(name)
            finally:
                locks.unlock(_build_pos(name))
    if removed:
        logger.info("freed %d parameter pool(s): %s", len(removed), ", ".join(removed))
    return removed


def remove(name: str, force: bool = False) -> bool:
    """Unlinks pool ``name``; False if there is none. Attached users keep their mapping.

    Raises:
        PoolBusy: (unless ``force``) the pool has live users or a live builder.
        CorruptPool: (unless ``force``) the segment has another format.
    """
    _check_name(name)
    with _LockFile() as locks:
        is_build_locked = not locks.try_lock(_build_pos(name))  # a builder, or a gc sweep
        try:
            with locks.held(_table_pos(name)):
                fd = _open_segment(name)
                if fd is None:
                    return False
                try:
                    header = _Header.read(fd)  # another format's: CorruptPool unless forced
                    users = _live_users(fd, name, locks, prune=True)
                except OutdatedPool:  # its user table is not ours to read: ask the kernel
                    header, users = None, list(segment_mappers().get(name, ()))
                except CorruptPool:
                    if not force:
                        raise
                    header, users = None, []
                finally:
                    os.close(fd)
                is_building = is_build_locked and (header is None or header.state != READY)
                if not force and (users or is_building):
                    what = f"live users (pids {users})" if users else "a live builder"
                    raise PoolBusy(f"pool {name} has {what}; force to remove anyway")
                _unlink(name)
        finally:
            if not is_build_locked:
                locks.unlock(_build_pos(name))
    logger.info("removed parameter pool %s", name)
    return True


# -- users ---------------------------------------------------------------------------------------


def _register(fd: int, name: str, locks: _LockFile) -> tuple[_LockFile, int]:
    """Under the table lock: takes a free user slot (its lock, on a new description)."""
    _live_users(fd, name, locks, prune=True)
    user_locks = _LockFile()
    for slot in range(MAX_USERS):
        if user_locks.try_lock(_slot_pos(name, slot)):
            now = time.time()
            os.pwrite(fd, _SLOT.pack(os.getpid(), now), _SLOTS_POS + slot * _SLOT.size)
            os.pwrite(fd, _LAST_USED.pack(now), _LAST_USED_POS)
            return user_locks, slot
    user_locks.close()
    raise PoolBusy(f"pool {name}: all {MAX_USERS} user slots are taken")


def _deregister(fd: int, name: str, slot: int) -> None:
    """Clears our slot and stamps ``last_used``; the caller then drops the slot's lock."""
    with _LockFile() as locks, locks.held(_table_pos(name)):
        if not _is_linked(fd, name):
            return  # removed meanwhile
        os.pwrite(fd, bytes(_SLOT.size), _SLOTS_POS + slot * _SLOT.size)
        os.pwrite(fd, _LAST_USED.pack(time.time()), _LAST_USED_POS)
        _live_users(fd, name, locks, prune=True)


def _live_users(fd: int, name: str, locks: _LockFile, prune: bool) -> list[int]:
    """Under the table lock: pids of the slots whose lock is held; ``prune`` clears the
    others and, if it cleared any, stamps ``last_used`` (the grace starts when found dead)."""
    raw = os.pread(fd, MAX_USERS * _SLOT.size, _SLOTS_POS)
    live, num_dead = [], 0
    for slot, (pid, _) in enumerate(_SLOT.iter_unpack(raw)):
        if pid == 0:
            continue
        if locks.is_held(_slot_pos(name, slot)):
            live.append(pid)
        elif prune:
            os.pwrite(fd, bytes(_SLOT.size), _SLOTS_POS + slot * _SLOT.size)
            num_dead += 1
    if num_dead:
        os.pwrite(fd, _LAST_USED.pack(time.time()), _LAST_USED_POS)
        logger.info("pool %s: cleared %d dead user(s)", name, num_dead)
    return live


def _is_collectable(name: str, grace_s: float, now: float, locks: _LockFile) -> bool:
    """Under the build and table locks: stale, or ready, unused and idle for ``grace_s``."""
    fd = _open_segment(name)
    if fd is None:
        return False
    try:
        header = _Header.read(fd)
        if header is None or header.state != READY:
            return True
        users = _live_users(fd, name, locks, prune=True)
        last_used = _LAST_USED.unpack(os.pread(fd, _LAST_USED.size, _LAST_USED_POS))[0]
    except OutdatedPool:
        return not segment_mappers().get(name)  # no process of any version maps it
    except CorruptPool:
        return False  # another format's segment: not ours to judge
    finally:
        os.close(fd)
    return not users and now - last_used >= grace_s


# -- segments ------------------------------------------------------------------------------------


def _create_segment(name: str, manifest: Manifest) -> tuple[int, _Header]:
    """A new BUILDING segment holding ``manifest``; raises FileExistsError if ``name`` is."""
    blob = manifest.encode()
    data_off = _round_up(_MANIFEST_POS + len(blob), mmap.PAGESIZE)
    now = time.time()
    header = _Header(
        BUILDING, manifest.fingerprint, manifest.dtype, data_off, manifest.total_bytes,
        manifest.chunk_bytes, len(blob), os.getpid(), now, now,
    )  # fmt: skip
    vfs = os.statvfs(SHM_DIR)
    if header.size > vfs.f_bavail * vfs.f_frsize:
        free = vfs.f_bavail * vfs.f_frsize
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
    with warnings.catch_warnings():  # read-only mapping: writes fault, see the module doc
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        flat = torch.frombuffer(
            mapping, dtype=torch.uint8, count=manifest.total_bytes, offset=data_off
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


def _load_from_disk(model_dir: str | Path, dtype: str) -> dict[str, torch.Tensor]:
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import load_weights

    return load_weights(model_dir, ModelConfig.from_dir(model_dir), dtype)


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


def _pool_names(scope: str) -> list[str]:
    if scope and not _SCOPE.fullmatch(scope):
        raise ValueError(f"scope {scope!r}: use up to 64 letters, digits, '_', '.'")
    prefix = PREFIX + (scope + "-" if scope else "")
    if not SHM_DIR.is_dir():
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix) and _NAME.fullmatch(n))


def _check_name(name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ValueError(f"pool name {name!r}: expected {PREFIX}<letters, digits, '_', '.', '-'>")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# -- locks ---------------------------------------------------------------------------------------


def _base(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "little") << 9


def _build_pos(name: str) -> int:
    return _base(name)


def _table_pos(name: str) -> int:
    return _base(name) + 1


def _slot_pos(name: str, slot: int) -> int:
    return _base(name) + 2 + slot


class _LockFile:
    """One open file description of the host's lock file: OFD byte locks (module doc).

    Locks of one description never exclude each other, so every holder opens its own.
    """

    def __init__(self) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        self.fd = os.open(SHM_DIR / LOCK_FILE, flags, 0o600)

    def try_lock(self, pos: int) -> bool:
        try:
            fcntl.fcntl(
                self.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, pos, 1, 0)
            )
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise
        return True

    def unlock(self, pos: int) -> None:
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, pos, 1, 0))

    def is_held(self, pos: int) -> bool:
        """Whether another description holds byte ``pos``."""
        probe = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, pos, 1, 0)
        return _FLOCK.unpack(fcntl.fcntl(self.fd, fcntl.F_OFD_GETLK, probe))[0] != fcntl.F_UNLCK

    @contextlib.contextmanager
    def held(self, pos: int, timeout_s: float = _LOCK_TIMEOUT_S) -> Iterator[None]:
        deadline = time.monotonic() + timeout_s
        pause = 1e-5
        while not self.try_lock(pos):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"parameter pool lock byte {pos} held for {timeout_s} s")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        try:
            yield
        finally:
            self.unlock(pos)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> _LockFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
