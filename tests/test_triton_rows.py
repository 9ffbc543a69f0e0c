"""A layer's small ops in Triton (``kernels.triton_rows``) against the torch ops they replace.

On a machine without a GPU they run on CPU tensors in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``); where CUDA is present also compiled on the GPU (the ``gpu`` marker).
16-bit results must equal torch's bit for bit but for rare last-bit differences (the norm's
sum of squares in another order, ``exp`` in SiLU): at most one unit in the last place, on
under 1% of the values; float32 within a few units of float32's last place.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvrelay.engine.models import llama
from kvrelay.kernels import triton_attention, triton_rows

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(
            not (triton_attention.available() and triton_attention.interpreted()),
            reason="CPU tensors need Triton and TRITON_INTERPRET=1 before triton is imported",
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
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_like_torch(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        return
    differ = got != want
    if differ.any():
        # one unit in the last place at most, on under 1% of the values
        step = (want.float().abs() * 2.0 ** -(7 if want.dtype == torch.bfloat16 else 10)).clamp(
            min=1e-6
        )
        assert ((got.float() - want.float()).abs() <= step * 1.01).all()
        assert differ.float().mean().item() < 0.01


def rand(*shape: int, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(dtype).to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (33, 2048)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_torchs(device, dtype, rows, width, with_delta):
    x = rand(rows, width, dtype=dtype, device=device, seed=rows + width)
    delta = rand(rows, width, dtype=dtype, device=device, seed=7) if with_delta else None
    weight = (1 + 0.1 * rand(width, dtype=torch.float32, device=device, seed=3)).to(dtype)
    want_x = x + delta if with_delta else x.clone()
    want_h = llama.rms_norm(want_x, weight, 1e-5)
    before = x.data_ptr()
    h = triton_rows.add_rms_norm(x, delta, weight, 1e-5)
    assert x.data_ptr() == before
    assert torch.equal(x, want_x)  # the residual sum is one rounding: exact
    assert_like_torch(h, want_h)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 80), (2, 1, 16)])
def test_rope_rotates_q_and_k_in_place_as_torch(device, dtype, heads, kv_heads, head_dim):
    tokens = 5
    width = (heads + 2 * kv_heads) * head_dim
    qkv = rand(tokens, width, dtype=dtype, device=device, seed=heads * head_dim)
    positions = torch.tensor([0, 3, 17, 900, 4095], device=device)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    freqs = positions.float().unsqueeze(1) * inv_freq.unsqueeze(0)
    cos, sin = freqs.cos().to(dtype).unsqueeze(1), freqs.sin().to(dtype).unsqueeze(1)
    qk = heads + kv_heads
    want = qkv.clone()
    want[:, : qk * head_dim] = llama.apply_rope(
        qkv[:, : qk * head_dim].view(tokens, qk, head_dim), cos, sin
    ).reshape(tokens, -1)
    triton_rows.rope_(qkv, qk, head_dim, cos, sin)
    assert torch.equal(qkv[:, qk * head_dim :], want[:, qk * head_dim :])  # v untouched
    if dtype == torch.float32:
        assert_like_torch(qkv, want)
    else:
        assert torch.equal(qkv, want)  # each product and sum rounded as torch rounds them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (6, 100), (3, 2500)])
def test_silu_mul_is_torchs(device, dtype, rows, n):
    gate_up = rand(rows, 2 * n, dtype=dtype, device=device, seed=n) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert_like_torch(triton_rows.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("device", DEVICES)
def test_no_rows_launch_nothing(device):
    x = torch.empty(0, 64, device=device)
    assert triton_rows.add_rms_norm(x, None, torch.ones(64, device=device), 1e-6).shape == (0, 64)
    assert triton_rows.silu_mul(torch.empty(0, 64, device=device)).shape == (0, 32)


def test_bad_shapes_are_named():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="does not match"):
        triton_rows.add_rms_norm(x, torch.zeros(2, 4), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="does not fit"):
        triton_rows.add_rms_norm(x, None, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="do not fit"):
        triton_rows.rope_(x, 3, 4, torch.zeros(2, 2), torch.zeros(2, 2))


def test_torchs_ops_stay_on_cpu_and_when_turned_off(monkeypatch):
    """The model takes Triton's row ops for CUDA activations only, and not with
    ``KVRELAY_TRITON_ROWS=0``."""
    x = torch.zeros(3, 8, dtype=torch.float16)  # no CPU library path for float16
    assert llama.row_ops(x, gpu_rows=True) is None
    if triton_attention.available() and triton_attention.interpreted():
        assert triton_rows.supports(x)  # the kernels could run it; the model does not ask
    monkeypatch.setenv("KVRELAY_TRITON_ROWS", "0")
    assert not triton_rows.supports(x)


@pytest.mark.skipif(
    not (triton_attention.available() and triton_attention.interpreted()),
    reason="CPU tensors need Triton and TRITON_INTERPRET=1 before triton is imported",
)
def test_a_model_on_the_triton_row_ops_generates_torchs_tokens(tiny_model_dir, monkeypatch):
    """The model's layers wired to the row ops (as on a GPU) give the torch ops' greedy
    tokens: a CPU engine, layer by layer (no whole-step native path), the kernels in
    Triton's interpreter (after the engine's warm-up, whose large steps it would take long
    over)."""
    from kvrelay import SamplingParams
    from kvrelay.engine.llm import LLM

    monkeypatch.setattr(llama.LlamaModel, "_fused_for", lambda self, *args: None)
    prompts = ["The cache moves to the decode worker", "a"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    tokens, calls = {}, []

    def triton_ops(x: torch.Tensor, gpu_rows: bool):
        calls.append(x.shape[0])
        return triton_rows

    for name, ops in (("torch", lambda x, gpu_rows: None), ("triton", triton_ops)):
        llm = LLM(tiny_model_dir, dtype="float32")
        monkeypatch.setattr(llama, "row_ops", ops)
        tokens[name] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert calls  # the layers took the Triton row ops
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 6 for t in tokens["torch"])
