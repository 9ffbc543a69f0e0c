"""The torch reference paged attention against dense attention, and its decode grouping."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvrelay.kernels.attention import (
    AttentionMetadata,
    PrefillSegment,
    Workspace,
    causal_mask,
    decode_groups,
    paged_attention,
)

BS, HQ, HKV, D = 4, 4, 2, 8


def test_decode_groups_split_where_padding_would_exceed_the_limit() -> None:
    rows = [0, 1, 2, 3, 4]
    ctx = [10, 300, 290, 12, 40]
    tables = [[i * 100 + j for j in range(-(-c // BS))] for i, c in enumerate(ctx)]
    groups = decode_groups(rows, ctx, tables, BS, None, max_pad_tokens=32)
    assert [g.q_index.tolist() for g in groups] == [[1, 2], [4, 3, 0]]
    assert [g.ctx_len for g in groups] == [300, 40]
    assert [g.num_blocks for g in groups] == [75, 10]
    # block tables row-major, shorter ones padded with block 0
    second = groups[1].block_ids.view(3, 10)
    assert second[0].tolist() == tables[4]
    assert second[1].tolist() == tables[3] + [0] * 7
    assert second[2].tolist() == tables[0] + [0] * 7
    mask = groups[1].mask
    assert mask is not None and mask.shape == (3, 1, 1, 40)
    assert mask[:, 0, 0].sum(-1).tolist() == [40, 12, 10]


def test_decode_group_of_equal_lengths_needs_no_mask() -> None:
    groups = decode_groups([0, 1], [9, 9], [[1, 2, 3], [4, 5, 6]], BS, None)
    assert len(groups) == 1 and groups[0].mask is None
    windowed = decode_groups([0, 1], [9, 9], [[1, 2, 3], [4, 5, 6]], BS, window=4)
    mask = windowed[0].mask
    assert mask is not None and mask[0, 0, 0].tolist() == [False] * 5 + [True] * 4


def test_workspace_reuses_its_buffers() -> None:
    ws = Workspace()
    pool = torch.arange(40.0).view(10, 4)
    k, v = ws.gather(pool, pool + 100, torch.tensor([3, 1, 3]))
    assert k.tolist() == [pool[3].tolist(), pool[1].tolist(), pool[3].tolist()]
    assert v[1].tolist() == (pool[1] + 100).tolist()
    ptr = k.data_ptr()
    k2, _ = ws.gather(pool, pool, torch.tensor([0]))
    assert k2.data_ptr() == ptr and k2.tolist() == [pool[0].tolist()]
    k3, _ = ws.gather(pool, pool, torch.arange(8))  # grows
    assert k3.shape == (8, 4) and torch.equal(k3, pool[:8])


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One sequence: q ``[Lq, HQ, D]`` over k, v ``[L, HKV, D]``; mask ``[Lq, L]``."""
    k = k.repeat_interleave(HQ // HKV, dim=1)
    v = v.repeat_interleave(HQ // HKV, dim=1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=D**-0.5
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("max_pad", [0, 16, 1000])
def test_paged_attention_matches_dense(window: int | None, max_pad: int) -> None:
    """Decode tokens of many lengths and a chunked-prefill segment, in one step."""
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(1)
    num_blocks = 64
    kv = torch.randn(2, num_blocks, BS, HKV, D, generator=gen)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    # (context already in the pool, new tokens this step)
    seqs = [(12, 1), (0, 1), (30, 1), (5, 1), (13, 1), (9, 6)]
    tables, full_k, full_v = [], [], []
    for past, new in seqs:
        n = -(-(past + new) // BS)
        tables.append([free.pop() for _ in range(n)])
        full_k.append(torch.randn(past + new, HKV, D, generator=gen))
        full_v.append(torch.randn(past + new, HKV, D, generator=gen))
    for table, (past, _), k, v in zip(tables, seqs, full_k, full_v, strict=True):
        for p in range(past):  # the context written by earlier steps
            kv[0, table[p // BS], p % BS] = k[p]
            kv[1, table[p // BS], p % BS] = v[p]
    q_rows, k_rows, v_rows, slots = [], [], [], []
    prefills, dec_rows, dec_ctx, dec_tables = [], [], [], []
    row = 0
    for table, (past, new), k, v in zip(tables, seqs, full_k, full_v, strict=True):
        q_rows.append(torch.randn(new, HQ, D, generator=gen))
        k_rows.append(k[past:])
        v_rows.append(v[past:])
        slots += [table[p // BS] * BS + p % BS for p in range(past, past + new)]
        if new == 1:
            dec_rows.append(row)
            dec_ctx.append(past + 1)
            dec_tables.append(table)
        else:
            ctx_blocks = torch.tensor(table[: -(-(past + new) // BS)])
            mask = causal_mask(past, new, past + new, window)
            prefills.append(PrefillSegment(row, new, ctx_blocks, past + new, mask))
        row += new
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        prefills=prefills,
        decode=decode_groups(dec_rows, dec_ctx, dec_tables, BS, window, max_pad),
        workspace=Workspace(),
    )
    out = paged_attention(
        torch.cat(q_rows), torch.cat(k_rows), torch.cat(v_rows), kv, meta, D**-0.5
    )
    row = 0
    for (past, new), q, k, v in zip(seqs, q_rows, full_k, full_v, strict=True):
        q_pos = torch.arange(past, past + new).unsqueeze(1)
        k_pos = torch.arange(past + new).unsqueeze(0)
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        expected = _dense(q, k, v, mask)
        torch.testing.assert_close(out[row : row + new], expected, atol=1e-5, rtol=1e-5)
        row += new
