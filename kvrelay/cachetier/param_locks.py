"""Parameter pool locks and users: the host's OFD lock table and each segment's user slots.

Decides who holds a pool: its builder, the changes to its state and user table, and each
attached user. Locks are OFD byte locks on one host-wide file,
``/dev/shm/kvrelay-params.lock`` (never removed, so no unlink races), at offsets derived from
the pool name, ``base = (48 bits of blake2b(name)) << 9``::

    base + 0        build lock: held for a whole build or fill; creators wait on it
    base + 1        table lock: held briefly to change the state or the user slots, or unlink
    base + 2 + i    user slot i: held by the attachment in slot i for as long as it lasts
    base + 2 + MAX_USERS
                    interest: read-locked (shared) by every process from the moment it means
                    to attach, fill or build until it has (``interest``); ``gc`` frees no pool
                    while anyone holds it

The kernel drops an OFD lock when its holder dies, so liveness needs no pid checks and is
right across pid namespaces and pid reuse: a slot whose lock is free belongs to a dead user
and is cleared whenever the table is changed; a segment that is not READY while its build lock
is free is stale. Lock order: build before table; never two pools' locks at once.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import struct
import time
from collections.abc import Iterator

from kvrelay.cachetier.param_segment import (
    _LAST_USED,
    _LAST_USED_POS,
    _SLOT,
    _SLOTS_POS,
    MAX_USERS,
    _is_linked,
)
from kvrelay.cachetier.segments import SHM_DIR

logger = logging.getLogger(__name__)

LOCK_FILE = "kvrelay-params.lock"
_FLOCK = struct.Struct("hhqqi4x")  # struct flock (Linux): type, whence, start, len, pid
_LOCK_TIMEOUT_S = 10.0


class PoolBusy(RuntimeError):
    """The pool has live users or a live builder (``force`` overrides), or no free slot."""


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


@contextlib.contextmanager
def interest(name: str) -> Iterator[None]:
    """Declares that this process is about to attach to, fill or build pool ``name``: while
    held, ``gc`` frees no pool of that name, so one that is READY now is still there when the
    attach comes (the table lock taken on entry waits out a sweep that judged it before)."""
    with _LockFile() as locks:
        locks.share(_interest_pos(name))
        with locks.held(_table_pos(name)):
            pass
        yield


def _base(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=6).digest(), "little") << 9


def _build_pos(name: str) -> int:
    return _base(name)


def _table_pos(name: str) -> int:
    return _base(name) + 1


def _slot_pos(name: str, slot: int) -> int:
    return _base(name) + 2 + slot


def _interest_pos(name: str) -> int:
    return _base(name) + 2 + MAX_USERS


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

    def share(self, pos: int) -> None:
        """Takes a read (shared) lock on ``pos``; nobody write-locks it, so it never waits."""
        fcntl.fcntl(self.fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_RDLCK, os.SEEK_SET, pos, 1, 0))

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
