"""The Triton kernels of ``triton_attention`` (which launches them and documents them).

A module of their own so that importing the attention code does not import Triton (~0.4 s
of every CPU worker's start): ``triton_attention`` imports this on the first launch.
"""

from __future__ import annotations

import triton
import triton.language as tl


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
def decode_kernel(
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
def prefill_kernel(
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
def combine_kernel(
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
def store_kernel(
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


# A decoder layer's small ops on a GPU (``triton_rows``), torch's roundings: a 16-bit model's
# products and sums round to its dtype where torch's separate ops would store them.
@triton.jit
def _rounded(x, dt: tl.constexpr):
    """float32 ``x`` rounded to ``dt`` (to nearest, ties to even) and kept as float32, by its
    bits: the same on a GPU and in Triton's interpreter (whose bfloat16 cast truncates), and no
    compiler pass can drop it (a float16 cast and widening back were, on an H200). float16
    values under 2^-14 (its subnormals) are rounded again by the store's cast."""
    if dt == tl.bfloat16:
        u = x.to(tl.uint32, bitcast=True)
        return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif dt == tl.float16:
        u = x.to(tl.uint32, bitcast=True)
        return ((u + 0xFFF + ((u >> 13) & 1)) & 0xFFFFE000).to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def add_rms_norm_kernel(
    x_ptr, d_ptr, w_ptr, h_ptr, n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(d_ptr + row * n + cols, mask=ok, other=0.0)
        xf = _rounded(x.to(tl.float32) + d.to(tl.float32), dt)
        tl.store(x_ptr + row * n + cols, xf.to(dt), mask=ok)
    else:
        xf = x.to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = _rounded(xf * r, dt)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * n + cols, _rounded(normed * w, dt).to(dt), mask=ok)


@triton.jit
def rope_kernel(
    qkv_ptr, cos_ptr, sin_ptr, width, heads, HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    c = tl.arange(0, HALF_PAD)[None, :]
    ok = (h < heads) & (c < HALF)
    dt = qkv_ptr.dtype.element_ty
    first = qkv_ptr + t * width + h * (2 * HALF) + c
    x1 = tl.load(first, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=ok, other=0.0).to(tl.float32)
    cs = tl.load(cos_ptr + t * HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + t * HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    # each product rounded on its own (no fused multiply-add), as torch's separate ops
    a, b = _rounded(x1 * cs, dt), _rounded(x2 * sn, dt)
    e, f = _rounded(x2 * cs, dt), _rounded(x1 * sn, dt)
    tl.store(first, _rounded(a - b, dt).to(dt), mask=ok)
    tl.store(first + HALF, _rounded(e + f, dt).to(dt), mask=ok)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    dt = out_ptr.dtype.element_ty
    g = tl.load(gate_up_ptr + row * 2 * n + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * 2 * n + n + cols, mask=ok, other=0.0).to(tl.float32)
    s = _rounded(g / (1.0 + tl.exp(-g)), dt)
    tl.store(out_ptr + row * n + cols, _rounded(s * u, dt).to(dt), mask=ok)
