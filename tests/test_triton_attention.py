"""The Triton decode, prefill and KV-store kernels against the torch reference.

On a machine without a GPU they run on CPU tensors in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1`` before triton is imported); where CUDA is present they also run
compiled on the GPU (the ``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import triton_attention
from kvrelay.kernels.attention import (
    AttentionMetadata,
    PrefillSegment,
    causal_mask,
    decode_groups,
    paged_attention,
    store_kv,
)
from kvrelay.kernels.cpu_attention import make_decode

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not triton_attention.interpreted(),
            reason="CPU tensors need TRITON_INTERPRET=1 before triton is imported "
            "(conftest sets it where there is no GPU)",
        ),
    ),
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


def _pool_and_tables(
    ctx_lens: list[int], block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, list[list[int]]]:
    """A pool with scattered, shuffled blocks for sequences of the given context lengths."""
    need = sum(-(-c // block_size) for c in ctx_lens)
    num_blocks = need + 7
    gen = torch.Generator().manual_seed(sum(ctx_lens) + kv_heads)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for c in ctx_lens:
        n = -(-c // block_size)
        tables.append(order[used : used + n])
        used += n
    return kv, tables


def _reference(
    q: torch.Tensor,
    kv: torch.Tensor,
    rows: list[int],
    ctx_lens: list[int],
    tables: list[list[int]],
    window: int | None,
) -> torch.Tensor:
    """The torch path's output for the decode rows (gather + masked SDPA, in float32)."""
    block_size, kv_heads, head_dim = kv.shape[2:]
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), window=window)
    meta.decode = decode_groups(rows, ctx_lens, tables, block_size, window)
    empty = torch.empty(0, kv_heads, head_dim)
    out = paged_attention(q.float(), empty, empty, kv.float(), meta, head_dim**-0.5)
    return out[rows]


CASES = [
    # ctx lens, block size, q heads, kv heads, head dim, window, splits
    ([1, 17, 40, 100], 16, 9, 3, 64, None, 1),
    ([1, 17, 40, 100], 16, 9, 3, 64, None, 4),
    ([64, 65, 128, 300], 16, 8, 2, 32, None, 2),
    ([300, 5], 16, 4, 4, 48, 100, 1),
    ([300, 5], 16, 4, 4, 48, 100, 8),
    ([33, 250], 32, 16, 2, 64, 64, 4),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"ctx{max(c[0])}-q{c[2]}kv{c[3]}-s{c[6]}")
def test_decode_equals_the_torch_path(device, dtype, case):
    ctx_lens, block_size, q_heads, kv_heads, head_dim, window, splits = case
    kv, tables = _pool_and_tables(ctx_lens, block_size, kv_heads, head_dim, dtype)
    n = len(ctx_lens)
    rows = [2 * i + 1 for i in range(n)]  # decode rows among others (a mixed step's prefill)
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2 * n + 1, q_heads, head_dim, generator=gen).to(dtype)
    expected = _reference(q, kv, rows, ctx_lens, tables, window)
    out = torch.full_like(q, 7.0)
    batch = make_decode(rows, ctx_lens, tables)
    dev = torch.device(device)
    out = out.to(dev)
    triton_attention.decode(
        q.to(dev), kv.to(dev), _to(batch, dev), window, head_dim**-0.5, out, splits=splits
    )
    out = out.cpu()
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out[rows].float(), expected, atol=tol, rtol=tol)
    others = [r for r in range(2 * n + 1) if r not in rows]
    assert bool((out[others] == 7.0).all()), "rows that are not decode tokens were written"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 4])
