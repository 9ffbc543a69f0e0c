"""Packed copies of the weights for CPU steps of more than ``gemv.MAX_ROWS`` rows: oneDNN's
blocked layout, or kvrelay's panels (``kernels.cpu_panels``) on an AVX2 or AVX-512 CPU whose
bfloat16 computes no faster than float32 (no AMX, slow or no AVX512-BF16), where oneDNN's
float32 kernels wait on memory at 8-64 rows (``kernel``, ``KVRELAY_CPU_PACKED_KERNEL``).

A batched decode step or a prefill multiplies many rows by each weight. torch's ``mm`` on a
plain weight packs the weight's panels on every call (MKL in float32; oneDNN reorders a
bfloat16 one), which over weights that come from memory once a step costs as much as the
arithmetic: SmolLM2's 30 layers at 64 rows take 144 ms in float32 through ``mm`` and 80 ms
on copies reordered once (``torch.ops.mkldnn``), its tied LM head 42 against 18 ms
(BENCHMARKS.md). Results match ``mm``'s to float32 summation order (the tests compare them).

The cost is memory: the packed copy sits beside the plain weights (which the native decode
kernels and the parameter pool keep using), private to the process, and the time to write it
when the engine starts. It applies to a float32 or bfloat16 model; where oneDNN does not
compute bfloat16 (an AVX2 CPU: ``gemv.widens_bfloat16``), a bfloat16 model's copies are
float32 (twice the bytes) and its steps of many rows multiply in float32, rounding the
result to bfloat16, instead of taking torch's bfloat16 conversion path (8-190x slower).
``KVRELAY_CPU_PACKED_WEIGHTS`` decides: unset, the engine packs
when the copy fits in ``AUTO_SHARE`` of the memory available (``MemAvailable``), as vLLM's CPU
backend packs its weights when it loads them, but on a background thread, so the engine starts
and serves on the plain weights meanwhile (start to first token stays as it was; the packed
copies are opaque oneDNN tensors, which cannot live in the shared parameter pool); 1 packs
always, before the engine starts; 0 never (a host short of memory).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch

from kvrelay import envs
from kvrelay.kernels import cpu_panels, gemv
from kvrelay.kernels.cpu_panels import Panels

logger = logging.getLogger(__name__)

PACK_ROWS = 32  # the batch size oneDNN picks its blocking for; any row count works
# bfloat16 steps of more rows than this run on the packed copies: gemv's products (BF16 dot
# products on AVX512-BF16, else float32 multiply-adds on widened weights) are compute-bound
# from ~4 rows, where oneDNN's are not (the 30 layers' products, cold: 4 / 8 rows 13.7 / 22.8
# ms in gemv against 11.4 / 13.3 in oneDNN; whole decode steps of 6 / 8 rows 17.8 / 22.1 ms
# this way against 19.9 / 24.7 in the native whole-step call). float32 keeps gemv.MAX_ROWS
# (8 rows: 30.2 native against 34.2 packed). BENCHMARKS.md, "Native rows".
NATIVE_ROWS_BF16 = 4


Packed = torch.Tensor | Panels  # oneDNN's blocked copy, or kvrelay's panels


def kernel() -> str:
    """The packed copies' kind: ``"panels"`` (``kernels.cpu_panels``, where ``chosen``) or
    ``"onednn"``, as ``KVRELAY_CPU_PACKED_KERNEL`` says (auto: panels where they are the
    faster, an AVX2 or AVX-512 CPU whose bfloat16 is no faster than float32, and the native
    library is built: ``cpu_panels.preferred``)."""
    return "panels" if cpu_panels.chosen() else "onednn"


def native_rows(dtype: torch.dtype) -> int:
    """Rows up to which a step of a model with packed ``dtype`` weights stays native. Where
    the copies of bfloat16 weights are float32 (``packed_dtype``), gemv's bfloat16 rows stay
    native up to ``gemv.MAX_ROWS``: it reads half the bytes, and oneDNN's float32 products are
    slower there (AVX2 Zen 3, SmolLM2 decode steps of 6 / 8 rows: 93 / 97 ms on the copies
    against 35 / 60 native; BENCHMARKS.md, "bfloat16 on a CPU without native BF16")."""
    if dtype == torch.bfloat16 and packed_dtype(dtype) == torch.bfloat16:
        return NATIVE_ROWS_BF16
    return gemv.MAX_ROWS


AUTO_SHARE = 0.25  # unset: pack when the copy takes at most this share of the memory available


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """The packed kernel (``kernel``) is built in and ``dtype`` is float32 or bfloat16 (packed
    as float32 where oneDNN does not compute bfloat16, and in panels: ``packed_dtype``)."""
    built = kernel() == "panels" or torch.backends.mkldnn.is_available()
    return built and dtype in (torch.float32, torch.bfloat16)


def packed_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a ``dtype`` weight's packed copy holds: float32 in panels, and for bfloat16
    where oneDNN does not compute it (``gemv.widens_bfloat16``), else ``dtype``."""
    if dtype == torch.bfloat16 and (kernel() == "panels" or gemv.widens_bfloat16()):
        return torch.float32
    return dtype


