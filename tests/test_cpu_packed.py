"""``KVRELAY_CPU_PACKED_WEIGHTS``: float32 / bfloat16 weights packed for oneDNN, used for steps
of more than ``gemv.MAX_ROWS`` rows, give what torch's ``mm`` on the plain weights gives; unset,
an engine packs when the copy fits in memory."""

from __future__ import annotations

import logging

import pytest
import torch

from kvrelay.engine.engine import LLMEngine
from kvrelay.kernels import cpu_packed, cpu_panels, gemv
from tests.engine_steps import greedy_tokens

needs_bf16 = pytest.mark.skipif(
    not cpu_packed.supported(torch.bfloat16), reason="this CPU's oneDNN has no bfloat16 compute"
)
needs_onednn = pytest.mark.skipif(
    not cpu_packed.supported(torch.float32), reason="this torch has no oneDNN"
)


@pytest.mark.parametrize("kind", ["onednn", "panels"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [9, 32, 100])
def test_packed_linear_matches_torch_in_both_layouts(
    rows: int, dtype: torch.dtype, kind: str, monkeypatch
) -> None:
    """Both packed kernels, whichever ``KVRELAY_CPU_PACKED_KERNEL`` picks on this CPU."""
    if kind == "panels" and not cpu_panels.available():
        pytest.skip("kvrelay's native library is not built")
    monkeypatch.setattr(cpu_packed, "kernel", lambda: kind)
    if kind == "onednn" and not (torch.backends.mkldnn.is_available()):
        pytest.skip("this torch has no oneDNN")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 192, generator=g).to(dtype)
    w_kn = torch.randn(192, 320, generator=g).to(dtype)  # [in, out], kvrelay's projections
    bias = torch.randn(320, generator=g).to(dtype)
    tol = (
        {"rtol": 1.6e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-4}
    )
    want = torch.addmm(bias, x, w_kn)
    got = cpu_packed.linear(x, cpu_packed.pack(w_kn, transposed=True), bias)
    assert got.dtype == dtype and got.shape == (rows, 320)
    torch.testing.assert_close(got, want, **tol)
    w_nk = w_kn.t().contiguous()  # [out, in]: a tied embedding as the LM head
    got_nk = cpu_packed.linear(x, cpu_packed.pack(w_nk, transposed=False))
    torch.testing.assert_close(got_nk, torch.mm(x, w_kn), **tol)


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("float32", marks=needs_onednn), pytest.param("bfloat16", marks=needs_bf16)],
)
def test_an_engine_packs_and_generates_the_same_tokens(real_model_dir, monkeypatch, dtype) -> None:
    """SmolLM2: twelve prompts batched (decode steps of 12 rows, prefills of hundreds) give
    the same greedy tokens with the packed weights as without."""
    prompts = [[(n * 131 + t * 7919) % 49000 + 4 for t in range(20 + 3 * n)] for n in range(12)]
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    plain = LLMEngine.from_args(real_model_dir, dtype=dtype, num_threads=2, seed=0)
    assert plain.runner.model.packed == {}
    want = greedy_tokens(plain, prompts, 6)
    del plain
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")
    engine = LLMEngine.from_args(real_model_dir, dtype=dtype, num_threads=2, seed=0)
    model = engine.runner.model
    assert set(model.packed) == {
        f"layers.{i}.{n}" for i in range(model.config.num_layers)
        for n in ("qkv", "o", "gate_up", "down")
    } | {"embed"}  # fmt: skip
    calls: list[int] = []
    real = cpu_packed.linear
    monkeypatch.setattr(cpu_packed, "linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    # the same sums as the plain path's: bfloat16 products of many rows on plain weights
    # run the packed copies' kernel (panels or oneDNN) too, so the tokens are the same
    assert greedy_tokens(engine, prompts, 6) == want
    assert calls and min(calls) > model.native_rows  # used, and only for steps of many rows


def test_asked_for_where_it_does_not_apply_it_warns_and_packs_nothing(
    tiny_model_dir, monkeypatch, caplog
) -> None:
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")
    with caplog.at_level(logging.WARNING, logger="kvrelay.kernels.cpu_packed"):
        engine = LLMEngine.from_args(tiny_model_dir, dtype="float16", num_threads=1, seed=0)
    assert engine.runner.model.packed == {}
    assert "KVRELAY_CPU_PACKED_WEIGHTS ignored" in caplog.text and "float16" in caplog.text


@pytest.mark.skipif(
    gemv.widens_bfloat16(), reason="oneDNN has no bfloat16 here: float32 copies, limit 8 rows"
)
def test_bfloat16_steps_over_four_rows_take_the_packed_copies(tiny_model_dir, monkeypatch) -> None:
    """With packed bfloat16 weights, decode steps of 5-8 rows run on oneDNN's copies (gemv's
    widened float32 products are compute-bound there), steps of up to 4 stay native; the
    greedy tokens are those of the engine without packed weights. oneDNN's copies whatever
    this CPU's default kind (panels' copies are float32 and keep 8: ``native_rows``)."""
    monkeypatch.setattr(cpu_panels, "chosen", lambda: False)
    prompts = [[(n * 37 + t * 11) % 500 + 4 for t in range(8 + n)] for n in range(6)]
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    plain = LLMEngine.from_args(tiny_model_dir, dtype="bfloat16", num_threads=2, seed=0)
    assert plain.runner.model.native_rows == gemv.MAX_ROWS  # nothing packed: all native
    want = greedy_tokens(plain, prompts, 4)
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")
    engine = LLMEngine.from_args(tiny_model_dir, dtype="bfloat16", num_threads=2, seed=0)
    assert engine.runner.model.native_rows == cpu_packed.NATIVE_ROWS_BF16 < gemv.MAX_ROWS
    rows: list[int] = []
    real = cpu_packed.linear
    monkeypatch.setattr(cpu_packed, "linear", lambda x, *a: rows.append(x.shape[0]) or real(x, *a))
    assert greedy_tokens(engine, prompts, 4) == want
    assert 6 in rows  # the six sequences' decode steps
    rows.clear()
    assert greedy_tokens(engine, prompts[:3], 4) == want[:3]
    assert all(n > 3 for n in rows)  # the prompts' step only: 3-row decode steps stay native


@needs_onednn
def test_an_untied_lm_head_is_packed_and_used(tiny_model_dir, monkeypatch) -> None:
    """make-tiny's LM head is its own weight (not the embedding): packed as ``lm_head`` and
    used for logits of more than ``gemv.MAX_ROWS`` rows, to the same greedy tokens."""
    prompts = [[(n * 37 + t * 11) % 500 + 4 for t in range(8 + n)] for n in range(10)]
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    plain = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0)
    assert plain.runner.model.packed == {}
    want = greedy_tokens(plain, prompts, 4)
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")
    engine = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0)
    assert "lm_head" in engine.runner.model.packed and "embed" not in engine.runner.model.packed
    widths: list[int] = []
    real = cpu_packed.linear
    monkeypatch.setattr(
        cpu_packed, "linear", lambda x, p, *a: widths.append(p.shape[0]) or real(x, p, *a)
    )
    assert greedy_tokens(engine, prompts, 4) == want
    vocab = engine.runner.model.weights["lm_head"].shape[1]
    assert vocab in widths  # the LM head ran on its packed copy


