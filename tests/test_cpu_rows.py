"""``kernels.cpu_rows``: a layer's small ops in the native library against the torch ops they
replace in ``LlamaModel.forward`` (``llama.rms_norm``, ``llama.apply_rope``, SiLU * up).

Row counts cover one row, a few (run on the caller) and enough values for the thread pool;
odd widths hit the vector loops' tails (56: sixteen lanes three times, then eight).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.models import llama
from kvrelay.kernels import cpu_rows, gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="native library not built")

DTYPES = [torch.float32, torch.bfloat16]
ROWS = [1, 5, 200]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: summation order apart; bfloat16: at most one ulp of the rounded output, where a
    float32 difference in the last bit moved a value across a rounding boundary."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:
        diff = (got.float() - want.float()).abs()
        assert bool((diff <= want.float().abs() * 2**-7 + 1e-30).all()), diff.max()
        assert (diff > 0).float().mean() < 0.01  # nearly all bit-identical


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest):
    old = torch.get_num_threads()
    gemv.set_threads(request.param)
    yield request.param
    gemv.set_threads(old)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [576, 100, 56])
def test_add_rms_norm_matches_torch(
    threads: int, dtype: torch.dtype, rows: int, width: int
) -> None:
    gen = torch.Generator().manual_seed(rows + width)
    x = torch.randn(rows, width, generator=gen).to(dtype)
    delta = torch.randn(rows, width, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype)
    assert cpu_rows.supports(x)
    # without a residual: x is left alone
    before = x.clone()
    _close(cpu_rows.add_rms_norm(x, None, weight, 1e-5), llama.rms_norm(before, weight, 1e-5))
    assert torch.equal(x, before)
    # with one: x becomes x + delta (torch's rounding), and the norm is of the sum
    want_x = before + delta
    h = cpu_rows.add_rms_norm(x, delta, weight, 1e-5)
    assert torch.equal(x, want_x)
    _close(h, llama.rms_norm(want_x, weight, 1e-5))


def test_bfloat16_residual_add_rounds_as_torch_bit_for_bit() -> None:
    """The vector path's narrowing (round to nearest even, NaN kept a NaN) against torch's add,
    on sums that fall exactly halfway between two bfloat16 values, infinities and NaNs; 1,024
    columns so every value goes through the vector loop."""
    ulp = 2.0**-7  # a bfloat16 ulp at 1.0
    x = torch.tensor([1.0, 1.0 + ulp, -1.0, -(1.0 + ulp), 3.0, float("inf"), float("nan"), 0.0])
    delta = torch.tensor([ulp / 2, ulp / 2, -ulp / 2, -ulp / 2, 2.0**-30, 1.0, 1.0, -0.0])
    x = x.repeat(128).unsqueeze(0).to(torch.bfloat16)
    delta = delta.repeat(128).unsqueeze(0).to(torch.bfloat16)
    want = (x + delta).view(torch.int16)
    cpu_rows.add_rms_norm(x, delta, torch.ones(1024, dtype=torch.bfloat16), 1e-5)
    got = x.view(torch.int16)
    nan = torch.isnan(x)
    assert torch.equal(got[~nan], want[~nan])
    assert bool(torch.isnan((want.view(torch.bfloat16))[nan]).all()) and int(nan.sum()) == 128


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_matches_torch(threads: int, dtype: torch.dtype, rows: int) -> None:
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    angles = torch.rand(rows, 1, head_dim // 2, generator=gen) * 100
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    qk_size = (heads + kv_heads) * head_dim
    want = llama.apply_rope(qkv[:, :qk_size].view(rows, heads + kv_heads, head_dim), cos, sin)
    untouched = qkv[:, qk_size:].clone()
    cpu_rows.rope_(qkv, heads + kv_heads, head_dim, cos, sin)
    _close(qkv[:, :qk_size].reshape(want.shape), want)
    assert torch.equal(qkv[:, qk_size:], untouched)  # v is not rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("width", [1536, 37, 56])
def test_silu_mul_matches_torch(threads: int, dtype: torch.dtype, rows: int, width: int) -> None:
    gen = torch.Generator().manual_seed(rows * width)
    gate_up = (torch.randn(rows, 2 * width, generator=gen) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # e^-x over- and underflow
    gate, up = gate_up.chunk(2, dim=-1)
    _close(cpu_rows.silu_mul(gate_up), F.silu(gate) * up)


def test_refuses_what_it_does_not_take() -> None:
    assert not cpu_rows.supports(torch.zeros(4, 8, dtype=torch.float16))
    assert not cpu_rows.supports(torch.zeros(8, 4).t())  # not contiguous
    assert not cpu_rows.supports(torch.zeros(2, 3, 4))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batched_steps_use_them_and_match_the_torch_ops(
    tiny_model_dir, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill and decode steps of more rows than the fused path takes run the row ops
    natively and give the torch ops' greedy tokens and, to rounding, their logprobs. No
    packed copies: with panels for every projection a float32 model's wide decode steps are
    fused too (test_cpu_decode)."""
    from kvrelay import LLM, SamplingParams

    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    calls: list[int] = []
    real = cpu_rows.silu_mul
    monkeypatch.setattr(cpu_rows, "silu_mul", lambda g: calls.append(g.shape[0]) or real(g))
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2, dtype=dtype)
    calls.clear()  # the LLM's warm-up steps: this test counts its own generate's
    # no prompt a prefix of another (a batch shares common prefixes within a step): every
    # prompt token runs in the one prefill step counted below
    prompts = [{"prompt_token_ids": list(range(3 + 60 * i, 3 + 60 * i + n))}
               for i, n in enumerate(range(5, 5 + 3 * 12, 3))]  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=1)

    def generate():
        outs = llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]

    native_tokens, native_lp = generate()
    layers = llm.engine.config.model_config.num_layers
    assert len(prompts) > gemv.MAX_ROWS and calls.count(len(prompts)) == 4 * layers  # decode
    prompt_rows = sum(len(p["prompt_token_ids"]) for p in prompts)
    assert calls.count(prompt_rows) == layers  # the prefill step
    monkeypatch.setattr(cpu_rows, "supports", lambda x: False)
    calls.clear()
    torch_tokens, torch_lp = generate()
    assert not calls
    assert native_tokens == torch_tokens
    tol = 0.05 if dtype == "bfloat16" else 1e-4
    for a, b in zip(native_lp, torch_lp, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert abs(step_a.logprob - step_b.logprob) <= tol
