"""Parameter pool: a checkpoint's runtime weights, materialised once per host in shared memory.

The first instance on a host that needs a checkpoint in a dtype builds its pool: ``build()``
(``load_weights`` by default) is written into one ``/dev/shm`` segment. Every other instance
attaches: one ``mmap`` and read-only tensor views over it, no copy, so attaching does not
grow with the model and N instances hold one copy of the weights (shared pages).

This module decides how a process attaches, builds and fills a pool (``ParamPool``). The
segment's format is ``param_segment`` (the layout diagram is there), its locks and user slots
``param_locks``, the host-wide operations (``pool_name``, ``list_pools``, ``gc``, ``remove``)
``param_ops``.

The manifest describes the data completely, so it is what a peer transfer sends first
(``pool.header``); the receiver lays out the same segment with ``open_for_fill``, writes
chunks into ``pool.buffer``, checks them (``verify_chunk``) and calls ``mark_ready``.

Tensors are read-only by construction: attached pools map the segment ``PROT_READ``, so a
stray in-place op on a weight faults (SIGSEGV) instead of corrupting every instance's copy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from kvrelay.cachetier.param_locks import (
    _build_pos,
    _deregister,
    _LockFile,
    _register,
    _table_pos,
    interest,
)
from kvrelay.cachetier.param_ops import (
    ATTACH_GC_GRACE_S,
    _check_name,
    gc,
    pool_name,
)
from kvrelay.cachetier.param_segment import (
    _MANIFEST_POS,
    _STATE,
    _STATE_POS,
    CHUNK_BYTES,
    READY,
    CorruptPool,
    Manifest,
    OutdatedPool,
    _chunk_checksums,
    _close_mapping,
    _create_segment,
    _Header,
    _is_linked,
    _open_segment,
    _read_manifest,
    _state_of,
    _tensors,
    _unlink,
    _write_tensors,
)

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)


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
        grace_s: float = ATTACH_GC_GRACE_S,
    ) -> ParamPool:
        """Attaches to the host's pool of ``model_dir`` in ``dtype``, building it if needed.

        Exactly one of several concurrent callers builds; the others wait for it and attach.
        A builder that dies is replaced by the next caller. The caller's interest is declared
        (``param_locks.interest``) before anything else, so no ``gc`` frees the pool between
        finding it READY and attaching to it.

        Args:
            build: returns the runtime weights; default ``load_weights(model_dir, ...)``.
            scope: namespaces the pool name (tests); "" for the host-wide pool.
            wait_s: how long to wait for another process's build.
            grace_s: for the ``gc`` sweep run first (of other pools: never this one).

        Raises:
            TimeoutError: another process was still building after ``wait_s``.
            CorruptPool: the existing pool is unreadable or holds another model.
        """
        from kvrelay.engine.identity import model_identity

        fingerprint = model_identity(model_dir, dtype)
        name = pool_name(fingerprint, dtype, scope)
        build = build or functools.partial(_load_from_disk, model_dir, dtype)
        with interest(name):
            gc(grace_s, scope=scope)
            return cls._attach_or_build(name, fingerprint, dtype, build, wait_s, model_dir)

    @classmethod
    def _attach_or_build(
        cls,
        name: str,
        fingerprint: bytes,
        dtype: str,
        build: Callable[[], Mapping[str, torch.Tensor]],
        wait_s: float,
        model_dir: str | Path,
    ) -> ParamPool:
        """Attaches if READY, else builds under the build lock, else waits for the builder."""
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
                        return pool or cls._build(name, fingerprint, dtype, build, locks, model_dir)
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
        source: str | Path,
    ) -> ParamPool:
        """Under the build lock: (re)creates the segment from ``build()`` and attaches."""
        started = time.perf_counter()
        _unlink(name)  # stale: its builder is dead, as we hold the build lock
        tensors = dict(build())
        source = str(Path(source).resolve())
        manifest = Manifest.plan(fingerprint, dtype, tensors, CHUNK_BYTES, source)
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


def _load_from_disk(model_dir: str | Path, dtype: str) -> dict[str, torch.Tensor]:
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import load_weights

    return load_weights(model_dir, ModelConfig.from_dir(model_dir), dtype)
