"""bfloat16 weights in oneDNN's blocked layout, for CPU steps of more than ``gemv.MAX_ROWS`` rows.

A batched decode step or a prefill multiplies many rows by each weight: compute, not bytes,
bounds it, and torch's ``mm`` on a plain bfloat16 weight lets oneDNN reorder the weight into
its blocked layout on every call. A copy reordered once (``torch.ops.mkldnn``, the same
primitive) skips that: on an EPYC core (AVX512-BF16) SmolLM2's offline throughput rises 17%
(BENCHMARKS.md). The results are oneDNN's, as ``mm``'s are (the tests compare them).

The cost is memory: the packed copy sits beside the plain weights (which the native decode
kernels and the parameter pool keep using), private to the process. So it is opt-in,
``KVRELAY_CPU_PACKED_WEIGHTS=1``, and only where it applies: a bfloat16 model on a CPU whose
oneDNN computes in bfloat16.
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
def supported() -> bool:
    """oneDNN is built in and this CPU computes bfloat16 in it (AVX512-BF16 or AMX)."""
    return bool(
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def wanted(weights: Mapping[str, torch.Tensor]) -> bool:
    """Packing is asked for (``KVRELAY_CPU_PACKED_WEIGHTS``) and applies to ``weights``; logs
    why not when it was asked for and does not apply."""
    if not envs.get("KVRELAY_CPU_PACKED_WEIGHTS"):
        return False
    embed = weights["embed"]
    why = None
    if embed.device.type != "cpu" or embed.dtype != torch.bfloat16:
        why = f"the model is {embed.dtype} on {embed.device.type}, not bfloat16 on cpu"
    elif not supported():
        why = "this CPU's oneDNN has no bfloat16 compute"
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
