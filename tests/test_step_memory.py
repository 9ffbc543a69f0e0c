"""engine.device.keep_step_memory: a CPU engine's freed activations are reused by the next step
instead of coming back as fresh, zeroed pages. Read from glibc's own accounting (mallinfo2), in
a fresh interpreter each (malloc's settings are the process's). What it buys is measured in
BENCHMARKS.md ("A step's memory reused")."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys

import pytest

PROBE = r"""
import ctypes, json, torch
from kvrelay.engine.device import keep_step_memory

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
kept = keep_step_memory()
mapped = libc.mallinfo2().hblks
block = torch.empty(6 << 20).fill_(1.0)  # 24 MiB of a step's activations, every page written
mapped = libc.mallinfo2().hblks - mapped
heap = libc.mallinfo2().arena
del block  # freed at the heap's top (where it was not mapped on its own)
print(json.dumps({"kept": kept, "mapped": mapped, "returned": heap - libc.mallinfo2().arena}))
"""


def glibc_mallinfo2() -> bool:
    libc = ctypes.CDLL(None)
    return hasattr(libc, "gnu_get_libc_version") and hasattr(libc, "mallinfo2")


needs_glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not glibc_mallinfo2(),
    reason="glibc (2.33 or later, for mallinfo2) only",
)


def probe(reuse: str) -> dict[str, int]:
    env = {**os.environ, "KVRELAY_CPU_MALLOC_REUSE": reuse}
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_a_freed_step_is_reused_without_new_pages() -> None:
    found = probe("1")
    assert found["kept"] == 1
    assert found["mapped"] == 0, "a 24 MiB block still got a mapping of its own"
    assert found["returned"] == 0, "freed memory went back to the kernel"


@needs_glibc
def test_the_switch_leaves_glibc_as_it_was() -> None:
    found = probe("0")
    assert found["kept"] == 0
    # glibc's own policy (a threshold of 128 KiB in a fresh process) maps such a block on its
    # own, and unmaps it when it is freed: the next step's block faults in fresh pages
    assert found["mapped"] == 1, found


# in a thread (its own malloc arena, as a worker's step threads have), allocates and touches a
# step's buffers (2-13 MiB, above glibc's default mmap threshold), then frees them, 20 times
# after a first round; prints the minor page faults those 20 rounds took
_ROUNDS = """
import ctypes, resource, sys, threading
from kvrelay.engine.device import keep_step_memory
if sys.argv[1] == "keep":
    assert keep_step_memory()
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


@needs_glibc
def test_freed_buffers_are_reused_without_page_faults() -> None:
    step_pages = (24 << 20) // 4096  # one round's buffers
    # glibc by default gives some of it back after the first round (the first frees raise its
    # mmap threshold; the arena's top is trimmed) and faults it in again
    assert _faults("default") >= step_pages // 2
    assert _faults("keep") < step_pages // 50  # the first round's pages, reused
