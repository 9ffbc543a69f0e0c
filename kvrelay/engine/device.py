"""Where an engine runs: its torch device, the KV pool's allocator, and what a CPU computes
natively (bfloat16 or not)."""

from __future__ import annotations

import ctypes
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from kvrelay import envs
from kvrelay.engine.config import ConfigError
from kvrelay.kernels import hugepages

logger = logging.getLogger(__name__)

KvAllocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]
"""Makes the KV pool tensor (zeroed) of a shape and dtype on a device; workers share it
(a shared-memory segment on CPU, a CUDA IPC handle on a GPU)."""


def allocate_local(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """The ``KvAllocator`` of an engine that shares its pool with no other process (on the CPU,
    on huge pages where the host allows: ``kernels.hugepages``)."""
    if device.type == "cpu":
        return hugepages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 1 << 30  # freed heap memory kept for the next step, at most


def keep_step_memory() -> bool:
    """Has glibc's malloc keep the memory a CPU step frees for the next step (the process's
    allocator; ``KVRELAY_CPU_MALLOC_REUSE``); whether it did.

    A step of many rows allocates its activations afresh: a prompt chunk of 2,048 tokens makes
    tensors of 6-38 MB a layer. glibc serves a block of more than its mmap threshold (128 KiB,
    raised to the largest block freed so far) from a fresh mapping, and returns freed memory at
    the top of its heaps once there is more than twice that threshold: so the next step's
    tensors fault in new pages, which the kernel zeroes first (perf, make-tiny ``medium``'s
    offline run: ~4% of the samples in page faults under the panels' stores). A fixed mmap
    threshold at glibc's limit (32 MiB) and a trim threshold of 1 GiB keep blocks up to 32 MiB
    in the heap, and reused: 0.93-0.94x the offline run's time (BENCHMARKS.md "A step's memory
    reused"). vLLM's CPU build preloads tcmalloc where it ships one, for the same reason.
    Nothing happens off glibc (another libc, macOS) or with the variable at 0."""
    if not sys.platform.startswith("linux") or not envs.get("KVRELAY_CPU_MALLOC_REUSE"):
        return False
    try:
        libc = ctypes.CDLL(None)
        if not hasattr(libc, "gnu_get_libc_version"):  # not glibc: its own policy
            return False
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mapped = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    return bool(mapped and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX-BF16): torch's bfloat16
    matmuls run on a slow conversion path without either."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return True  # cannot tell (not Linux): say nothing
    flags = set(next((ln for ln in cpuinfo.splitlines() if ln.startswith("flags")), "").split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def note_cpu_dtype(device: torch.device, dtype: str) -> None:
    """Logs how bfloat16 runs on a CPU without native BF16, where torch's bfloat16 GEMMs take a
    conversion path 8-190x slower than float32's (an AVX2 CPU; BENCHMARKS.md): steps of many
    rows multiply float32 copies of the weights there (``gemv.widens_bfloat16``)."""
    if device.type == "cpu" and dtype == "bfloat16" and not cpu_has_native_bf16():
        logger.info(
            "bfloat16 on a CPU without AVX512-BF16 or AMX: prompts and large batches multiply "
            "float32 copies of the weights (twice their bytes) and round to bfloat16; lone "
            "decode steps read the bfloat16 weights in kvrelay's native kernel"
        )


def resolve_device(name: str) -> torch.device:
    """The torch device for ``EngineConfig.device``; ConfigError when it cannot run here."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {name!r} asked for, but torch sees no CUDA device here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {name!r} asked for, but only {torch.cuda.device_count()} CUDA device(s)"
            )
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # kernels, streams and IPC handles of this process use it
    return device
