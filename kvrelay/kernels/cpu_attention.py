"""Paged attention on CPU in kvrelay's native library (``csrc/attention.c``).

The torch path (``attention.paged_attention``) gathers each decode group's context blocks
into a padded copy and runs one masked SDPA per group: on a batched CPU decode step the copy
and the padding were most of attention's time (BENCHMARKS.md, engine step profile). The
native kernel reads keys and values in place from the block pool, one query row per token,
split by (row, kv head) over the engine's thread pool (the one the native matmuls use), with
an online softmax in float32. Decode tokens are a row each; so are the tokens of a prefill
segment of up to ``prefill_limit`` tokens, each attending over the keys up to its own position
through its sequence's table (``NativeDecode.row_table``); with a bfloat16 pool on AVX512-BF16
the library takes a segment's consecutive rows in blocks (up to 48 query vectors against each
key at once), and on the AVX2 path likewise (24). The runner builds a
``NativeDecode`` instead of decode groups when ``supports`` is true; results equal the torch
path's up to float32 summation order (bfloat16 scores: BF16 dot products, exact products
summed in float32, on CPUs with AVX512-BF16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvrelay import envs
from kvrelay.kernels import gemv

MAX_HEAD_DIM = 256  # csrc/attention.c
MAX_Q_PER_KV = 16
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ISA_AVX2 = 1  # csrc/attention.c: the 8-lane path (prefill segments in blocks)
ISA_AVX512 = 2  # csrc/attention.c: the 16-lane path (bfloat16: BF16 dot products)
TABLE_COLUMNS = 16  # block tables are padded to a multiple of this many columns
# CPU prefill segments of up to this many tokens attend in the kernel (a row per token, each
# over the keys up to its position) rather than in SDPA, one call for the step instead of one
# SDPA (~0.3 ms of overhead) per segment. Measured against SDPA (BENCHMARKS.md, "CPU
# attention"): float32 0.3-0.8x its time at 16-512 tokens, 1.07x at 1,024; a bfloat16 pool
# on AVX512-BF16, whose segments go in blocks of consecutive tokens (csrc/attention.c,
# attend_block_bf16), 0.13-0.31x at 16-2,048 tokens, 0.38x at 4,096 and 0.53x at 8,192; the
# AVX2 path's blocks (attend_block_avx2, float32 or a widened bfloat16 pool) 0.17-0.5x at
# 16-512 tokens, 0.6-0.77x at 1,024, 0.72-0.88x at 2,048, 0.9-1.1x at 4,096.
MAX_PREFILL_TOKENS = 512
MAX_PREFILL_TOKENS_BF16_DOT = 8192
MAX_PREFILL_TOKENS_AVX2 = 2048


def prefill_limit(kv: torch.Tensor) -> int:
    """Tokens of the longest prefill segment the kernel takes for the pool ``kv``."""
    library = gemv.load_library()
    if library is None:
        return 0
    isa = library.attention_isa(_DTYPES[kv.dtype], kv.shape[-1])
    if kv.dtype == torch.bfloat16 and isa == ISA_AVX512:
        return MAX_PREFILL_TOKENS_BF16_DOT
    return MAX_PREFILL_TOKENS_AVX2 if isa == ISA_AVX2 else MAX_PREFILL_TOKENS


@dataclass(slots=True)
class NativeDecode:
    """A step's decode tokens for the native kernel: one row of each per sequence."""

    rows: torch.Tensor  # [n] int64: the token's row in the flat batch
    tables: torch.Tensor  # [s, max_blocks] int32 block tables, padded with block 0
    ctx_lens: torch.Tensor  # [n] int32: keys each token attends over, its own included
    # [n] int32: each token's row of ``tables`` (a prefill segment's tokens share their
    # sequence's); None: token i's is row i (decode tokens only; the GPU kernel's case)
    row_table: torch.Tensor | None = None


def supports(kv: torch.Tensor, q_heads: int) -> bool:
    """True when decode attention over the pool ``kv`` (one layer's or all) runs natively."""
    head_dim, kv_heads = kv.shape[-1], kv.shape[-2]
    return (
        kv.device.type == "cpu"
        and kv.dtype in _DTYPES
        and head_dim <= MAX_HEAD_DIM
        and q_heads % kv_heads == 0
        and q_heads // kv_heads <= MAX_Q_PER_KV
        and bool(envs.get("KVRELAY_NATIVE_ATTENTION"))
        and gemv.available()
    )


def table_width(blocks: int) -> int:
    """Columns of a padded block table that holds ``blocks`` entries: a multiple of
    ``TABLE_COLUMNS``.

    On a GPU the table's row stride is an integer argument of the Triton kernel, and Triton
    compiles one variant per class of an integer argument (1, a multiple of 16, any other): a
    width that followed the step's longest sequence compiled new variants while serving (0.5
    to 1.4 s each, every running sequence stalled, on an H100). One class keeps the variants
    the warm-up compiled."""
    return max(1, -(-blocks // TABLE_COLUMNS)) * TABLE_COLUMNS


def make_decode(
    rows: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    row_table: list[int] | None = None,
) -> NativeDecode:
    """The kernel's inputs from each token's row, context length and block table (``tables[i]``,
    or ``tables[row_table[i]]`` when given: the tokens of a prefill segment share one)."""
    width = table_width(max(len(t) for t in tables))
    padded = [t + [0] * (width - len(t)) for t in tables]  # one tensor made, not one a row
    return NativeDecode(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(ctx_lens, dtype=torch.int32),
        None if row_table is None else torch.tensor(row_table, dtype=torch.int32),
    )


def decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: NativeDecode,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Writes ``out[batch.rows]``: each decode query ``q[row]`` attended over its sequence's
    keys and values in ``kv`` (one layer's pool ``[2, num_blocks, block_size, kv_heads,
    head_dim]``), the last ``window`` of them when a sliding window is set."""
    library = gemv.load_library()
    if library is None:
        raise RuntimeError("native attention called without the compiled library")
    _, _, block_size, kv_heads, head_dim = kv.shape
    row_table = batch.row_table
    code = library.paged_attention_rows(
        _DTYPES[kv.dtype],
        batch.rows.numel(),
        q.shape[1],
        kv_heads,
        head_dim,
        block_size,
        batch.tables.shape[1],
        window or 0,
        scale,
        q.data_ptr(),
        kv[0].data_ptr(),
        kv[1].data_ptr(),
        batch.rows.data_ptr(),
        batch.tables.data_ptr(),
        batch.ctx_lens.data_ptr(),
        None if row_table is None else row_table.data_ptr(),
        out.data_ptr(),
    )
    if code != 0:
        shapes = f"q {tuple(q.shape)}, kv {tuple(kv.shape)}"
        raise RuntimeError(f"native decode attention refused {shapes}")
