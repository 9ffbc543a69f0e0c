"""``kernels.cpu_attention``: native paged decode attention against the torch path it replaces."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

from kvrelay.kernels import cpu_attention, gemv
from kvrelay.kernels.attention import AttentionMetadata, decode_groups, paged_attention

pytestmark = pytest.mark.skipif(not gemv.available(), reason="native library not built")


def _pool(num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_blocks + block_size + head_dim)
    return torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)


def _batch(lens: list[int], block_size: int, num_blocks: int, seed: int):
    """Block tables drawn without repeats from a shuffled pool (blocks 1..), as allocated."""
    free = list(range(1, num_blocks))
    random.Random(seed).shuffle(free)
    tables = []
    for n in lens:
        need = -(-n // block_size)
        tables.append([free.pop() for _ in range(need)])
    return tables


def _attend(q, kv, lens, tables, block_size, window, native: bool):
    """Output rows of the decode tokens (rows 0..n-1), through either path; the step's own
    K/V are the pool's entries at each sequence's last position (stored back unchanged)."""
    n, kv_heads = len(lens), kv.shape[3]
    last = [
        t[(ln - 1) // block_size] * block_size + (ln - 1) % block_size
        for ln, t in zip(lens, tables)
    ]
    slots = torch.tensor(last, dtype=torch.long)
    k_new = kv[0].view(-1, kv_heads, kv.shape[4])[slots].clone()
    v_new = kv[1].view(-1, kv_heads, kv.shape[4])[slots].clone()
    meta = AttentionMetadata(slot_mapping=slots, window=window)
    rows = list(range(n))
    if native:
        meta.native_decode = cpu_attention.make_decode(rows, lens, tables)
    else:
        meta.decode = decode_groups(rows, lens, tables, block_size, window)
    return paged_attention(q, k_new, v_new, kv, meta, q.shape[-1] ** -0.5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size,kv_heads,q_per_kv,head_dim",
    [(16, 3, 3, 64), (5, 2, 1, 24), (16, 1, 8, 128), (8, 4, 2, 36)],  # 24, 36: no AVX2 tail
)
@pytest.mark.parametrize("window", [None, 7, 600])
def test_native_decode_equals_the_torch_path(
    dtype: torch.dtype, block_size: int, kv_heads: int, q_per_kv: int, head_dim: int, window
) -> None:
    # past 512 keys the SIMD path softmaxes a chunk at a time: 513 and 1,100 span 2 and 3
    lens = [1, 2, block_size, block_size + 1, 33, 64, 65, 200, 31, 97, 513, 1100]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _batch(lens, block_size, num_blocks, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)
    assert cpu_attention.supports(kv, q.shape[1])
    want = _attend(q, kv, lens, tables, block_size, window, native=False).float()
    got = _attend(q, kv, lens, tables, block_size, window, native=True)
    assert got.dtype == dtype and got.shape == q.shape
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 600])
def test_few_long_sequences_split_by_head_equal_the_torch_path(dtype, window) -> None:
    """Under four sequences the work splits by kv head (one head per piece), each walking its
    context in chunks: lengths across one, two and three chunks of 512 keys."""
    lens = [1030, 512, 1537]
    block_size, kv_heads, q_per_kv, head_dim = 16, 3, 3, 64
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _batch(lens, block_size, num_blocks, seed=7)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(len(lens), kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)
    want = _attend(q, kv, lens, tables, block_size, window, native=False).float()
    got = _attend(q, kv, lens, tables, block_size, window, native=True)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1300])
def test_a_long_row_gets_the_same_bits_alone_and_in_a_batch(dtype, window, isa_cap) -> None:
    """A step of fewer than two pieces a thread shares a long row's chunks of 512 keys between
    the threads (split_rows: one and two rows on a pool of 4) and folds their partials in
    order; a batch walks each row in one piece. Both fold the same partials the same way: a
    row's output does not depend on its batch (3, 2 and 5 chunks here, the last of 1,537 keys a
    single one), on every vector path."""
    block_size, kv_heads, q_per_kv, head_dim = 16, 3, 3, 64
    lens = [1537, 600, 2100, 40, 90]
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    kv = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _batch(lens, block_size, num_blocks, seed=9)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(len(lens), kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.zeros_like(q)
        batch = cpu_attention.make_decode(rows, [lens[r] for r in rows], [tables[r] for r in rows])
        cpu_attention.decode(q, kv, batch, window, 0.125, out)
        return out

    threads = gemv.set_threads(4)
    try:
        for isa in [i for i in _isas() if i > 0]:
            isa_cap(isa)
            _check_alone_and_batched(attend, lens, isa)
    finally:
        gemv.set_threads(torch.get_num_threads())
    want = _reference(q, kv, list(range(len(lens))), lens, tables, None, window, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(attend(list(range(len(lens)))).double(), want, rtol=tol, atol=tol)
    assert threads == 4


def _check_alone_and_batched(attend, lens: list[int], isa: int) -> None:
    """Rows computed alone or two and three together equal the same rows of the whole batch."""
    batched = attend(list(range(len(lens))))  # five rows: a piece per row
    for alone in ([0], [2], [1, 2], [0, 1, 3]):
        got = attend(alone)
        for r in alone:
            assert torch.equal(got[r], batched[r]), (isa, alone, r)


def test_rows_elsewhere_in_the_batch_are_left_to_the_other_paths() -> None:
    """Only the decode rows are written: a prefill segment's rows come from SDPA as before."""
    kv = _pool(8, 4, 1, 8, torch.float32)
    q = torch.randn(3, 2, 8)
    out = torch.full_like(q, 7.0)
    batch = cpu_attention.make_decode([1], [5], [[2, 3]])
    cpu_attention.decode(q, kv, batch, None, 0.5, out)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    assert torch.equal(out[2], torch.full_like(out[2], 7.0))
    assert not torch.equal(out[1], torch.full_like(out[1], 7.0))


