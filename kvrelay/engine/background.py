"""Start-up work that runs beside serving (weight packing) yields the CPU.

A worker registers before it has packed its weights for oneDNN (``models.llama``) and built
the grammar compiler's tables (``structured``); both then run on threads of their own while the
first requests are served. On a small host they compete with those requests' steps for the same
cores: a 1P+1D ``kvrelay up`` on 2 vCPUs answered the first request sent the moment it was ready
in 2.0-2.3 s at normal priority, 1.4-1.5 s with these threads at nice 10 (BENCHMARKS.md "1P+1D
threads: ..."). Linux keeps a nice value per thread, and the OpenMP team a thread starts
inherits it.

Only a thread that works with the GIL released may be lowered. Packing is torch ops (the GIL
released inside each); the grammar tables are Python, Rust and C++ that hold the GIL for up to
~0.2 s at a time, and a low-priority thread holding it on busy cores is a priority inversion:
every other thread of the process waits for it, the heartbeat's too. With three busy processes
on 2 vCPUs, a 10 ms ticker thread's longest gap was 1.7-1.8 s while the tables built at nice
10 (past a test cluster's ``--dead-after 1.5``: CI saw the worker declared dead) and 0.23 s at
normal priority; packing at nice 10 0.035 s (``benchmarks/gil_priority.py``). So the tables
build at normal priority.
"""

from __future__ import annotations

import logging
import os
import threading

logger = logging.getLogger(__name__)

NICENESS = 10  # below serving threads (0), above idle (19): it still finishes on a busy host


def lower_priority() -> None:
    """Lowers the calling thread's CPU priority to ``NICENESS`` (where the OS allows it); a
    thread already lower (a worker at ``--cpu-nice 19``) stays there: with the privilege to
    (root), setting ``NICENESS`` would raise it above the worker's serving threads."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(NICENESS, os.getpriority(os.PRIO_PROCESS, tid)))
    except (AttributeError, OSError) as e:  # not Linux, or not allowed: run as before
        logger.debug("background thread priority unchanged: %s", e)
