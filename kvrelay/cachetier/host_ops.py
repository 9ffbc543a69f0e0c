"""Operator functions for L1 host pools: naming, listing and removing their segments.

Decides a segment's name and lifetime. The segment is never registered with Python's resource
tracker; it outlives every process until an operator frees it (``kvrelay cache rm``:
``remove_host_pool``, which refuses while a live process maps it; ``unlink_pool``
unconditionally). A different model must use another name (``default_pool_name`` derives one
from the block format and the model fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from kvrelay.cachetier.base import DTYPE_CODES, BlockFormat
from kvrelay.cachetier.host_segment import (
    _HEADER_FIELDS,
    _LAYOUT_VERSION,
    _NAME,
    _POOL_HEADER,
    _POOL_MAGIC,
    _STATE_MASK,
    _VALID,
    _check_name,
    _Geometry,
    _lock_path,
)
from kvrelay.cachetier.segments import SHM_DIR, segment_mappers

_SCOPE = re.compile(r"[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*")


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