def test_unsupported_shapes_stay_on_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = _pool(4, 4, 2, 8, torch.float32)
    assert cpu_attention.supports(kv, 4)
    assert not cpu_attention.supports(kv, 3)  # query heads not a multiple of kv heads
    assert not cpu_attention.supports(kv, 2 * (cpu_attention.MAX_Q_PER_KV + 1))
    assert not cpu_attention.supports(kv.to(torch.float16), 4)
    monkeypatch.setenv("KVRELAY_NATIVE_ATTENTION", "0")
    assert not cpu_attention.supports(kv, 4)


def test_engine_decode_tokens_use_the_native_kernel(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch of more decoding sequences than the fused step takes attends through the kernel
    once per layer per step, prompt tokens (short segments: a row each) and decode tokens
    alike, and greedy tokens equal the torch path's. No packed copies: with panels for every
    projection a float32 model's wide decode steps are fused too (test_cpu_decode)."""
    from kvrelay import LLM, SamplingParams

    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    calls: list[int] = []  # query rows per call
    real = cpu_attention.decode

    def spy(q, kv, batch, window, scale, out):
        calls.append(batch.rows.numel())
        return real(q, kv, batch, window, scale, out)

    monkeypatch.setattr(cpu_attention, "decode", spy)
    modes: list[bool] = []  # the pool mode each step asked for
    real_mode = gemv.use_openmp
    monkeypatch.setattr(gemv, "use_openmp", lambda on: modes.append(on) or real_mode(on))
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    calls.clear()  # the LLM's warm-up steps: this test counts its own generate's
    modes.clear()
    assert llm.engine.runner.native_attention
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    lens = [9, 40, 17, 3, 25, 11, 30, 5, 19, 8]  # 10 sequences: more than gemv.MAX_ROWS
    # no prompt a prefix of another: a batch shares common prefixes within a step, and every
    # prompt token must run here
    prompts = [{"prompt_token_ids": list(range(3 + 100 * i, 3 + 100 * i + n))}
               for i, n in enumerate(lens)]  # fmt: skip
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = llm.engine.runner.model.config.num_layers
    assert calls and len(calls) % layers == 0
    # each sequence's prompt tokens and its 3 decode tokens, per layer
    assert sum(calls) == (sum(lens) + len(lens) * 3) * layers
    # 10 rows a step: torch runs on all threads, so the kernels join its OpenMP team
    assert modes and all(modes)
    llm.engine.runner.native_attention = False
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == native
    assert not calls


def _reference(q, kv, rows, ctx_lens, tables, row_table, window, scale):
    """Each query row's attention over its keys (the last ``window`` of them), in float64 from
    keys and values gathered out of the pool one token at a time."""
    block_size, kv_heads, head_dim = kv.shape[2], kv.shape[3], kv.shape[4]
    q_per_kv = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i, (row, n) in enumerate(zip(rows, ctx_lens)):
        table = tables[row_table[i] if row_table is not None else i]
        first = max(0, n - window) if window else 0
        slots = [table[t // block_size] * block_size + t % block_size for t in range(first, n)]
        keys = kv[0].reshape(-1, kv_heads, head_dim)[slots].double()  # [L, Hkv, D]
        values = kv[1].reshape(-1, kv_heads, head_dim)[slots].double()
        for h in range(q.shape[1]):
            scores = keys[:, h // q_per_kv] @ q[row, h].double() * scale
            out[row, h] = torch.softmax(scores, 0) @ values[:, h // q_per_kv]
    return out


def _isas() -> list[int]:
    """The kernel's paths this CPU has: 0 portable C, 1 AVX2, 2 AVX-512."""
    library = gemv.load_library()
    widest = library.attention_isa(0, 64)
    return list(range(widest + 1))


@pytest.fixture
def isa_cap():
    """Sets the widest path the kernel may take for one test, restored after."""
    library = gemv.load_library()
    old = library.attention_set_isa(-1)
    yield library.attention_set_isa
    library.attention_set_isa(old)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "block_size,kv_heads,q_per_kv,head_dim",
    [(16, 3, 3, 64), (5, 2, 1, 24), (16, 1, 8, 128), (8, 4, 2, 48), (16, 2, 2, 32)],
)
@pytest.mark.parametrize("window", [None, 7, 600])
def test_prefill_rows_attend_causally_over_their_sequence(
    dtype, block_size, kv_heads, q_per_kv, head_dim, window, isa_cap
) -> None:
    """A step's rows: prefill segments (one from position 0, one after 37 cached tokens, one
    across more than a chunk of 512 keys), each token a row over the keys up to its own
    position through its sequence's shared table, beside decode tokens with tables of their
    own; on every vector path this CPU has, equal to the reference."""
    # (cached tokens, new tokens) per sequence; on the AVX2 path, and on AVX512-BF16 for a
    # bfloat16 pool, segments go in blocks of consecutive tokens (attention.c's
    # attend_block_avx2, attend_block_bf16): 150 tokens are several blocks, each over more
    # than one chunk of keys
    segments = [(0, 23), (37, 20), (500, 30), (90, 150)]
    decode_lens = [1, 70, 600]
    num_blocks = sum(-(-(s + n) // block_size) for s, n in segments)
    num_blocks += sum(-(-n // block_size) for n in decode_lens) + 2
    kv = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    seq_tables = _batch([s + n for s, n in segments] + decode_lens, block_size, num_blocks, 3)
    rows, ctx_lens, row_table = [], [], []
    for seq, (start, n) in enumerate(segments):
        rows.extend(range(len(rows), len(rows) + n))
        ctx_lens.extend(range(start + 1, start + n + 1))
        row_table.extend([seq] * n)
    for j, n in enumerate(decode_lens):
        rows.append(len(rows))
        ctx_lens.append(n)
        row_table.append(len(segments) + j)
    gen = torch.Generator().manual_seed(head_dim)
    q = torch.randn(len(rows), kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    want = _reference(q, kv, rows, ctx_lens, seq_tables, row_table, window, scale)
    batch = cpu_attention.make_decode(rows, ctx_lens, seq_tables, row_table)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for isa in _isas():
        isa_cap(isa)
        out = torch.empty_like(q)
        cpu_attention.decode(q, kv, batch, window, scale, out)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol, msg=f"path {isa}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 7])
def test_a_prefill_token_attends_the_same_however_its_segment_splits(dtype, window, isa_cap):
    """On the AVX2 path a segment's tokens go in blocks of consecutive rows (attend_block_avx2):
    a token's output is the same bit for bit whether its segment came whole (blocks from its
    first token) or in two steps (blocks from where the second starts), a segment's last
    token alone in its block included, and with a window (chunks of keys at fixed offsets)."""
    if 1 not in _isas():
        pytest.skip("no AVX2 on this CPU")
    isa_cap(1)
    block_size, kv_heads, q_per_kv, head_dim, length = 16, 3, 3, 64, 150
    kv = _pool(12, block_size, kv_heads, head_dim, dtype)
    tables = _batch([length], block_size, 12, seed=11)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(length, kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)

    def attend(first: int, last: int) -> torch.Tensor:
        """Tokens first..last-1 of the sequence as one segment (its earlier keys cached)."""
        out = torch.zeros_like(q)
        rows = list(range(first, last))
        batch = cpu_attention.make_decode(rows, [r + 1 for r in rows], tables, [0] * len(rows))
        cpu_attention.decode(q, kv, batch, window, 0.125, out)
        return out[first:last]

    whole = attend(0, length)
    for split in (17, 65, 141):  # 17 and 150 - 141 = 9 tokens: a last block of one row
        assert torch.equal(torch.cat([attend(0, split), attend(split, length)]), whole), split
    want = _reference(q, kv, list(range(length)), list(range(1, length + 1)), tables,
                      [0] * length, window, 0.125)  # fmt: skip
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(whole.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_vector_path_equals_the_portable_one(dtype, isa_cap) -> None:
    """Decode rows of 1-1,100 keys: AVX-512 (where the CPU has it; bfloat16 scores as BF16 dot
    products), AVX2 and portable C agree with the reference and with each other."""
    lens = [1, 15, 16, 17, 200, 513, 1100]
    block_size, kv_heads, q_per_kv, head_dim = 16, 3, 3, 64
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    kv = _pool(num_blocks, block_size, kv_heads, head_dim, dtype)
    tables = _batch(lens, block_size, num_blocks, seed=5)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(len(lens), kv_heads * q_per_kv, head_dim, generator=gen).to(dtype)
    rows = list(range(len(lens)))
    want = _reference(q, kv, rows, lens, tables, None, None, 0.125)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    outs = []
    for isa in _isas():
        isa_cap(isa)
        out = torch.empty_like(q)
        cpu_attention.decode(q, kv, cpu_attention.make_decode(rows, lens, tables), None, 0.125, out)
        torch.testing.assert_close(out.double(), want, rtol=tol, atol=tol, msg=f"path {isa}")
        outs.append(out)
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=tol, atol=tol)


def test_avx512_path_taken_where_the_cpu_has_it() -> None:
    """On a CPU with AVX-512 (BF16 for a bfloat16 pool) the kernel takes the 16-lane path for
    head sizes it divides, and the 8-lane one for others."""
    flags = Path("/proc/cpuinfo").read_text() if sys.platform == "linux" else ""
    if " avx512f " not in flags or " avx512bw " not in flags or " avx512vl " not in flags:
        pytest.skip("no AVX-512 on this CPU")
    library = gemv.load_library()
    assert library.attention_isa(0, 64) == 2  # float32
    assert library.attention_isa(0, 24) == 1  # 24 columns: not a multiple of 16
    if " avx512_bf16 " in flags:
        assert library.attention_isa(1, 64) == 2
        assert library.attention_isa(1, 48) == 1  # bfloat16 dot products take 32 at a time


def test_long_prefill_segments_stay_on_sdpa(tiny_model_dir, monkeypatch) -> None:
    """Segments longer than the runner's limit attend in SDPA, shorter ones in the kernel (the
    two decode tokens of a step take the fused native step, kernels.cpu_decode, which calls
    the library directly); greedy tokens are the same either way."""
    from kvrelay import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    runner = llm.engine.runner
    assert runner.native_prefill_tokens == cpu_attention.prefill_limit(runner.kv_cache)
    assert runner.native_prefill_tokens in (
        cpu_attention.MAX_PREFILL_TOKENS,
        cpu_attention.MAX_PREFILL_TOKENS_BF16_DOT,
        cpu_attention.MAX_PREFILL_TOKENS_AVX2,
    )
    calls: list[int] = []
    real = cpu_attention.decode

    def spy(q, kv, batch, *args):
        calls.append(batch.rows.numel())
        return real(q, kv, batch, *args)

    monkeypatch.setattr(cpu_attention, "decode", spy)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (40, 9)]
    runner.native_prefill_tokens = 16  # the 40-token prompt is over it, the 9-token one not
    split = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = runner.model.config.num_layers
    assert calls == [9] * layers  # the short prompt's tokens, in the prompts' one step
    runner.native_prefill_tokens = 0  # every prompt in SDPA
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == split
    assert not calls
