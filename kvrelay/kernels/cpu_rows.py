"""A decoder layer's small ops for batched CPU steps, in the native library (``csrc/rows.c``).

A batched step (prefill, or more decode rows than the fused path takes) runs its matmuls in
MKL / oneDNN and its attention natively, but around them each layer did ~20 torch ops: the
RMSNorms (six ops each on CPU, two dtype conversions more for bfloat16), the rotary embedding
(slices, four products, a sum, a difference, a concatenation), SiLU and the product, and the
residual adds. Each costs ~25 us of dispatch and thread start at 64 rows of 576 values. Here
each group is one call into the library: ``add_rms_norm`` (residual add fused into the next
norm), ``rope_`` and ``silu_mul``, with the row math and bfloat16 rounding of ``csrc/decode.c``
(``csrc/rowops.h``). ``supports`` says when they apply: CPU, float32 / bfloat16, contiguous
rows, and the library built and enabled (``KVRELAY_NATIVE_MATMUL``); callers fall back to
torch otherwise.
"""

from __future__ import annotations

import torch

from kvrelay.kernels import gemv  # its load_library sets the rows_* signatures

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def supports(x: torch.Tensor) -> bool:
    """True when the native row ops take tensors like ``x`` (a 2-D activation)."""
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.dim() == 2
        and x.is_contiguous()
        and gemv.load_library() is not None
    )


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"native {what} failed ({code})")


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x += delta`` in place (when given), then returns ``rms_norm(x) * weight``
    (``llama.rms_norm``'s rounding)."""
    library = gemv.load_library()
    assert library is not None and weight.dtype == x.dtype and weight.is_contiguous()
    if delta is not None:
        assert delta.shape == x.shape and delta.dtype == x.dtype and delta.is_contiguous()
    m, n = x.shape
    h = torch.empty_like(x)
    code = library.rows_add_rms_norm(
        _DTYPES[x.dtype], m, n, eps, x.data_ptr(),
        None if delta is None else delta.data_ptr(), weight.data_ptr(), h.data_ptr(),
    )  # fmt: skip
    _check(code, "add_rms_norm")
    return h


def rope_(
    qkv: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotates the first ``heads`` heads of each row of ``qkv [T, width]`` in place
    (``llama.apply_rope``); ``cos`` and ``sin`` hold ``head_dim / 2`` values per row."""
    library = gemv.load_library()
    assert library is not None and qkv.is_contiguous()
    assert cos.dtype == sin.dtype == qkv.dtype and cos.is_contiguous() and sin.is_contiguous()
    m, width = qkv.shape
    assert cos.numel() == sin.numel() == m * (head_dim // 2)
    code = library.rows_rope(
        _DTYPES[qkv.dtype], m, heads, head_dim, width, qkv.data_ptr(), cos.data_ptr(),
        sin.data_ptr(),
    )  # fmt: skip
    _check(code, "rope")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up [T, 2 * n]`` (gate first), as ``[T, n]``."""
    library = gemv.load_library()
    assert library is not None and gate_up.is_contiguous()
    m, width = gate_up.shape
    out = torch.empty(m, width // 2, dtype=gate_up.dtype)
    _check(
        library.rows_silu_mul(
            _DTYPES[gate_up.dtype], m, width // 2, gate_up.data_ptr(), out.data_ptr()
        ),
        "silu_mul",
    )
    return out