def test_a_sequence_of_no_context_reads_nothing_and_gives_zeros(device, splits):
    """A CUDA graph's padding rows: context length 0, table entries pointing anywhere."""
    kv, tables = _pool_and_tables([40, 40], 16, 2, 32, torch.float32)
    rows, ctx_lens = [0, 1], [40, 0]
    q = torch.randn(2, 4, 32)
    out = torch.full_like(q, float("nan"))
    dev = torch.device(device)
    out = out.to(dev)
    batch = _to(make_decode(rows, ctx_lens, tables), dev)
    triton_attention.decode(q.to(dev), kv.to(dev), batch, None, 32**-0.5, out, splits=splits)
    out = out.cpu()
    assert bool((out[1] == 0).all())
    torch.testing.assert_close(out[:1], _reference(q, kv, [0], [40], tables[:1], None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_writes_each_row_at_its_slot_and_skips_negative_slots(device, dtype):
    kv = torch.zeros(2, 6, 4, 3, 16, dtype=dtype)
    k = torch.randn(5, 3, 16).to(dtype)
    v = torch.randn(5, 3, 16).to(dtype)
    slots = torch.tensor([9, 0, -1, 23, 4])
    expected = kv.clone()
    keep = slots >= 0
    store_kv(expected, k[keep], v[keep], slots[keep])
    dev = torch.device(device)
    got = kv.to(dev)
    # k and v as views of a fused projection's columns, as the model passes them
    kv_fused = torch.cat([k.reshape(5, -1), v.reshape(5, -1)], dim=1).to(dev)
    triton_attention.store_kv(
        got, kv_fused[:, :48].view(5, 3, 16), kv_fused[:, 48:].view(5, 3, 16), slots.to(dev)
    )
    assert torch.equal(got.cpu(), expected)


def test_splits_are_a_power_of_two_and_cpu_gets_one():
    assert triton_attention.num_splits(1, 3, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="power of two"):
        kv, tables = _pool_and_tables([20], 16, 1, 16, torch.float32)
        q = torch.randn(1, 1, 16)
        triton_attention.decode(q, kv, make_decode([0], [20], tables), None, 0.25, q, splits=3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_splits_fill_the_multiprocessors_for_few_sequences():
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    few = triton_attention.num_splits(1, 3, dev)
    many = triton_attention.num_splits(256, 3, dev)
    assert few == triton_attention.MAX_SPLITS or few * 3 >= sms
    assert many == 1


PREFILL_CASES = [
    # segments (start, tokens), decode context lengths, block size, q heads, kv heads,
    # head dim, window, tile tokens (None: the kernel's full tile)
    ([(0, 50)], [], 16, 9, 3, 64, None, None),  # from position 0: a full tile and a partial
    ([(37, 45)], [], 16, 9, 3, 64, None, None),  # a chunk in the middle of a prompt
    ([(0, 30), (100, 70), (16, 16)], [17, 100], 16, 4, 4, 128, None, 16),
    ([(0, 40), (90, 25)], [5], 32, 16, 2, 64, None, None),
    ([(0, 70), (150, 40)], [200], 16, 9, 3, 64, 48, None),
    ([(200, 30)], [], 16, 4, 4, 128, 64, 16),
]


def _prefill_step(case, dtype):
    """A flat batch of prefill segments and decode rows (one decode row before the segments,
    the rest after), a pool holding every sequence's keys, and the torch path's output."""
    segments, decode_ctx, block_size, q_heads, kv_heads, head_dim, window, _ = case
    ctx_lens = [start + n for start, n in segments] + decode_ctx
    kv, tables = _pool_and_tables(ctx_lens, block_size, kv_heads, head_dim, dtype)
    decode_rows, seg_rows, row = [], [], 0
    if decode_ctx:
        decode_rows.append(row)
        row += 1
    for _, n in segments:
        seg_rows.append(row)
        row += n
    decode_rows.extend(range(row, row + len(decode_ctx) - len(decode_rows)))
    num_rows = row + len(decode_ctx) - (1 if decode_ctx else 0)
    gen = torch.Generator().manual_seed(num_rows)
    q = torch.randn(num_rows, q_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), window=window)
    for (start, n), seg_row, table in zip(segments, seg_rows, tables, strict=False):
        blocks = torch.tensor(table[: -(-(start + n) // block_size)])
        mask = causal_mask(start, n, start + n, window)
        meta.prefills.append(PrefillSegment(seg_row, n, blocks, start + n, mask))
    if decode_ctx:
        meta.decode = decode_groups(
            decode_rows, decode_ctx, tables[len(segments) :], block_size, window
        )
    empty = torch.empty(0, kv_heads, head_dim)
    expected = paged_attention(q.float(), empty, empty, kv.float(), meta, head_dim**-0.5)
    return q, kv, tables, seg_rows, decode_rows, expected


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"seg{len(c[0])}-q{c[3]}kv{c[4]}-d{c[5]}-w{c[6]}"
)
def test_prefill_equals_the_torch_path(device, dtype, case):
    """One launch for every segment of the step; the decode kernel fills the decode rows of
    the same output, and the two together equal the torch path's whole step."""
    segments, decode_ctx, _, q_heads, kv_heads, head_dim, window, tile_tokens = case
    q, kv, tables, seg_rows, decode_rows, expected = _prefill_step(case, dtype)
    tile_tokens = tile_tokens or triton_attention.prefill_tile_tokens(q_heads // kv_heads)
    batch = triton_attention.make_prefill(
        [(r, start, n, t) for r, (start, n), t in zip(seg_rows, segments, tables, strict=False)],
        tile_tokens,
    )
    assert batch.tiles.shape[0] == sum(-(-n // tile_tokens) for _, n in segments)
    assert batch.tables.shape[1] % 16 == 0
    dev = torch.device(device)
    out = torch.full_like(q, 7.0).to(dev)
    qd, kvd = q.to(dev), kv.to(dev)
    triton_attention.prefill(
        qd, kvd, triton_attention.prefill_to(batch, dev), window, head_dim**-0.5, out
    )
    assert bool((out[decode_rows] == 7.0).all()), "the prefill kernel wrote a decode row"
    if decode_ctx:
        decode = make_decode(decode_rows, decode_ctx, tables[len(segments) :])
        triton_attention.decode(qd, kvd, _to(decode, dev), window, head_dim**-0.5, out)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_stores_the_step_then_runs_the_prefill_kernel(dtype):
    """The wired path: ``paged_attention`` with ``native_prefill`` stores the step's K/V (a
    prompt from position 0 and a chunk after 40 cached tokens) and attends over them in the
    pool; the torch path with segments (fresh K/V for the first) gives the same rows."""
    if not triton_attention.interpreted():
        pytest.skip("CPU tensors need TRITON_INTERPRET=1 (the GPU path is in test_cuda.py)")
    block_size, q_heads, kv_heads, head_dim = 16, 9, 3, 64
    kv, tables = _pool_and_tables([70, 40 + 33], block_size, kv_heads, head_dim, dtype)
    segments = [(0, 0, 70, tables[0]), (70, 40, 33, tables[1])]
    gen = torch.Generator().manual_seed(5)
    heads = (q_heads, kv_heads, kv_heads)
    q, k, v = (torch.randn(103, h, head_dim, generator=gen).to(dtype) for h in heads)
    slots = [tables[0][p // 16] * 16 + p % 16 for p in range(70)]
    slots += [tables[1][p // 16] * 16 + p % 16 for p in range(40, 73)]
    meta = AttentionMetadata(slot_mapping=torch.tensor(slots))
    meta.native_prefill = triton_attention.make_prefill(segments, 42)
    got = paged_attention(q, k, v, kv.clone(), meta, head_dim**-0.5)
    ref = AttentionMetadata(slot_mapping=torch.tensor(slots))
    ref.prefills = [
        PrefillSegment(0, 70, None, 70, None),
        PrefillSegment(70, 33, torch.tensor(tables[1][:5]), 73, causal_mask(40, 33, 73, None)),
    ]
    expected = paged_attention(q.float(), k.float(), v.float(), kv.float(), ref, head_dim**-0.5)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)


def test_prefill_tiles_cut_each_segment_and_name_its_table():
    batch = triton_attention.make_prefill([(3, 0, 37, [4, 5, 6]), (40, 96, 5, [9] * 7)], 16)
    assert batch.tiles.tolist() == [
        [3, 16, 0, 0],
        [19, 16, 16, 0],
        [35, 5, 32, 0],
        [40, 5, 96, 1],
    ]
    assert batch.tables.shape == (2, 16) and batch.tables[0, :4].tolist() == [4, 5, 6, 0]
    assert triton_attention.prefill_tile_tokens(3) == 42
    assert triton_attention.prefill_tile_tokens(1) == 128
    q = torch.zeros(40, 16, 16)
    with pytest.raises(ValueError, match="exceed"):
        kv = torch.zeros(2, 4, 16, 1, 16)
        triton_attention.prefill(q, kv, batch, None, 0.25, q)


def _to(batch, device):
    return type(batch)(batch.rows.to(device), batch.tables.to(device), batch.ctx_lens.to(device))
