"""Paged attention over a block-structured KV pool: the torch reference used on CPU.

Pool layout per layer: ``kv[2, num_blocks, block_size, kv_heads, head_dim]``; a token at
position ``p`` of a sequence with block table ``bt`` lives in slot ``bt[p // bs] * bs + p % bs``.

A step's tokens are flat (selective batching); only attention is split per sequence:

- prefill segments (a chunk of one sequence's tokens) attend causally to their context;
  a segment that starts at position 0 uses its fresh K/V directly (no gather);
- decode tokens (one per sequence) are grouped by context length, and each group is one
  masked SDPA call over its sequences' blocks, padded to the group's longest context. Grouping
  bounds the padding (``DECODE_GROUP_PAD_TOKENS``), which would otherwise make every sequence
  pay for the longest one in the batch.

Context blocks are gathered whole (rows of ``block_size * kv_heads * head_dim`` elements, not
token by token) into a workspace that lives across layers and steps: a fresh multi-megabyte
tensor per layer costs more in page faults than the copy itself. Decode queries are viewed
as ``[n, kv_heads, q_per_kv, head_dim]``, so grouped-query attention needs no repeated K/V.
The metadata (block lists, masks) is built once per step by the runner and shared by all
layers. Decode tokens go to kvrelay's own kernel instead when the runner built
``native_decode`` (keys and values read in place, no gather, no padding): the C library's on
CPU (``cpu_attention``), Triton's on a GPU (``triton_attention``, which also stores a step's
K/V there). On CPU the runner puts the tokens of short prefill segments there too (a row per
token, causal per row; ``cpu_attention.prefill_limit``), so ``prefills`` then holds only
the longer segments. On a GPU the runner builds ``native_prefill`` instead of segments: all of
a step's segments attend in one Triton launch a layer (``triton_attention.prefill``), not a
gather and an SDPA each (``KVRELAY_TRITON_PREFILL=0`` keeps the segments, for comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kvrelay.kernels import cpu_attention, triton_attention
from kvrelay.kernels.cpu_attention import NativeDecode
from kvrelay.kernels.triton_attention import PrefillBatch

DECODE_GROUP_PAD_TOKENS = 256  # a decode group pads no sequence by more than this many tokens


@dataclass(slots=True)
class PrefillSegment:
    q_start: int  # first row of the segment in the flat batch
    q_len: int  # rows in the segment
    ctx_blocks: torch.Tensor | None  # [ceil(ctx_len / bs)] context block ids; None: start == 0
    ctx_len: int  # tokens of context, this segment's included
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend; None: plain causal


@dataclass(slots=True)
class DecodeGroup:
    q_index: torch.Tensor  # [n] rows of the group's decode tokens in the flat batch
    block_ids: torch.Tensor  # [n * num_blocks] block tables, row-major, padded with block 0
    num_blocks: int  # blocks per sequence after padding
    ctx_len: int  # keys per sequence that the call reads (<= num_blocks * block_size)
    mask: torch.Tensor | None  # [n, 1, 1, ctx_len] bool, True = attend; None: attend to all


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] slot where each new token's K/V is written
    prefills: list[PrefillSegment] = field(default_factory=list)
    decode: list[DecodeGroup] = field(default_factory=list)
    workspace: Workspace | None = None  # gather buffers; None: allocate per call
    native_decode: NativeDecode | None = None  # CPU: decode tokens for the native kernel
    window: int | None = None  # sliding window (the native kernel's; groups carry masks)
    # CUDA: the prefill segments as tiles for Triton's prefill kernel (``prefills`` is empty)
    native_prefill: PrefillBatch | None = None

    def to(self, device: torch.device) -> AttentionMetadata:
        """This metadata with every tensor on ``device`` (itself when that is the CPU)."""
        if device.type == "cpu":
            return self
        return AttentionMetadata(
            self.slot_mapping.to(device, non_blocking=True),
            [
                replace(seg, ctx_blocks=_to(seg.ctx_blocks, device), mask=_to(seg.mask, device))
                for seg in self.prefills
            ],
            [
                replace(
                    group,
                    q_index=group.q_index.to(device, non_blocking=True),
                    block_ids=group.block_ids.to(device, non_blocking=True),
                    mask=_to(group.mask, device),
                )
                for group in self.decode
            ],
            self.workspace,
            None if self.native_decode is None else _decode_to(self.native_decode, device),
            self.window,
            None
            if self.native_prefill is None
            else triton_attention.prefill_to(self.native_prefill, device),
        )


def _decode_to(batch: NativeDecode, device: torch.device) -> NativeDecode:
    return NativeDecode(
        batch.rows.to(device, non_blocking=True),
        batch.tables.to(device, non_blocking=True),
        batch.ctx_lens.to(device, non_blocking=True),
    )


def _to(tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if tensor is None else tensor.to(device, non_blocking=True)


class Workspace:
    """Two reusable buffers of whole KV blocks that context gathers write into.

    Grows to the largest gather seen and keeps that size, the way a caching allocator would.
    Valid because a layer's attention finishes reading a gather before the next one starts.
    """

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def gather(
        self, k_blocks: torch.Tensor, v_blocks: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``k_blocks[ids], v_blocks[ids]`` of 2-D ``[num_blocks, row]`` pools, into the buffers."""
        n, row = ids.numel(), k_blocks.shape[1]
        if (
            self._k is None
            or self._v is None
            or self._k.shape[0] < n
            or self._k.shape[1] != row
            or self._k.dtype != k_blocks.dtype
        ):
            cap = max(n, 1 if self._k is None else self._k.shape[0])
            self._k = torch.empty(cap, row, dtype=k_blocks.dtype, device=k_blocks.device)
            self._v = torch.empty_like(self._k)
        k = torch.index_select(k_blocks, 0, ids, out=self._k[:n])
        v = torch.index_select(v_blocks, 0, ids, out=self._v[:n])
        return k, v


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


