"""2 MiB pages under a CPU engine's KV pool.

A decode step reads each sequence's KV blocks, which lie anywhere in the pool: with 4 KiB pages
nearly every block of every head costs a TLB miss and a page walk (two walks in a VM, whose
memory is itself paged), on top of its cache misses. Linux backs memory with transparent huge
pages where a process asks for them (``madvise(MADV_HUGEPAGE)``; ``madvise`` is the mode most
distributions ship in ``/sys/kernel/mm/transparent_hugepage/enabled``), for pages first
touched after the advice: so ``empty`` maps fresh memory and advises it before anything writes
it.

Measured on the AVX2 EPYC VM (BENCHMARKS.md "Huge pages under the KV pool"), SmolLM2's lone
decode step after a mix of requests has scattered the free blocks: at a 2,000-token context
0.92x the time in bfloat16 and 0.94x in float32, at 500 tokens 1.06x and 1.00x (inside this
VM's noise; the pool's blocks of 500 tokens still fit the TLB's reach). The weights were tried
on huge pages too and are left on 4 KiB pages: they are read as long sequential streams, which
the prefetchers and the TLB follow well (a lone bfloat16 step 1.02-1.06x the time on huge
pages).

A worker's pool exported to its peers is a shared-memory segment, which follows
``shmem_enabled`` instead (``never`` on many hosts): it is advised the same way and gets huge
pages where the host allows. ``KVRELAY_HUGE_PAGES=0`` turns the advice off.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay import envs

if TYPE_CHECKING:  # torch only where a tensor is made (shm_pool imports this without it)
    import torch

HUGE_PAGE = 2 << 20  # bytes of an x86-64 / arm64 transparent huge page
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # None off Linux


def enabled() -> bool:
    """Whether big CPU tensors go on advised mappings (``KVRELAY_HUGE_PAGES``, on Linux)."""
    return (
        MADV_HUGEPAGE is not None
        and sys.platform.startswith("linux")
        and bool(envs.get("KVRELAY_HUGE_PAGES"))
    )


def advise_mapping(mapping: mmap.mmap) -> bool:
    """Asks for huge pages under a fresh mapping (before it is touched); whether the advice was
    given. A shared-memory mapping gets them only where ``shmem_enabled`` is ``advise`` or
    ``within_size``."""
    if MADV_HUGEPAGE is None or not enabled():
        return False
    try:
        mapping.madvise(MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def empty(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor; from two huge pages up, on its own anonymous mapping that
    starts at a 2 MiB boundary and is advised before anything touches it. (``torch.empty``'s
    memory comes from malloc, which serves sizes under its moving mmap threshold, up to 32 MiB,
    from reused heap memory whose pages exist already.) The tensor holds the mapping: it is
    unmapped with the tensor's last view."""
    import torch

    shape = tuple(shape)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < 2 * HUGE_PAGE or not enabled():
        return torch.empty(shape, dtype=dtype)
    # private: an anonymous mmap is shared (shmem) by default, which follows shmem_enabled
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)  # room for a 2 MiB boundary
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds `mapping`; never closed
    skip = -whole.data_ptr() % HUGE_PAGE
    advise_mapping(mapping)
    return whole[skip : skip + nbytes].view(dtype).view(shape)


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros`` on the CPU, its pages huge where the host allows."""
    return empty(shape, dtype).zero_()
