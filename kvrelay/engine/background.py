"""Start-up work that runs beside serving (weight packing, grammar tables) yields the CPU.

A worker registers before it has packed its weights for oneDNN (``models.llama``) and built
the grammar compiler's tables (``structured``); both then run on threads of their own while the
first requests are served. On a small host they compete with those requests' steps for the same
cores: a 1P+1D ``kvrelay up`` on 2 vCPUs answered the first request sent the moment it was ready
in 2.0-2.3 s at normal priority, 1.4-1.5 s with these threads at nice 10 (BENCHMARKS.md "1P+1D
threads: ..."). Linux keeps a nice value per thread, and the OpenMP team a thread starts
inherits it.
"""

from __future__ import annotations

import logging
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
