"""Start-up work that runs beside serving (weight packing, grammar tables) yields the CPU.

A worker registers before it has packed its weights for oneDNN (``models.llama``) and built
the grammar compiler's tables (``structured``); both then run on threads of their own while the
first requests are served. On a small host they compete with those requests' steps for the same
cores: a 1P+1D ``kvrelay up`` on 2 vCPUs answered the first request sent the moment it was ready
in 2.0-2.3 s at normal priority, 1.4-1.5 s with these threads at nice 10 (BENCHMARKS.md "1P+1D
threads: ..."). Linux keeps a nice value per thread, and the OpenMP team a thread starts
inherits it.

The KV pool's pages are faulted in the same way (``populate_in_background``). A worker's pool
is a shared-memory segment that the kernel backs page by page on first touch, so without this
the first requests after a start paid for it in their steps and KV pulls: 375 ms per 256 MiB
written the first time against 27 ms after, on the 2-vCPU VM (BENCHMARKS.md "First requests
after a start: the KV pool's first touch"). ``MADV_POPULATE_WRITE`` (Linux 5.14) backs the
pages without writing them, so it is safe beside a step that writes KV into the same pool.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading

logger = logging.getLogger(__name__)

NICENESS = 10  # below serving threads (0), above idle (19): it still finishes on a busy host


def lower_priority() -> None:
    """Lowers the calling thread's CPU priority to ``NICENESS`` (where the OS allows it)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), NICENESS)
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: run as before
        logger.debug("background thread priority unchanged: %s", e)


MADV_POPULATE_WRITE = 23  # <linux/mman.h>, Linux 5.14
POPULATE_CHUNK = 32 << 20  # bytes a call backs; the stop flag is checked between calls


def populate_in_background(keep: object, address: int, nbytes: int, what: str) -> threading.Event:
    """Backs ``nbytes`` of mapped memory at ``address`` (owned by ``keep``, which the thread
    holds so the mapping outlives it) on a daemon thread at ``NICENESS``; set the returned
    event to stop it early (the worker does when it closes its pool)."""
    stop = threading.Event()
    thread = threading.Thread(
        target=_populate, args=(keep, address, nbytes, what, stop), name="kv-populate",
        daemon=True,
    )  # fmt: skip
    thread.start()
    return stop


def populate(address: int, nbytes: int, what: str, stop: threading.Event | None = None) -> bool:
    """Backs the pages of ``[address, address + nbytes)`` for writing without changing them.
    True when all are backed; False (logged) where the kernel cannot (before 5.14, not Linux)
    or the memory is not there: a shared-memory segment larger than ``/dev/shm`` has room
    for, whose later writes would raise SIGBUS."""
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (AttributeError, OSError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    pos = address - address % mmap.PAGESIZE
    end = address + nbytes
    while pos < end:
        if stop is not None and stop.is_set():
            return False
        n = min(POPULATE_CHUNK, end - pos)
        if madvise(pos, n, MADV_POPULATE_WRITE) != 0:
            err = ctypes.get_errno()
            if err in (errno.EINVAL, errno.ENOSYS):  # an older kernel: pages back on first use
                logger.debug("%s: MADV_POPULATE_WRITE unsupported (%s)", what, os.strerror(err))
            else:
                logger.warning(
                    "%s: could not back %.0f MB of its %.0f MB (%s); is /dev/shm large enough? "
                    "A write there would kill the process (SIGBUS)",
                    what, (end - pos) / 1e6, nbytes / 1e6, os.strerror(err),
                )  # fmt: skip
            return False
        pos += n
    return True


def _populate(keep: object, address: int, nbytes: int, what: str, stop: threading.Event) -> None:
    lower_priority()  # the first requests' steps come first
    if populate(address, nbytes, what, stop):
        logger.debug("%s: %.0f MB backed", what, nbytes / 1e6)
    del keep  # the thread's last reference to the mapping's owner
