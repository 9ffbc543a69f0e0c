"""``kernels.cpu_attention``: native paged decode attention against the torch path it replaces."""

from __future__ import annotations

import random

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
    once per layer per decode step, and greedy tokens equal the torch path's."""
    from kvrelay import LLM, SamplingParams

    calls: list[int] = []  # decode tokens per call
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
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in lens]
    native = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    layers = llm.engine.runner.model.config.num_layers
    assert calls and len(calls) % layers == 0
    assert sum(calls) == len(lens) * 3 * layers  # each sequence's 3 decode tokens, per layer
    # 10 rows a step: torch runs on all threads, so the kernels join its OpenMP team
    assert modes and all(modes)
    llm.engine.runner.native_attention = False
    calls.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == native
    assert not calls
