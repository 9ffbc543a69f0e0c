"""Weights in oneDNN's blocked layout, for CPU steps of more than ``gemv.MAX_ROWS`` rows.

A batched decode step or a prefill multiplies many rows by each weight. torch's ``mm`` on a
plain weight packs the weight's panels on every call (MKL in float32; oneDNN reorders a
bfloat16 one), which over weights that come from memory once a step costs as much as the
arithmetic: SmolLM2's 30 layers at 64 rows take 144 ms in float32 through ``mm`` and 80 ms
on copies reordered once (``torch.ops.mkldnn``), its tied LM head 42 against 18 ms
(BENCHMARKS.md). Results match ``mm``'s to float32 summation order (the tests compare them).

The cost is memory: the packed copy sits beside the plain weights (which the native decode
kernels and the parameter pool keep using), private to the process. So it is opt-in,
``KVRELAY_CPU_PACKED_WEIGHTS=1``, and only where it applies: a float32 or bfloat16 model on a
CPU whose oneDNN computes that dtype.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping

import torch

from kvrelay import envs

logger = logging.getLogger(__name__)

PACK_ROWS = 32  # the batch size oneDNN picks its blocking for; any row count works


@functools.cache
def supported(dtype: torch.dtype) -> bool:
    """oneDNN is built in and computes ``dtype`` on this CPU (bfloat16: AVX512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


def wanted(weights: Mapping[str, torch.Tensor]) -> bool:
    """Packing is asked for (``KVRELAY_CPU_PACKED_WEIGHTS``) and applies to ``weights``; logs
    why not when it was asked for and does not apply."""
    if not envs.get("KVRELAY_CPU_PACKED_WEIGHTS"):
        return False
    embed = weights["embed"]
    why = None
    if embed.device.type != "cpu" or embed.dtype not in (torch.float32, torch.bfloat16):
        why = f"the model is {embed.dtype} on {embed.device.type}, not float32/bfloat16 on cpu"
    elif not supported(embed.dtype):
        why = f"this CPU's oneDNN does not compute {embed.dtype}"
    if why is not None:
        logger.warning("KVRELAY_CPU_PACKED_WEIGHTS ignored: %s", why)
        return False
    return True


def pack(w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """A blocked copy of ``w`` (``transposed``: stored ``[in, out]``, else ``[out, in]``)."""
    plain = w.t() if transposed else w
    return torch.ops.mkldnn._reorder_linear_weight(plain.contiguous(), PACK_ROWS)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + bias`` where ``packed`` is ``pack(w, ...)``."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
