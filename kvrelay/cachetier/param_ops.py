"""Host-wide parameter pool operations: naming, listing, collecting and removing pools.

Decides when a segment is freed. No process owns a segment (none registers it with a
resource tracker). ``gc`` unlinks a pool with no live user that has been idle for ``grace_s``
(``last_used`` is stamped at every attach and detach, and when a dead user is found) and any
stale one, but never one that a live process builds or fills (build lock) or has declared it
is about to attach to (``param_locks.interest``: ``attach_or_create`` and a worker's chain
fetch hold it from before they look at the pool until they are registered users);
``remove`` unlinks one on request; every ``attach_or_create`` runs ``gc`` first, with a grace
far longer than a start takes (``ATTACH_GC_GRACE_S``), so a cluster's restart, or another
cluster's, finds its idle pool still there. A
pool of another format version is freed once ``/proc/*/maps`` shows no process mapping it (its
user table is not this version's to trust). Unlinking only removes the name: mapped memory
stays valid until its last mapper unmaps it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from typing import Literal

from kvrelay.cachetier.param_locks import (
    PoolBusy,
    _build_pos,
    _interest_pos,
    _live_users,
    _LockFile,
    _table_pos,
)
from kvrelay.cachetier.param_segment import (
    _LAST_USED,
    _LAST_USED_POS,
    ITEM_SIZES,
    READY,
    CorruptPool,
    OutdatedPool,
    _Header,
    _open_segment,
    _read_manifest,
    _unlink,
)
from kvrelay.cachetier.segments import SHM_DIR, segment_mappers

logger = logging.getLogger(__name__)

PREFIX = "kvrelay-params-"
DEFAULT_GRACE_S = 300.0  # `kvrelay pool gc`: an operator's sweep
ATTACH_GC_GRACE_S = 24 * 3600.0  # the sweep every attach runs: only pools nobody came back to
PoolState = Literal["building", "ready", "stale", "outdated"]  # outdated: another version's
_SCOPE = re.compile(r"[A-Za-z0-9_.]{1,64}")
_NAME = re.compile(re.escape(PREFIX) + r"[A-Za-z0-9_.-]{1,180}")


@dataclasses.dataclass(frozen=True, slots=True)
class PoolInfo:
    name: str
    fingerprint: str  # hex of the 16-byte model identity ("" before the header is written)
    dtype: str
    num_bytes: int  # segment size
    state: PoolState
    user_pids: tuple[int, ...]  # live users (pids as their own namespace saw them)
    last_used: float  # unix time of the last attach, detach or dead user found
    source: str = ""  # the checkpoint directory it was built from ("" unless ready)

    def idle_s(self, now: float | None = None) -> float | None:
        """Seconds since last use, or None while the pool has users."""
        return None if self.user_pids else (now or time.time()) - self.last_used


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
                is_ready = header is not None and header.state == READY
                source = _read_manifest(fd, header).source if header and is_ready else ""
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
            out.append(PoolInfo(name, fp, dtype, size, state, tuple(users), last, source))
    return out


def gc(grace_s: float = DEFAULT_GRACE_S, scope: str = "") -> list[str]:
    """Unlinks the stale pools of ``scope`` and the ready ones with no live user idle for
    ``grace_s``; returns their names. Pools being built or filled, and pools a process has
    declared it will attach to (``param_locks.interest``), are left alone."""
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


def _is_collectable(name: str, grace_s: float, now: float, locks: _LockFile) -> bool:
    """Under the build and table locks: nobody's declared interest, and stale, or ready,
    unused and idle for ``grace_s``."""
    if locks.is_held(_interest_pos(name)):
        return False  # a process is about to attach (or fill, or build): the interest lock
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
