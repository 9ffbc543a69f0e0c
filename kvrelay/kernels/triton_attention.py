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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvrelay.kernels.cpu_attention import NativeDecode, table_width

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch's CUDA builds and xgrammar
    triton = None
    tl = None

MAX_SPLITS = 16  # a power of two: the combining kernel reads a split's partials as one tile
NO_WINDOW = 1 << 30  # the window argument when there is none: every key is in it
# query rows (tokens x the query heads of a kv head) of a prefill program: the M side of the
# tensor cores' products, as in flash attention's 128-row tiles
PREFILL_ROWS = 128


def available() -> bool:
    return triton is not None


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
    _decode_kernel[grid](
        out, q, kv[0], kv[1], tables, batch.ctx_lens, batch.rows, part_acc, part_ml,
        scale, window or NO_WINDOW,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), tables.stride(0),
        kv.stride(1), kv.stride(2),
        **common, num_warps=4,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(n, q_heads)](
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
    _prefill_kernel[(n, kv_heads)](
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
    _store_kernel[(t,)](
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
    return available() and bool(triton.knobs.runtime.interpret)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type != "cuda" and not interpreted():
        raise ValueError(
            f"the Triton kernels need CUDA tensors (got {t.device}), or TRITON_INTERPRET=1 "
            "set before triton is imported"
        )


if triton is not None:

    @triton.jit
    def _key_scores(
        q, k_ptr, table, t, t_ok, head_off, d_ok, scale, stride_block, stride_token,
        BLOCK_SIZE: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        """A tile of keys ``t`` (``t_ok``: the ones that exist) read through the block table:
        their pool offsets, the K/V mask, and the queries' scores against them."""
        block = tl.load(table + t // BLOCK_SIZE, mask=t_ok, other=0).to(tl.int64)
        offs = block * stride_block + (t % BLOCK_SIZE) * stride_token
        kv_mask = t_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + offs[:, None] + head_off[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        return s, offs, kv_mask

    @triton.jit
    def _online_step(s, v_ptr, offs, head_off, kv_mask, m_i, l_i, acc, DOT_F32: tl.constexpr):
        """One key tile's step of the online softmax: the masked scores ``s`` rescale the
        running max, sum and output, and their values are added. A row with no key yet (a
        window's start, a padding row) keeps a max of -inf: 0 is subtracted then, so exp()
        gives 0 rather than NaN."""
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_sub[:, None])
        alpha = tl.exp(m_i - m_sub)
        v = tl.load(v_ptr + offs[:, None] + head_off[None, :], mask=kv_mask, other=0.0)
        if DOT_F32:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:  # probabilities rounded to the cache's 16-bit type, as flash attention does
            pv = tl.dot(p.to(v.dtype), v)
        return m_new, l_i * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv

    @triton.jit
    def _decode_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, ctx_lens_ptr, rows_ptr, acc_ptr, ml_ptr,
        scale, window,
        stride_q_row, stride_q_head, stride_o_row, stride_o_head, stride_table,
        stride_block, stride_token,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        Q_PER_KV: tl.constexpr, QG: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
        DOT_F32: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        row = tl.load(rows_ptr + seq).to(tl.int64)
        ctx = tl.load(ctx_lens_ptr + seq)
        first = tl.maximum(ctx - window, 0)
        # this split's keys: whole tiles from the window's first tile on
        base = (first // BLOCK_N) * BLOCK_N
        tiles = (ctx - base + BLOCK_N - 1) // BLOCK_N
        per_split = (tiles + SPLITS - 1) // SPLITS
        lo = base + split * per_split * BLOCK_N
        hi = tl.minimum(lo + per_split * BLOCK_N, ctx)

        g = tl.arange(0, QG)
        d = tl.arange(0, HEAD_DIM_PAD)
        g_ok = g < Q_PER_KV
        d_ok = d < HEAD_DIM
        heads = kv_head * Q_PER_KV + g
        q = tl.load(
            q_ptr + row * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)

        m_i = tl.full([QG], float("-inf"), tl.float32)
        l_i = tl.zeros([QG], tl.float32)
        acc = tl.zeros([QG, HEAD_DIM_PAD], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_table
        head_off = kv_head * HEAD_DIM + d
        for start in range(lo, hi, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = (t < hi) & (t >= first)
            s, offs, kv_mask = _key_scores(
                q, k_ptr, table, t, t_ok, head_off, d_ok, scale, stride_block, stride_token,
                BLOCK_SIZE, DOT_F32,
            )  # fmt: skip
            s = tl.where(t_ok[None, :], s, float("-inf"))  # [QG, BLOCK_N]
            m_i, l_i, acc = _online_step(s, v_ptr, offs, head_off, kv_mask, m_i, l_i, acc, DOT_F32)

        if SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            o_ptr = out_ptr + row * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
            tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
        else:
            part = (seq.to(tl.int64) * Q_PER_KV * tl.num_programs(1) + heads) * SPLITS + split
            tl.store(acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :], acc, mask=g_ok[:, None])
            # an empty split's max is -inf: stored finite, so the combine's exp() stays a number
            tl.store(ml_ptr + part * 2, tl.where(l_i > 0, m_i, -1e30), mask=g_ok)
            tl.store(ml_ptr + part * 2 + 1, l_i, mask=g_ok)

    # q is a view of the rotary's output, whose row stride the warm-up's q need not share:
    # unspecialised, it cannot pick a second variant (a q row is read once a program)
    @triton.jit(do_not_specialize=["stride_q_row"])
    def _prefill_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, tables_ptr, tiles_ptr, scale, window,
        stride_q_row, stride_q_head, stride_o_row, stride_o_head, stride_table,
        stride_block, stride_token,
        BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
        Q_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        WINDOWED: tl.constexpr, DOT_F32: tl.constexpr,
    ):  # fmt: skip
        tile = tl.program_id(0)
        kv_head = tl.program_id(1)
        first_row = tl.load(tiles_ptr + tile * 4)
        num_rows = tl.load(tiles_ptr + tile * 4 + 1)
        first_pos = tl.load(tiles_ptr + tile * 4 + 2)
        table = tables_ptr + tl.load(tiles_ptr + tile * 4 + 3).to(tl.int64) * stride_table

        # row r of the tile: token r // Q_PER_KV, query head r % Q_PER_KV of this kv head
        r = tl.arange(0, BLOCK_M)
        token = r // Q_PER_KV
        r_ok = token < num_rows
        q_pos = first_pos + token
        row = (first_row + token).to(tl.int64)
        heads = kv_head * Q_PER_KV + r % Q_PER_KV
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_mask = r_ok[:, None] & d_ok[None, :]
        q = tl.load(
            q_ptr + row[:, None] * stride_q_row + heads[:, None] * stride_q_head + d[None, :],
            mask=q_mask,
            other=0.0,
        )
        if DOT_F32:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        head_off = kv_head * HEAD_DIM + d
        end = first_pos + num_rows  # keys 0..end-1: the tile's last token's context
        # whole key tiles before the tile's first position are visible to every row (causal
        # needs no mask there); tiles from ``diagonal`` on hold the triangle
        diagonal = (first_pos // BLOCK_N) * BLOCK_N
        lo = 0
        if WINDOWED:
            lo = (tl.maximum(first_pos - window + 1, 0) // BLOCK_N) * BLOCK_N
        for start in range(lo, end, BLOCK_N):
            t = start + tl.arange(0, BLOCK_N)
            t_ok = t < end
            s, offs, kv_mask = _key_scores(
                q, k_ptr, table, t, t_ok, head_off, d_ok, scale, stride_block, stride_token,
                BLOCK_SIZE, DOT_F32,
            )  # fmt: skip
            if start >= diagonal:  # [BLOCK_M, BLOCK_N]
                s = tl.where(t[None, :] <= q_pos[:, None], s, float("-inf"))
            if WINDOWED:
                s = tl.where(t[None, :] > q_pos[:, None] - window, s, float("-inf"))
            m_i, l_i, acc = _online_step(s, v_ptr, offs, head_off, kv_mask, m_i, l_i, acc, DOT_F32)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptr = out_ptr + row[:, None] * stride_o_row + heads[:, None] * stride_o_head + d[None, :]
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=q_mask)

    @triton.jit
    def _combine_kernel(
        out_ptr, rows_ptr, acc_ptr, ml_ptr, stride_o_row, stride_o_head,
        HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, SPLITS: tl.constexpr,
    ):  # fmt: skip
        seq = tl.program_id(0)
        head = tl.program_id(1)
        row = tl.load(rows_ptr + seq).to(tl.int64)
        part = (seq.to(tl.int64) * tl.num_programs(1) + head) * SPLITS + tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + part * 2)
        l_s = tl.load(ml_ptr + part * 2 + 1)
        m_max = tl.max(m, axis=0)
        w = tl.where(l_s > 0, tl.exp(m - m_max), 0.0)  # an empty split has l = 0
        total = tl.sum(l_s * w, axis=0)
        d = tl.arange(0, HEAD_DIM_PAD)
        acc = tl.load(acc_ptr + part[:, None] * HEAD_DIM_PAD + d[None, :])
        o = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
        o_ptr = out_ptr + row * stride_o_row + head * stride_o_head + d
        tl.store(o_ptr, o.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)

    @triton.jit
    def _store_kernel(
        k_pool, v_pool, k_ptr, v_ptr, slots_ptr, stride_k_row, stride_k_head, stride_v_row,
        stride_v_head, HEAD_DIM: tl.constexpr, ROW: tl.constexpr, ROW_PAD: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + t).to(tl.int64)
        if slot >= 0:
            i = tl.arange(0, ROW_PAD)
            ok = i < ROW
            head, dim = i // HEAD_DIM, i % HEAD_DIM
            k = tl.load(k_ptr + t * stride_k_row + head * stride_k_head + dim, mask=ok)
            v = tl.load(v_ptr + t * stride_v_row + head * stride_v_head + dim, mask=ok)
            tl.store(k_pool + slot * ROW + i, k, mask=ok)
            tl.store(v_pool + slot * ROW + i, v, mask=ok)
