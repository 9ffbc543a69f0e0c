"""Paged decode and prefill attention and the KV store on a GPU, in Triton.

The torch path (``attention.paged_attention``) gathers every decode group's context blocks
into a padded copy and runs one masked SDPA per group: on a GPU that is an extra write and
read of the whole context per layer, a Python loop over groups, and shapes that change with
every step (so no CUDA graph can hold it). This kernel reads keys and values in place from
the block pool through each sequence's block table, one query token per sequence, with the
same inputs as the CPU kernel (``cpu_attention.NativeDecode``: rows, padded tables, context
lengths), so one step's metadata serves both devices.

One program per (sequence, kv head, split) takes that kv head's ``q_per_kv`` query heads as
one tile of at least 16 rows (grouped-query attention reads each key once, and both products
are ``tl.dot`` on the tensor cores; a float32 cache multiplies in IEEE float32, not TF32) and
walks its span of keys in tiles of ``BLOCK_N`` (token -> block id from the table -> slot)
with an online softmax in float32.
Splits (flash-decoding) give a few long sequences enough programs to fill the GPU's
multiprocessors: each split writes an unnormalised partial output with its max and sum, and
a second kernel combines them. The number of splits depends only on the batch's shape, not
its context lengths, so a CUDA graph captured for a batch size stays valid.

Prefill segments (prompt chunks) went through the torch path too: per segment a gather of its
context blocks and one SDPA, with per-segment metadata copied to the device. A SmolLM2-135M
mixed step on an H200 (8 segments beside 32 decodes) made 240 SDPA calls (~42 us of CPU each),
134 small host-to-device copies and 584 launches, 16-18 ms against 5.7 ms of GPU work.
``prefill`` takes all of a layer's segments in one launch, in place over the pool like the
decode kernel: the step's K/V are stored first, so a segment from position 0 and a chunk in
the middle of a prompt are the same case. A program takes one query tile (up to
``prefill_tile_tokens`` consecutive tokens of one segment, times the query heads of one kv
head: ``PREFILL_ROWS`` rows of the tensor cores' products) and walks the keys up to the
tile's last position, unmasked before the tile's first position and causally masked in the
diagonal key tiles, with the same online softmax. Its metadata is two int32 tensors a step
(``PrefillBatch``); every integer argument is fixed for a model and pool, so the grid is the
only thing that follows the step and serving compiles no new variant.

Under ``TRITON_INTERPRET=1`` (set before triton is first imported) the same kernels run on
CPU tensors in Triton's interpreter: that is how a machine without a GPU tests them.

A sequence of context length 0 (a CUDA graph's padding row) reads nothing and writes zeros;
``store_kv`` skips a slot < 0 (the same padding's K/V). Exact against the torch reference up
to float32 summation order (``tests/test_triton_attention.py``, on CPU through the
interpreter and on a GPU where one is present).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType

import torch

from kvrelay.kernels.cpu_attention import NativeDecode, table_width

MAX_SPLITS = 16  # a power of two: the combining kernel reads a split's partials as one tile
NO_WINDOW = 1 << 30  # the window argument when there is none: every key is in it
# query rows (tokens x the query heads of a kv head) of a prefill program: the M side of the
# tensor cores' products, as in flash attention's 128-row tiles
PREFILL_ROWS = 128


def available() -> bool:
    """Triton is installed (it ships with torch's CUDA builds and with xgrammar); it is imported
    on the first launch (``_kernels``), not with this module."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernels() -> ModuleType:
    from kvrelay.kernels import triton_kernels

    return triton_kernels


def supports(kv: torch.Tensor, q_heads: int) -> bool:
    """True when decode attention over the pool ``kv`` runs in this kernel (a CUDA pool)."""
    kv_heads = kv.shape[-2]
    return (
        available()
        and kv.device.type == "cuda"
        and kv.is_contiguous()
        and kv.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and q_heads % kv_heads == 0
    )


@functools.lru_cache(maxsize=8)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_splits(num_seqs: int, kv_heads: int, device: torch.device) -> int:
    """Splits per (sequence, kv head), a power of two: about two programs per multiprocessor."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else 0)
    want = 2 * sms // (num_seqs * kv_heads)
    return max(1, min(MAX_SPLITS, 1 << (want.bit_length() - 1) if want > 0 else 1))


def _pow2(n: int, least: int = 2) -> int:
    return max(least, 1 << (n - 1).bit_length())


@dataclass(slots=True)
class PrefillBatch:
    """A step's prefill segments cut into query tiles, for ``prefill``: one launch a layer.

    A tile is up to ``tile_tokens`` consecutive tokens of one segment; its program takes them
    times the ``q_per_kv`` query heads of one kv head. Built once a step in Python lists and
    turned into two tensors (``make_prefill``), moved to the device with the step's metadata.
    """

    tiles: torch.Tensor  # [n, 4] int32: first row in the flat batch, rows, first position, table
    tables: torch.Tensor  # [s, width] int32 block tables, padded with block 0 (``table_width``)
    tile_tokens: int  # the most tokens in a tile (``prefill_tile_tokens``)


def prefill_tile_tokens(q_per_kv: int) -> int:
    """Tokens in a full prefill tile: as many as fill the kernel's ``PREFILL_ROWS`` query rows
    with all ``q_per_kv`` heads of a kv head (42 tokens for SmolLM2's 3 heads a kv head)."""
    return max(1, PREFILL_ROWS // q_per_kv)


def make_prefill(
    segments: Sequence[tuple[int, int, int, list[int]]], tile_tokens: int
) -> PrefillBatch:
    """The kernel's inputs for segments ``(row, start, tokens, table)``: ``tokens`` query rows
    from ``row`` of the flat batch at positions from ``start`` of the sequence whose block
    table is ``table`` (at least ``ceil((start + tokens) / block_size)`` long)."""
    tiles: list[list[int]] = []
    for i, (row, start, n, _) in enumerate(segments):
        for first in range(0, n, tile_tokens):
            tiles.append([row + first, min(tile_tokens, n - first), start + first, i])
    width = table_width(max(len(seg[3]) for seg in segments))
    padded = [seg[3] + [0] * (width - len(seg[3])) for seg in segments]
    return PrefillBatch(
        torch.tensor(tiles, dtype=torch.int32).view(-1, 4),
        torch.tensor(padded, dtype=torch.int32),
        tile_tokens,
    )


def prefill_to(batch: PrefillBatch, device: torch.device) -> PrefillBatch:
    return PrefillBatch(
        batch.tiles.to(device, non_blocking=True),
        batch.tables.to(device, non_blocking=True),
        batch.tile_tokens,
    )


def decode(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: NativeDecode,
    window: int | None,
    scale: float,
    out: torch.Tensor,
    splits: int | None = None,
) -> None:
    """Attention of the decode tokens ``batch.rows`` of ``q [T, q_heads, head_dim]`` over one
    layer's pool ``kv [2, num_blocks, block_size, kv_heads, head_dim]``, into those rows of
    ``out [T, q_heads, head_dim]``. ``splits`` overrides the split count (tests)."""
    n = batch.rows.numel()
    if n == 0:
        return
    block_size, kv_heads, head_dim = kv.shape[2:]
    q_heads = q.shape[1]
    q_per_kv = q_heads // kv_heads
    # the query heads of a kv head are one tile for the tensor cores' products: at least 16 rows
    qg, d_pad = _pow2(q_per_kv, 16), _pow2(head_dim, 16)
    # tiles of 32-128 keys x 4-8 warps x 2-3 stages timed on an H200 (BENCHMARKS.md): 64 keys
    # and 4 warps were the fastest in the large cases; Triton's default 3 stages kept
    block_n = 64 if d_pad <= 128 else 32
    if splits is None:
        splits = num_splits(n, kv_heads, kv.device)
    if splits & (splits - 1):
        raise ValueError(f"splits must be a power of two, got {splits}")
    tables = batch.tables
    grid = (n, kv_heads, splits)
    common = dict(
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=d_pad,
        Q_PER_KV=q_per_kv,
        QG=qg,
        BLOCK_N=block_n,
        SPLITS=splits,
        # float32 products for a float32 cache (not TF32), and in the interpreter, whose
        # 16-bit products are wrong (Triton 3.9); 16-bit caches take the tensor cores' products
        DOT_F32=q.dtype == torch.float32 or interpreted(),
    )
    if splits == 1:
        part_acc = part_ml = out  # unused: the kernel normalises and writes ``out`` itself
    else:
        part_acc = torch.empty(n, q_heads, splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n, q_heads, splits, 2, dtype=torch.float32, device=q.device)
    _check_device(q)
    _kernels().decode_kernel[grid](
        out, q, kv[0], kv[1], tables, batch.ctx_lens, batch.rows, part_acc, part_ml,
        scale, window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        kv.stride(1), kv.stride(2),
        **common, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _kernels().combine_kernel[(n, q_heads)](
            out, batch.rows, part_acc, part_ml, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, SPLITS=splits,
        )  # fmt: skip


def prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    batch: PrefillBatch,
    window: int | None,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal attention of a step's prefill segments (``batch``, rows of ``q [T, q_heads,
    head_dim]``) over one layer's pool ``kv [2, num_blocks, block_size, kv_heads, head_dim]``,
    into those rows of ``out``: one launch for all segments. The segments' own K/V must be in
    the pool already (``store_kv``): a query at position p attends to keys 0..p (the last
    ``window`` of them with a sliding window), whether its segment starts at 0 or mid-prompt."""
    n = batch.tiles.shape[0]
    if n == 0:
        return
    block_size, kv_heads, head_dim = kv.shape[2:]
    q_per_kv = q.shape[1] // kv_heads
    if batch.tile_tokens * q_per_kv > max(PREFILL_ROWS, q_per_kv):
        raise ValueError(
            f"tiles of {batch.tile_tokens} tokens x {q_per_kv} heads exceed {PREFILL_ROWS} rows"
        )
    d_pad = _pow2(head_dim, 16)
    block_m = _pow2(max(PREFILL_ROWS, q_per_kv), 16)
    tiles, tables = batch.tiles, batch.tables
    _check_device(q)
    # every integer argument is fixed for a model and pool (strides, the table's width is a
    # multiple of 16): only the grid follows the step, so serving compiles nothing new
    _kernels().prefill_kernel[(n, kv_heads)](
        out, q, kv[0], kv[1], tables, tiles,
        scale, window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        kv.stride(1), kv.stride(2),
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, HEAD_DIM_PAD=d_pad, Q_PER_KV=q_per_kv,
        BLOCK_M=block_m, BLOCK_N=64 if d_pad <= 128 else 32, WINDOWED=window is not None,
        DOT_F32=q.dtype == torch.float32 or interpreted(),
        num_warps=4 if d_pad <= 64 else 8,
    )  # fmt: skip


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes new K/V rows ``[T, kv_heads, head_dim]`` into their slots of one layer's pool
    ``[2, num_blocks, block_size, kv_heads, head_dim]``; rows whose slot is < 0 are skipped."""
    t = slots.numel()
    if t == 0:
        return
    kv_heads, head_dim = k.shape[1], k.shape[2]
    row = kv_heads * head_dim
    _check_device(kv)
    _kernels().store_kernel[(t,)](
        kv[0], kv[1], k, v, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HEAD_DIM=head_dim, ROW=row, ROW_PAD=_pow2(row, 16),
    )  # fmt: skip


def compile_variants(kv: torch.Tensor, q_heads: int, window: int | None) -> None:
    """Compiles the decode kernel for every split count, the store and the prefill kernel,
    before serving.

    The split count is a compile-time constant that an eager step (a mixed step's decode
    rows, a batch larger than the largest CUDA graph) picks from its batch size; a variant
    first met while serving compiles then, stalling every running sequence (0.5-1.4 s a
    variant on an H100). One row of context 0 and slot -1: nothing is read or stored."""
    kv_heads, head_dim = kv.shape[-2], kv.shape[-1]
    device = kv.device
    q = torch.zeros(1, q_heads, head_dim, dtype=kv.dtype, device=device)
    out = torch.empty_like(q)
    batch = NativeDecode(
        torch.zeros(1, dtype=torch.long, device=device),
        torch.zeros(1, table_width(1), dtype=torch.int32, device=device),
        torch.zeros(1, dtype=torch.int32, device=device),
    )
    splits = 1
    while splits <= MAX_SPLITS:
        decode(q, kv, batch, window, head_dim**-0.5, out, splits=splits)
        splits *= 2
    k = torch.zeros(1, kv_heads, head_dim, dtype=kv.dtype, device=device)
    store_kv(kv, k, k, torch.full((1,), -1, dtype=torch.long, device=device))
    # the prefill kernel has one variant for a model and pool: a tile of no rows compiles it
    empty = PrefillBatch(
        torch.zeros(1, 4, dtype=torch.int32, device=device),
        batch.tables,
        prefill_tile_tokens(q_heads // kv_heads),
    )
    prefill(q, kv, empty, window, head_dim**-0.5, out)


def interpreted() -> bool:
    """True when this process runs Triton kernels in the interpreter (``TRITON_INTERPRET=1``)."""
    return available() and bool(_kernels().triton.knobs.runtime.interpret)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"the Triton kernels need CUDA tensors (got {t.device}), or TRITON_INTERPRET=1 "
            "set before triton is imported"
        )
