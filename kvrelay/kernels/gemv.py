"""Skinny CPU matmuls for decode steps: ``x [m, k]`` by a weight, m up to ``MAX_ROWS`` rows.

A decode step multiplies a few rows by every weight once, so its matmuls are bound by the
weights' bytes. MKL runs these shapes on one thread (a core's read bandwidth, ~17 GB/s on
the AVX2 EPYC measured in BENCHMARKS.md), and its bfloat16 path converts whole weights
(a decode step 4-5x slower than float32 on a CPU without AVX512-BF16). The native library
``kvrelay/csrc/gemv.c`` (built at install time, loaded with ctypes, which releases the GIL)
streams each weight once, split between a small pool of threads, converting bfloat16 in
registers::

    matmul(x, w, b)   x @ w + b, w stored [k, n] (kvrelay's transposed projections)
    matmul_nt(x, w)   x @ w.T, w stored [n, k] (a tied embedding as the LM head)

Both fall back to torch for anything the library does not take: more than ``MAX_ROWS`` rows
(prefill, large batches: compute-bound, where MKL is faster), a non-CPU tensor, a dtype
other than float32 / bfloat16, non-contiguous operands, no compiled library, or
``KVRELAY_NATIVE_MATMUL=0``. Results match torch's to float32 rounding (the sums run in
another order); bfloat16 outputs are rounded to nearest even, as torch's are.

On a CPU where oneDNN does not compute bfloat16 (no AVX-512 or AMX: an AVX2 CPU), torch's
bfloat16 GEMMs take a conversion path 8-190x slower than float32's (BENCHMARKS.md, "bfloat16
on a CPU without native BF16"); there the torch fallback multiplies float32 copies of the
operands and rounds the result to bfloat16 (``widens_bfloat16``): the same exact products
and float32 sums as a bfloat16 GEMM's, in another order.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from kvrelay import envs

logger = logging.getLogger(__name__)

LIBRARY_NAME = "_gemv"  # the setuptools Extension kvrelay.kernels._gemv (setup.py)
MAX_ROWS = 8  # rows the library takes; beyond, MKL's blocked GEMM is faster (BENCHMARKS.md)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KN, _NK = 0, 1


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled library next to this module, or None (logged once) if absent or disabled."""
    if not envs.get("KVRELAY_NATIVE_MATMUL"):
        return None
    here = Path(__file__).parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = here / f"{LIBRARY_NAME}{suffix}"
        if path.exists():
            library = ctypes.CDLL(str(path))
            try:
                _declare(library)
            except AttributeError as missing:  # a library built before a function it lacks
                logger.warning(
                    "%s was built from older sources than this kvrelay (%s): rebuild it "
                    "(`pip install -e .`, or reinstall); the native kernels are off",
                    path,
                    missing,
                )
                return None
            library.gemv_set_threads(torch.get_num_threads())
            return library
    logger.warning(
        "%s: no compiled %s library (built by `pip install` with a C compiler); decode-step "
        "matmuls run in torch, slower",
        here,
        LIBRARY_NAME,
    )
    return None


def _declare(library: ctypes.CDLL) -> None:
    """The argument and result types of the library's functions; AttributeError names the
    first one it lacks."""
    library.gemv.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3
    library.gemv.restype = ctypes.c_int
    library.decode_attention.argtypes = (
        [ctypes.c_int] * 8 + [ctypes.c_float] + [ctypes.c_void_p] * 7
    )
    library.decode_attention.restype = ctypes.c_int
    library.paged_attention_rows.argtypes = (
        [ctypes.c_int] * 8 + [ctypes.c_float] + [ctypes.c_void_p] * 8
    )
    library.paged_attention_rows.restype = ctypes.c_int
    library.attention_set_isa.argtypes = [ctypes.c_int]
    library.attention_set_isa.restype = ctypes.c_int
    library.attention_isa.argtypes = [ctypes.c_int, ctypes.c_int]
    library.attention_isa.restype = ctypes.c_int
    ptr, c_int = ctypes.c_void_p, ctypes.c_int  # decode.c, for kernels/cpu_decode.py
    library.decode_forward.argtypes = [ptr, c_int, ptr, ptr, ptr, ptr, ptr, ptr, c_int, ptr]
    library.decode_forward.restype = ctypes.c_int
    c_float = ctypes.c_float  # rows.c, for kernels/cpu_rows.py
    library.rows_add_rms_norm.argtypes = [c_int, c_int, c_int, c_float, ptr, ptr, ptr, ptr]
    library.rows_rope.argtypes = [c_int] * 5 + [ptr] * 3
    library.rows_silu_mul.argtypes = [c_int, c_int, c_int, ptr, ptr]
    for fn in (library.rows_add_rms_norm, library.rows_rope, library.rows_silu_mul):
        fn.restype = c_int
    library.gemv_set_threads.argtypes = [ctypes.c_int]
    library.gemv_set_threads.restype = ctypes.c_int
    library.gemv_use_openmp.argtypes = [ctypes.c_int]
    library.gemv_use_openmp.restype = ctypes.c_int
    library.gemv_allow_avx512.argtypes = [ctypes.c_int]
    library.gemv_allow_avx512.restype = ctypes.c_int
    library.kv_use_avx512_bf16.restype = ctypes.c_int
    library.panels_preferred.restype = c_int  # panels.c, for kernels/cpu_panels.py
    library.panels_bf16_dot_ratio.restype = ctypes.c_double
    library.panels_pack.argtypes = [c_int, c_int, ptr, c_int, c_int, ptr]
    library.panels_pack.restype = None
    library.panels_gemm.argtypes = [c_int] * 3 + [ptr] * 4 + [c_int]
    library.panels_gemm.restype = c_int
    plain = [c_int] * 3 + [ptr] * 2 + [c_int] * 2 + [ptr] * 2 + [c_int]
    library.panels_gemm_plain.argtypes = plain
    library.panels_gemm_plain.restype = c_int
    library.panels_allow_avx512.argtypes = [c_int]
    library.panels_allow_avx512.restype = c_int