def decode_groups(
    rows: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    window: int | None,
    max_pad_tokens: int = DECODE_GROUP_PAD_TOKENS,
) -> list[DecodeGroup]:
    """Groups decode tokens by context length and builds each group's blocks and mask.

    Args:
        rows: row of each decode token in the flat batch.
        ctx_lens: keys each token attends over (its own included).
        tables: each sequence's block table (at least ``ceil(ctx_len / block_size)`` long).
        block_size: tokens per block.
        window: sliding-window size, or None.
        max_pad_tokens: a new group starts when a sequence would be padded by more than this.
    """
    order = sorted(range(len(rows)), key=lambda i: ctx_lens[i], reverse=True)
    groups: list[DecodeGroup] = []
    members: list[int] = []
    for i in order:
        if members and ctx_lens[members[0]] - ctx_lens[i] > max_pad_tokens:
            groups.append(_decode_group(members, rows, ctx_lens, tables, block_size, window))
            members = []
        members.append(i)
    if members:
        groups.append(_decode_group(members, rows, ctx_lens, tables, block_size, window))
    return groups


def _decode_group(
    members: list[int],
    rows: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    block_size: int,
    window: int | None,
) -> DecodeGroup:
    lens = [ctx_lens[i] for i in members]
    max_len = lens[0]
    num_blocks = -(-max_len // block_size)
    ids: list[int] = []
    for i in members:
        table = tables[i][:num_blocks]
        ids.extend(table)
        ids.extend([0] * (num_blocks - len(table)))
    mask = None
    if lens[-1] != max_len or (window is not None and window < max_len):
        key_pos = torch.arange(max_len).unsqueeze(0)
        len_t = torch.tensor(lens).unsqueeze(1)
        m = key_pos < len_t
        if window is not None:
            m &= key_pos > len_t - 1 - window
        mask = m[:, None, None, :]
    return DecodeGroup(
        torch.tensor([rows[i] for i in members], dtype=torch.long),
        torch.tensor(ids, dtype=torch.long),
        num_blocks,
        max_len,
        mask,
    )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Stores this step's K/V in the pool and returns attention output ``[T, q_heads, head_dim]``
    (in ``out`` when given: a CUDA graph's static buffer).

    Args:
        q: ``[T, q_heads, head_dim]`` queries (rotary already applied).
        k, v: ``[T, kv_heads, head_dim]`` this step's keys and values.
        kv: one layer's pool ``[2, num_blocks, block_size, kv_heads, head_dim]``.
        meta: the step's segments and decode groups.
        scale: softmax scale, usually ``head_dim ** -0.5``.
    """
    native = meta.native_decode
    on_gpu = kv.device.type != "cpu" and (native is not None or meta.native_prefill is not None)
    if on_gpu:  # Triton's store: one launch, and skips the padding rows of a CUDA graph
        triton_attention.store_kv(kv, k, v, meta.slot_mapping)
    else:
        store_kv(kv, k, v, meta.slot_mapping)
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    num_blocks = kv.shape[1]
    k_blocks = kv[0].view(num_blocks, -1)
    v_blocks = kv[1].view(num_blocks, -1)
    workspace = meta.workspace if meta.workspace is not None else Workspace()
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, as q may not be
    if meta.native_prefill is not None:  # on a GPU: every segment of the step in one launch
        triton_attention.prefill(q, kv, meta.native_prefill, meta.window, scale, out)
    for seg in meta.prefills:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        if seg.ctx_blocks is None:
            ks, vs = k[rows], v[rows]
        else:
            kb, vb = workspace.gather(k_blocks, v_blocks, seg.ctx_blocks)
            ks = kb.view(-1, num_kv_heads, head_dim)[: seg.ctx_len]
            vs = vb.view(-1, num_kv_heads, head_dim)[: seg.ctx_len]
        out[rows] = _sdpa(q[rows].unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), seg.mask, scale)[
            0
        ]
    if native is not None and on_gpu:
        triton_attention.decode(q, kv, native, meta.window, scale, out)
    elif native is not None:
        cpu_attention.decode(q.contiguous(), kv, native, meta.window, scale, out)
    q_per_kv = q.shape[1] // num_kv_heads
    for group in meta.decode:
        n = group.q_index.numel()
        kb, vb = workspace.gather(k_blocks, v_blocks, group.block_ids)
        shape = (n, group.num_blocks * kv.shape[2], num_kv_heads, head_dim)
        ks = kb.view(shape)[:, : group.ctx_len].transpose(1, 2)  # [n, Hkv, L, D]
        vs = vb.view(shape)[:, : group.ctx_len].transpose(1, 2)
        qg = q[group.q_index].view(n, num_kv_heads, q_per_kv, head_dim)
        o = F.scaled_dot_product_attention(qg, ks, vs, attn_mask=group.mask, scale=scale)
        out[group.q_index] = o.reshape(n, -1, head_dim)
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
