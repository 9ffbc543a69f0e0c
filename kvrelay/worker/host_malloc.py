"""A worker keeps the memory its steps free for the next step (``keep_freed_memory``).

Every engine step allocates its activations anew (a 2,048-token bfloat16 prefill: buffers of
2-13 MB a layer) and frees them. glibc's malloc serves blocks of more than its mmap threshold
(128 KiB at first, raised as big blocks are freed) with fresh ``mmap`` calls and returns them
with ``munmap``, and trims the top of its heap past 128 KiB free: so every step faults its
buffers' pages in again and the kernel zeroes them. A colocated SmolLM2 worker took ~231,000
minor page faults per saturation run (32 x 256-token prompts, 64 tokens out: ~950 MB of pages
zeroed in ~8.5 s); with the threshold fixed at its maximum, ~58,000 once its heap had grown
(BENCHMARKS.md "1P+1D: prefill first...", last paragraphs).

Fixed thresholds keep the freed blocks in the heap for the next step. The cost is memory: the
heap stays at its largest step's size (activations, not weights or KV, which are allocated
once), as a caching allocator would keep it. Only glibc has ``mallopt``; elsewhere (musl,
macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest on 64-bit: bigger blocks are still mmapped
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top returned to the OS only past this


def keep_freed_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process; False where there is no
    glibc ``mallopt`` or it refused them."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.info("malloc thresholds left as they are: no glibc mallopt")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    if not done:
        logger.warning("malloc thresholds: mallopt refused them")
    return done