def copy_bytes(w: torch.Tensor, transposed: bool = True) -> int:
    """The bytes of ``w``'s packed copy."""
    if kernel() == "panels":
        return cpu_panels.copy_bytes(w, transposed)
    return w.numel() * packed_dtype(w.dtype).itemsize


def plan(weights: Mapping[str, torch.Tensor], copy_bytes: int) -> str | None:
    """How to pack ``weights`` (a copy of ``copy_bytes``): ``"now"`` when
    ``KVRELAY_CPU_PACKED_WEIGHTS=1`` asks for it, ``"background"`` when unset and the copy
    fits in memory, None when not at all (0, or it does not apply, or does not fit). Logs
    why not when it was asked for and does not apply, and what unset decided."""
    choice = envs.get("KVRELAY_CPU_PACKED_WEIGHTS")
    if choice is False:
        return None
    embed = weights["embed"]
    why = None
    if embed.device.type != "cpu" or embed.dtype not in (torch.float32, torch.bfloat16):
        why = f"the model is {embed.dtype} on {embed.device.type}, not float32/bfloat16 on cpu"
    elif not supported(embed.dtype):
        why = "torch is built without oneDNN"
    if why is not None:
        if choice:
            logger.warning("KVRELAY_CPU_PACKED_WEIGHTS ignored: %s", why)
        return None
    if choice:
        return "now"
    available = memory_available()
    fits = available is not None and copy_bytes <= AUTO_SHARE * available
    logger.info(
        "%s the weights (%s): the copy is %.0f MB, %s MB available "
        "(KVRELAY_CPU_PACKED_WEIGHTS unset: packs when it is at most %d%%)",
        "packing (in the background)" if fits else "not packing",
        kernel(),
        copy_bytes / 1e6,
        "unknown" if available is None else f"{available / 1e6:.0f}",
        round(100 * AUTO_SHARE),
    )
    return "background" if fits else None


def memory_available() -> int | None:
    """Bytes of memory available to new allocations (``MemAvailable``), None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pack(w: torch.Tensor, transposed: bool) -> Packed:
    """A packed copy of ``w`` (``transposed``: stored ``[in, out]``, else ``[out, in]``): panels
    or oneDNN's blocked layout, as ``kernel`` says."""
    if kernel() == "panels":
        return cpu_panels.pack(w, transposed)
    plain = (w.t() if transposed else w).to(packed_dtype(w.dtype))
    return torch.ops.mkldnn._reorder_linear_weight(plain.contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + bias`` where ``packed`` is ``pack(w, ...)`` (a float32 copy of a bfloat16
    ``w``: computed in float32, the result rounded to ``x``'s dtype)."""
    if isinstance(packed, Panels):
        return cpu_panels.linear(x, packed, bias).to(x.dtype)
    if packed.dtype == x.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    wide = x.to(packed.dtype)
    bias = None if bias is None else bias.to(packed.dtype)
    return torch.ops.mkldnn._linear_pointwise(wide, packed, bias, "none", [], "").to(x.dtype)
