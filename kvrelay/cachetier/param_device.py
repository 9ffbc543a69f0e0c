"""The parameter pool on GPUs: the segment pinned for DMA, the weights copied to the device.

An engine on CUDA needs its weights in device memory, so the pool's zero-copy CPU tensors are
the source of one host -> device copy per instance. From pageable memory the driver stages
every byte through its own pinned buffer; registering the pool's mapping as page-locked
(``cudaHostRegister``) lets the copy DMA straight out of the shared segment::

    /dev/shm segment --mmap--> pool.weights (CPU views) --pin()--> registered, page-locked
        --copy_(non_blocking) on a side stream, then synchronize--> device tensors

``ParamPool.pin`` registers and ``ParamPool.close`` unregisters (registration is per process,
like the mapping). The mapping is read-only, so registration asks for
``cudaHostRegisterReadOnly`` first (the device only reads), then without it; if CUDA refuses
both (e.g. the memlock limit, or a driver that cannot pin a read-only mapping) the copy is a
plain synchronous one from pageable memory and the reason is logged. Nothing here touches CUDA
at import time; callers on a CPU engine never import this module.
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from kvrelay.cachetier.param_pool import ParamPool

logger = logging.getLogger(__name__)

_REGISTER_PORTABLE = 0x01  # cudaHostRegisterPortable: pinned for every CUDA context
_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the device only reads the memory


class PinError(RuntimeError):
    """CUDA would not register the memory as pinned; the message carries its error."""


class DeviceWeights(NamedTuple):
    weights: dict[str, torch.Tensor]
    """Runtime name -> device tensor (a copy: the caller owns it)."""
    is_pinned: bool
    """The copy ran as DMA from the registered segment (False: a plain pageable copy)."""
    seconds: float
    """Wall time of the copy, registration excluded."""


def register_host_memory(address: int, num_bytes: int) -> None:
    """``cudaHostRegister`` of ``[address, address + num_bytes)``; raises ``PinError``."""
    import torch

    cudart = torch.cuda.cudart()
    errors = []
    for flags in (_REGISTER_PORTABLE | _REGISTER_READ_ONLY, _REGISTER_PORTABLE):
        result = cudart.cudaHostRegister(address, num_bytes, flags)
        if int(result) == 0:
            return
        _clear_last_error()
        errors.append(f"flags {flags:#x}: {cudart.cudaGetErrorString(result)} ({int(result)})")
    raise PinError(f"cudaHostRegister of {num_bytes} bytes refused: {'; '.join(errors)}")


def unregister_host_memory(address: int) -> None:
    """``cudaHostUnregister``; a failure is logged (the memory is about to be unmapped)."""
    import torch

    result = torch.cuda.cudart().cudaHostUnregister(address)
    if int(result) != 0:
        _clear_last_error()
        logger.warning("cudaHostUnregister(%#x) failed: error %d", address, int(result))


def copy_to_device(pool: ParamPool, device: torch.device | str) -> DeviceWeights:
    """The pool's weights on CUDA ``device``: pinned and copied asynchronously on a side
    stream when the segment can be registered, else copied plainly (the reason is logged).
    Returns once every copy is complete; the tensors are allocated on the current stream."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"copy_to_device needs a CUDA device, got {device}")
    try:
        pool.pin()
    except PinError as e:
        logger.warning("pool %s: copying to %s from pageable memory: %s", pool.name, device, e)
    source = pool.weights
    start = time.perf_counter()
    if not pool.is_pinned:
        weights = {name: t.to(device) for name, t in source.items()}
        return DeviceWeights(weights, False, time.perf_counter() - start)
    weights = {name: torch.empty_like(t, device=device) for name, t in source.items()}
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the allocations come first
    with torch.cuda.stream(stream):
        for name, t in source.items():
            weights[name].copy_(t, non_blocking=True)
    stream.synchronize()
    return DeviceWeights(weights, True, time.perf_counter() - start)


def _clear_last_error() -> None:
    """Resets the thread's last CUDA error that a refused call left behind; otherwise torch's
    next kernel-launch check (``cudaGetLastError``) would raise it. torch binds no
    ``cudaGetLastError``, so it is called in the libcudart torch itself loaded."""
    for path in _loaded_libraries("libcudart.so"):
        ctypes.CDLL(path).cudaGetLastError()
        return
    logger.warning("libcudart not found among the loaded libraries: a CUDA error may linger")


def _loaded_libraries(stem: str) -> Iterator[str]:
    seen = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if line.count("/") else ""
        if stem in Path(path).name and path not in seen:
            seen.add(path)
            yield path
