"""Paged attention over a block-structured KV pool: the torch reference used on CPU.

Pool layout per layer: ``kv[2, num_blocks, block_size, kv_heads, head_dim]``; a token at
position ``p`` of a sequence with block table ``bt`` lives in slot ``bt[p // bs] * bs + p % bs``.

A step's tokens are flat (selective batching); only attention is split per sequence:
- prefill segments (a chunk of one sequence's tokens) attend causally to their context;
  a segment that starts at position 0 uses its fresh K/V directly (no gather);
- decode tokens (one per sequence) are batched into one padded, masked SDPA call.
The metadata (slots, masks) is built once per step by the runner and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSegment:
    q_start: int  # first row of the segment in the flat batch
    q_len: int  # rows in the segment
    ctx_slots: torch.Tensor | None  # [ctx_len] slots of every context token; None: start == 0
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass(slots=True)
class DecodeBatch:
    q_index: torch.Tensor  # [B] rows of the decode tokens in the flat batch
    slots: torch.Tensor  # [B, L] context slots, padded with 0
    mask: torch.Tensor  # [B, 1, 1, L] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot where each new token's K/V is written
    prefills: list[PrefillSegment] = field(default_factory=list)
    decode: DecodeBatch | None = None


def store_kv(kv: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Writes new K/V rows ``[T, kv_heads, head_dim]`` into their slots of one layer's pool."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    kv[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def causal_mask(start: int, q_len: int, ctx_len: int, window: int | None) -> torch.Tensor | None:
    """Mask for queries at positions ``start..start+q_len-1`` over keys ``0..ctx_len-1``.

    None when the plain ``is_causal`` triangle is exact (start 0, no sliding window).
    """
    if start == 0 and (window is None or window >= ctx_len):
        return None
    q_pos = torch.arange(start, start + q_len).unsqueeze(1)
    k_pos = torch.arange(ctx_len).unsqueeze(0)
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    return mask


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Stores this step's K/V in the pool and returns attention output ``[T, q_heads, head_dim]``.

    Args:
        q: ``[T, q_heads, head_dim]`` queries (rotary already applied).
        k, v: ``[T, kv_heads, head_dim]`` this step's keys and values.
        kv: one layer's pool ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        meta: the step's segments and decode batch.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    """
    store_kv(kv, k, v, meta.slot_mapping)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_pool = kv[0].view(-1, num_kv_heads, head_dim)
    v_pool = kv[1].view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.ctx_slots is None:
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_pool[seg.ctx_slots], v_pool[seg.ctx_slots]
        out[rows] = _sdpa(q[rows].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), seg.mask, scale)[
            0
        ]
    if meta.decode is not None:
        d = meta.decode
        qd = q[d.q_index].unsqueeze(1)  # [B, 1, Hq, D]
        out[d.q_index] = _sdpa(qd, k_pool[d.slots], v_pool[d.slots], d.mask, scale)[:, 0]
    return out


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """``[B, Lq, H, D]`` layout in and out; grouped-query heads handled by SDPA."""
    is_causal = mask is None and q.shape[1] > 1
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
