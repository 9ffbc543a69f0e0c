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
