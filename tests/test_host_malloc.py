"""A worker's malloc thresholds (``kvrelay.worker.host_malloc``): a buffer freed and
allocated again reuses its pages instead of faulting them in anew, in a real process."""

from __future__ import annotations

import subprocess
import sys

import pytest

# in a thread (its own malloc arena), allocates and touches a step's buffers (2-13 MiB, above
# glibc's default mmap threshold), then frees them, 20 times after a first round; prints the
# minor page faults those 20 rounds took
_ROUNDS = """
import ctypes, resource, sys, threading
from kvrelay.worker.host_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
sizes = [n << 20 for n in (2, 13, 6, 3)]  # a step's buffers
def round_():
    ptrs = []
    for size in sizes:
        ptrs.append(libc.malloc(size))
        ctypes.memset(ptrs[-1], 1, size)
    for ptr in ptrs:
        libc.free(ptr)
def rounds():
    round_()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        round_()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
t = threading.Thread(target=rounds)  # a thread's arena, as a worker's step threads have
t.start()
t.join()
"""


def _faults(mode: str) -> int:
    done = subprocess.run(
        [sys.executable, "-c", _ROUNDS, mode], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


def test_freed_buffers_are_reused_without_page_faults() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    step_pages = (24 << 20) // 4096  # one round's buffers
    # glibc by default gives some of it back after the first round (the first frees raise its
    # mmap threshold; the arena's top is trimmed) and faults it in again
    assert _faults("default") >= step_pages // 2
    assert _faults("keep") < step_pages // 50  # the first round's pages, reused