def set_threads(threads: int) -> int:
    """Sizes the library's thread pool (the calling thread included); returns the size in
    effect, 0 without the library. The engine sets it to its ``num_threads``."""
    library = load_library()
    return 0 if library is None else library.gemv_set_threads(max(1, threads))


def use_openmp(on: bool) -> bool:
    """Runs the library's jobs on torch's OpenMP threads (True) or its own pool (False);
    returns the mode in effect (False without the library or OpenMP). The engine turns it on
    for steps where torch runs on all threads, so that the two never compete for the cores,
    and off for a lone decode step (csrc/gemv.c says why)."""
    library = load_library()
    return False if library is None else bool(library.gemv_use_openmp(int(on)))


def available() -> bool:
    """True when decode-step matmuls take the native path."""
    return load_library() is not None


def _native(x: torch.Tensor, w: torch.Tensor) -> ctypes.CDLL | None:
    """The library if it takes this product, else None."""
    if (
        x.dim() != 2
        or not 0 < x.shape[0] <= MAX_ROWS
        or x.device.type != "cpu"
        or x.dtype not in _DTYPES
        or w.dtype != x.dtype
        or not x.is_contiguous()
        or not w.is_contiguous()
    ):
        return None
    return load_library()


def _call(
    library: ctypes.CDLL, kind: int, x: torch.Tensor, w: torch.Tensor, n: int
) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    code = library.gemv(kind, _DTYPES[x.dtype], m, k, n, x.data_ptr(), w.data_ptr(), y.data_ptr())
    if code != 0:
        raise RuntimeError(f"native gemv failed ({code}) on x {tuple(x.shape)}, w {tuple(w.shape)}")
    return y


@functools.cache
def widens_bfloat16() -> bool:
    """True where oneDNN does not compute bfloat16 on this CPU, so that torch's bfloat16 GEMMs
    are slow: products of more rows than the library takes run on float32 copies there."""
    return not (
        torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def widened(x: torch.Tensor) -> bool:
    """Whether torch's products with ``x`` (a CPU bfloat16 tensor) are computed on float32
    copies here: where ``widens_bfloat16``, and where the packed copies are kvrelay's panels
    (float32 for a bfloat16 model too), so that a step on the plain weights sums as the
    copies do."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return False
    from kvrelay.kernels import cpu_panels  # it imports this module

    return widens_bfloat16() or cpu_panels.chosen()


def _widened_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, transposed: bool = False
) -> torch.Tensor:
    """``x @ w.T + bias`` (``w`` ``[n, k]``; ``transposed``: ``w`` is ``[k, n]``, ``x @ w``) on
    float32 copies, rounded to ``x``'s dtype, in the kernel the packed copies run
    (``cpu_packed``: panels, or oneDNN's float32 kernel), which gives the same sums on a plain
    weight, so a step's result does not depend on whether the packed copies exist yet (MKL's
    sums, in another order, can flip a bfloat16 rounding)."""
    from kvrelay.kernels import cpu_panels  # it imports this module

    if cpu_panels.chosen():
        return cpu_panels.linear_plain(x, w, transposed, bias).to(x.dtype)
    if transposed:
        w = w.t()
    wide, w = x.float(), w.float().contiguous()
    b = None if bias is None else bias.float()
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._linear_pointwise(wide, w, b, "none", [], "").to(x.dtype)
    return F.linear(wide, w, b).to(x.dtype)


def matmul(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w + bias`` for ``w`` stored ``[k, n]``."""
    library = _native(x, w)
    if library is None or w.shape[0] != x.shape[1]:
        if widened(x):
            return _widened_linear(x, w, bias, transposed=True)
        return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)
    y = _call(library, _KN, x, w, w.shape[1])
    return y if bias is None else y.add_(bias)


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` for ``w`` stored ``[n, k]``."""
    library = _native(x, w)
    if library is None or w.shape[1] != x.shape[1]:
        if widened(x):
            return _widened_linear(x, w, None)
        return F.linear(x, w)
    return _call(library, _NK, x, w, w.shape[0])
