"""Weights copied into panels of 16 columns for CPU steps of many rows (``csrc/panels.c``).

The packed copy ``kernels.cpu_packed`` keeps for batched decode steps and prefill, on CPUs
where it beats oneDNN's blocked copy: AVX2 or AVX-512 where bfloat16 is no faster than
float32 (``preferred``; on AVX-512 a register tile spans two panels). On AVX2 a batched
decode step's products wait on memory in oneDNN's kernels (21-73 GFLOP/s at 8-64 rows over
SmolLM2's 30 layers, against ~120 in cache); a panel is one sequential stream and each of its
rows feeds a 6 x 16 register tile, 1.3-1.6x faster at 8-64 rows, 1.1x at 256, 0.93x at 2,048
(BENCHMARKS.md, "Packed panels"). The copy is float32 (a bfloat16 model's too: an AVX2 CPU
does not compute bfloat16), as oneDNN's copy is there.
"""

from __future__ import annotations

import dataclasses
import functools
import logging

import torch

from kvrelay import envs
from kvrelay.kernels import gemv

logger = logging.getLogger(__name__)

PANEL = 16  # columns of a panel (csrc/panels.c NR)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@dataclasses.dataclass(frozen=True, slots=True)
class Panels:
    """A weight's panels: ``data`` [ceil(n / 16), k, 16] float32, columns past ``n`` zero."""

    data: torch.Tensor
    k: int
    n: int

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def shape(self) -> torch.Size:
        """``[out, in]``, as oneDNN's packed copy of the same weight."""
        return torch.Size((self.n, self.k))


@functools.cache
def preferred() -> bool:
    """The native library is built and this CPU is one where panels beat oneDNN (AVX2 and
    FMA, AVX-512 or not, and bfloat16 no faster than float32: no AMX, and AVX512-BF16's dot
    products, where there, under 1.25x the flops of float32 multiply-adds, timed once;
    csrc/panels.c ``panels_preferred``). Logged with the ratio."""
    library = gemv.load_library()
    if library is None:
        return False
    chosen = bool(library.panels_preferred())
    ratio = library.panels_bf16_dot_ratio()
    dots = f"AVX512-BF16 dot products at {ratio:.2f}x float32 multiply-adds' flops"
    logger.info(
        "packed copies' kernel on this CPU: %s (%s)",
        "kvrelay's panels" if chosen else "oneDNN",
        dots if ratio else "no AVX512-BF16",
    )
    return chosen


def available() -> bool:
    """The native library is built (panels can be made and used, preferred or not)."""
    return gemv.load_library() is not None


@functools.cache
def chosen() -> bool:
    """Panels are the packed copies' kernel here, as ``KVRELAY_CPU_PACKED_KERNEL`` says (auto:
    where ``preferred``). Then the widened bfloat16 products of plain weights run them too
    (``linear_plain``), so a step's sums do not depend on whether the copies exist yet."""
    choice = envs.get("KVRELAY_CPU_PACKED_KERNEL")
    if choice == "panels" and not available():
        logger.warning("KVRELAY_CPU_PACKED_KERNEL=panels: no native library; using oneDNN")
        return False
    return choice == "panels" or (choice == "auto" and preferred())


def copy_bytes(w: torch.Tensor, transposed: bool) -> int:
    """The bytes of ``w``'s panels (float32, the last panel padded to 16 columns)."""
    k, n = w.shape if transposed else (w.shape[1], w.shape[0])
    return -(-n // PANEL) * PANEL * k * 4


def pack(w: torch.Tensor, transposed: bool) -> Panels:
    """The panels of ``w`` (float32 or bfloat16; ``transposed``: stored ``[in, out]``, else
    ``[out, in]``, as a tied embedding serving as the LM head)."""
    library = gemv.load_library()
    if library is None:
        raise RuntimeError("panels need kvrelay's native library")
    if w.dtype not in _DTYPES or w.device.type != "cpu":
        raise ValueError(f"panels take float32/bfloat16 CPU weights, got {w.dtype} {w.device}")
    w = w.contiguous()
    k, n = w.shape if transposed else (w.shape[1], w.shape[0])
    data = torch.empty(-(-n // PANEL), k, PANEL, dtype=torch.float32)
    library.panels_pack(k, n, w.data_ptr(), _DTYPES[w.dtype], int(transposed), data.data_ptr())
    return Panels(data, k, n)


def linear(x: torch.Tensor, panels: Panels, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + bias`` in float32 ([m, k] -> [m, n]): every row's sums in k order, whatever
    the other rows of the step."""
    if x.dim() != 2 or x.shape[1] != panels.k:
        raise ValueError(f"x {tuple(x.shape)} does not fit panels of k={panels.k}")
    return _product("panels_gemm", x, panels.n, bias, panels.data.data_ptr())


def linear_plain(
    x: torch.Tensor, w: torch.Tensor, transposed: bool, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear`` on the plain weight ``w`` (float32 or bfloat16, ``transposed`` as ``pack``
    takes it), each panel made as it is reached: bit for bit ``linear(x, pack(w, ...))``."""
    if w.dtype not in _DTYPES or w.device.type != "cpu":
        raise ValueError(f"panels take float32/bfloat16 CPU weights, got {w.dtype} {w.device}")
    w = w.contiguous()
    k, n = w.shape if transposed else (w.shape[1], w.shape[0])
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x {tuple(x.shape)} does not fit a weight of k={k}")
    return _product("panels_gemm_plain", x, n, bias, w.data_ptr(), _DTYPES[w.dtype], transposed)


def _product(
    name: str, x: torch.Tensor, n: int, bias: torch.Tensor | None, *w: int
) -> torch.Tensor:
    library = gemv.load_library()
    assert library is not None
    x = x.to(torch.float32).contiguous()
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32)
    if m == 0:
        return y
    b = None if bias is None else bias.to(torch.float32).contiguous()
    code = getattr(library, name)(
        m, k, n, x.data_ptr(), *w, None if b is None else b.data_ptr(), y.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if code != 0:
        raise RuntimeError(f"{name} failed ({code}) on x {tuple(x.shape)}")
    return y