@needs_onednn
def test_unset_packs_when_the_copy_fits_in_a_quarter_of_available_memory(
    tiny_model_dir, monkeypatch, caplog
) -> None:
    monkeypatch.delenv("KVRELAY_CPU_PACKED_WEIGHTS", raising=False)
    available = cpu_packed.memory_available()
    assert available is not None and available > 0  # read from /proc/meminfo
    with caplog.at_level(logging.INFO, logger="kvrelay.kernels.cpu_packed"):
        engine = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0)
    assert "packing (in the background) the weights" in caplog.text
    assert engine.runner.model.wait_packed(timeout=60)  # on a thread: the engine did not wait
    packed = engine.runner.model.packed
    assert packed
    size = sum(engine.runner.model.weights[n].nbytes for n in packed)
    caplog.clear()
    # the same copy on a host with less than four times its size available: not packed
    monkeypatch.setattr(cpu_packed, "memory_available", lambda: 4 * size - 1)
    with caplog.at_level(logging.INFO, logger="kvrelay.kernels.cpu_packed"):
        engine = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0)
    assert engine.runner.model.packed == {}
    copy = f"the copy is {size / 1e6:.0f} MB"
    assert f"not packing the weights ({cpu_packed.kernel()}): {copy}" in caplog.text
    assert engine.runner.model.wait_packed() and engine.runner.model.packed == {}
    monkeypatch.setattr(cpu_packed, "memory_available", lambda: 4 * size)
    model = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0).runner.model
    assert model.wait_packed(timeout=60) and set(model.packed) == set(packed)
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    model = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0).runner.model
    assert model.wait_packed() and model.packed == {}


def test_unset_where_it_does_not_apply_packs_nothing_and_does_not_warn(
    tiny_model_dir, monkeypatch, caplog
) -> None:
    monkeypatch.delenv("KVRELAY_CPU_PACKED_WEIGHTS", raising=False)
    with caplog.at_level(logging.WARNING, logger="kvrelay.kernels.cpu_packed"):
        engine = LLMEngine.from_args(tiny_model_dir, dtype="float16", num_threads=1, seed=0)
    assert engine.runner.model.packed == {} and "ignored" not in caplog.text


@needs_onednn
def test_steps_run_while_the_weights_are_packed_in_the_background(
    tiny_model_dir, monkeypatch
) -> None:
    """Unset, the engine serves on the plain weights while a thread packs them, then on the
    packed ones: the same greedy tokens before, during and after; the offline LLM waits."""
    prompts = [[(n * 37 + t * 11) % 500 + 4 for t in range(8 + n)] for n in range(10)]
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")
    want = greedy_tokens(LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0), prompts, 4)
    monkeypatch.delenv("KVRELAY_CPU_PACKED_WEIGHTS")
    engine = LLMEngine.from_args(tiny_model_dir, num_threads=1, seed=0)
    assert greedy_tokens(engine, prompts, 4) == want  # whichever weights each step found
    assert engine.runner.model.wait_packed(timeout=60) and engine.runner.model.packed
    assert greedy_tokens(engine, prompts, 4) == want
    from kvrelay import LLM

    assert LLM(tiny_model_dir, num_blocks=64, warm_up=False).engine.runner.model.packed
