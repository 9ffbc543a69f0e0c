"""A decoder layer's small ops on a GPU, one Triton launch each (``triton_kernels``).

Around its four products and its attention, a layer of the torch path launched ~20 small
kernels on a GPU: an RMSNorm in a 16-bit dtype is five (the residual add, the widening, the
norm, the narrowing, the weight's product), the rotary embedding seven on strided halves of
the heads plus a concatenation, SiLU and the product two. On an H200 a SmolLM2-135M decode step
of 32 sequences (a CUDA graph's replay) spent ~1.1 of its ~1.9 ms of GPU time in them, 1-2 us
each (BENCHMARKS.md "GPU steps: a layer's small ops in Triton"). Here each group is one
launch, with the same API as the CPU library's row ops (``cpu_rows``): ``add_rms_norm``
(the residual added in place, fused into the next norm), ``rope_`` (q and k rotated in place
in the fused projection's output) and ``silu_mul``.

Each rounds as the torch ops it replaces: a 16-bit model's sum, normed row, product with the
weight and each rotary product round to its dtype where torch stores them. What may differ is
float32's last bit: the norm's sum of squares in another order, and ``exp`` in SiLU
(``tests/test_triton_rows.py`` bounds both, on CPU through Triton's interpreter and on a GPU).
``KVRELAY_TRITON_ROWS=0`` keeps torch's ops, for comparisons.
"""

from __future__ import annotations

import torch

from kvrelay import envs
from kvrelay.kernels import triton_attention

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SILU_BLOCK = 1024  # columns of a SiLU program


def enabled() -> bool:
    """Triton is installed and ``KVRELAY_TRITON_ROWS`` is on (read when called: an engine asks
    once, when its model is made)."""
    return triton_attention.available() and envs.get("KVRELAY_TRITON_ROWS")


def fits(x: torch.Tensor) -> bool:
    """True when the kernels take tensors like ``x``: a contiguous 2-D CUDA activation (or a
    CPU one under Triton's interpreter, the tests)."""
    return (
        (x.device.type == "cuda" or (x.device.type == "cpu" and triton_attention.interpreted()))
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.is_contiguous()
    )


def supports(x: torch.Tensor) -> bool:
    """``fits(x)`` and ``enabled()``."""
    return fits(x) and enabled()


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (when given), then returns ``rms_norm(x) * weight``
    (``llama.rms_norm``'s rounding)."""
    m, n = x.shape
    if delta is not None and (delta.shape != x.shape or not delta.is_contiguous()):
        raise ValueError(f"delta {tuple(delta.shape)} does not match x {tuple(x.shape)}")
    if weight.shape != (n,) or not weight.is_contiguous():
        raise ValueError(f"weight {tuple(weight.shape)} does not fit rows of {n}")
    h = torch.empty_like(x)
    if m:
        triton_attention._kernels().add_rms_norm_kernel[(m,)](
            x, x if delta is None else delta, weight, h, n, eps,
            HAS_DELTA=delta is not None, BLOCK=_pow2(n), num_warps=4 if n <= 2048 else 8,
        )  # fmt: skip
    return h


def rope_(
    qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates the first ``heads`` heads of each row of ``qkv [T, width]`` in place
    (``llama.apply_rope``); ``cos`` and ``sin`` hold ``head_dim / 2`` values per row."""
    m, width = qkv.shape
    half = head_dim // 2
    if heads * head_dim > width or head_dim % 2:
        raise ValueError(f"{heads} heads of {head_dim} do not fit rows of {width}")
    if cos.numel() != m * half or sin.numel() != m * half:
        raise ValueError(f"cos/sin hold {cos.numel()}/{sin.numel()} values, not {m} x {half}")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos and sin must be contiguous")
    if m:
        triton_attention._kernels().rope_kernel[(m,)](
            qkv, cos, sin, width, heads, HALF=half, HEADS_PAD=_pow2(heads), HALF_PAD=_pow2(half),
        )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * n]`` (gate first), as ``[T, n]``."""
    m, width = gate_up.shape
    n = width // 2
    out = torch.empty(m, n, dtype=gate_up.dtype, device=gate_up.device)
    if m:
        block = min(SILU_BLOCK, _pow2(n))
        triton_attention._kernels().silu_mul_kernel[(m, -(-n // block))](
            gate_up, out, n, BLOCK=block
        )
    return out
