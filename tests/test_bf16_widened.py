"""bfloat16 on a CPU where oneDNN does not compute it (an AVX2 CPU): products of more rows
than the native kernel takes run on float32 copies and round to bfloat16
(``gemv.widens_bfloat16``), both in torch's fallback and on the packed copies, which are
float32 there. ``widens_bfloat16`` is patched on, so the path runs on any CPU; on an AVX2 CPU
it is what the engine does unpatched."""

from __future__ import annotations

import logging

import pytest
import torch

from kvrelay.engine.engine import LLMEngine
from kvrelay.kernels import cpu_packed, gemv
from tests.engine_steps import greedy_tokens

needs_onednn = pytest.mark.skipif(
    not cpu_packed.supported(torch.float32), reason="this torch has no oneDNN"
)
BF16 = {"rtol": 1.6e-2, "atol": 2e-2}  # a bfloat16 result's rounding, against torch's


@pytest.fixture
def widened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gemv, "widens_bfloat16", lambda: True)


def _operands(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    w = torch.randn(96, 160, generator=g).bfloat16()  # [in, out]
    return x, w, torch.randn(160, generator=g).bfloat16()


@pytest.mark.usefixtures("widened")
@pytest.mark.parametrize("rows", [gemv.MAX_ROWS + 1, 64])
def test_the_torch_fallback_multiplies_float32_copies(rows: int) -> None:
    """Rows past the native kernel's: the result is bfloat16, torch's bfloat16 product up to
    rounding, and exactly the float32 product of the same values rounded once."""
    x, w, bias = _operands(rows, rows)
    got = gemv.matmul(x, w, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 160)
    torch.testing.assert_close(got, torch.addmm(bias, x, w), **BF16)
    exact = (x.double() @ w.double() + bias.double()).bfloat16()
    assert (got.float() - exact.float()).abs().max() <= exact.float().abs().max() * 2**-7
    got_nt = gemv.matmul_nt(x, w.t().contiguous())  # [n, k]: a tied embedding as the LM head
    assert got_nt.dtype == torch.bfloat16
    torch.testing.assert_close(got_nt, torch.mm(x, w), **BF16)


@needs_onednn
@pytest.mark.usefixtures("widened")
def test_packed_copies_of_bfloat16_weights_are_float32() -> None:
    x, w, bias = _operands(40, 7)
    assert cpu_packed.supported(torch.bfloat16)
    assert cpu_packed.packed_dtype(torch.bfloat16) == torch.float32
    assert cpu_packed.copy_bytes(w) == 2 * w.nbytes
    packed = cpu_packed.pack(w, transposed=True)
    assert packed.dtype == torch.float32
    got = cpu_packed.linear(x, packed, bias)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, torch.addmm(bias, x, w), **BF16)
    # the widened product is the float32 one of the same values, rounded once
    want = cpu_packed.linear(x.float(), cpu_packed.pack(w.float(), transposed=True), bias.float())
    assert torch.equal(got, want.bfloat16())
    # torch's fallback (before the copies exist, or with none) gives the same sums: a step
    # does not depend on whether they are there yet
    assert torch.equal(gemv.matmul(x, w, bias), got)
    packed_nk = cpu_packed.pack(w.t().contiguous(), transposed=False)
    assert torch.equal(gemv.matmul_nt(x, w.t().contiguous()), cpu_packed.linear(x, packed_nk))


@needs_onednn
@pytest.mark.usefixtures("widened")
def test_a_bfloat16_engine_packs_float32_copies_and_uses_them(
    tiny_model_dir, monkeypatch, caplog
) -> None:
    """The engine packs float32 copies (the log names their size: twice the weights') and
    steps of many rows run on them, to the greedy tokens of the torch fallback (which also
    widens: the same products and sums)."""
    prompts = [[(n * 37 + t * 11) % 500 + 4 for t in range(8 + n)] for n in range(10)]
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    want = greedy_tokens(
        LLMEngine.from_args(tiny_model_dir, dtype="bfloat16", num_threads=1, seed=0), prompts, 4
    )
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")
    with caplog.at_level(logging.INFO, logger="kvrelay.engine.models.llama"):
        engine = LLMEngine.from_args(tiny_model_dir, dtype="bfloat16", num_threads=1, seed=0)
    model = engine.runner.model
    assert model.packed and all(p.dtype == torch.float32 for p in model.packed.values())
    assert model.native_rows == gemv.MAX_ROWS  # bfloat16 rows stay native up to 8 here
    size = sum(2 * model.weights[n].nbytes for n in model.packed)
    assert f"{size / 1e6:.0f} MB beside the plain ones" in caplog.text
    calls: list[tuple[torch.dtype, int]] = []
    real = cpu_packed.linear
    monkeypatch.setattr(
        cpu_packed, "linear", lambda x, *a: calls.append((x.dtype, x.shape[0])) or real(x, *a)
    )
    assert greedy_tokens(engine, prompts, 4) == want
    assert calls and {dtype for dtype, _ in calls} == {torch.bfloat16}  # into float32 copies
    assert min(rows for _, rows in calls) > gemv.MAX_ROWS  # the ten decode rows, the prompts
