"""``kernels.cpu_decode``: a decode step's layers in one native call, against the torch path."""

from __future__ import annotations

import pytest
import torch

from kvrelay.kernels import cpu_decode, cpu_packed, cpu_panels, cpu_rows, gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="native library not built")


def _fused_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The rows of every native whole-step call from now on (FusedDecode.forward spied)."""
    steps: list[int] = []
    real = cpu_decode.FusedDecode.forward

    def spy(self, x, *args):
        steps.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(cpu_decode.FusedDecode, "forward", spy)
    return steps


def _generate(llm, prompts, max_tokens=6):
    from kvrelay import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)
    outs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_steps_match_the_torch_ops(
    tiny_model_dir, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of up to gemv.MAX_ROWS tokens run natively (one call per step, every
    layer), and give the torch path's greedy tokens and, to rounding, its logprobs."""
    from kvrelay import LLM

    steps = _fused_steps(monkeypatch)
    modes: list[bool] = []  # the pool mode each step asked for
    real_mode = gemv.use_openmp
    monkeypatch.setattr(gemv, "use_openmp", lambda on: modes.append(on) or real_mode(on))
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2, dtype=dtype)
    assert steps  # the LLM's warm-up ends with lone decode steps, fused
    steps.clear()
    modes.clear()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 40, 17)]
    fused_tokens, fused_lp = _generate(llm, prompts)
    assert steps == [3] * 5  # the prefill step is torch's; then 5 steps of 3 decode tokens
    # the prefill step joins torch's OpenMP team; the decode steps (torch on one thread) keep
    # the library's own pool
    assert modes == [True] + [False] * 5
    model = llm.engine.runner.model
    monkeypatch.setattr(model, "_fused_for", lambda *a: None)
    monkeypatch.setattr(cpu_rows, "supports", lambda x: False)  # torch's ops, not rows.c's
    steps.clear()
    torch_tokens, torch_lp = _generate(llm, prompts)
    assert not steps
    assert fused_tokens == torch_tokens
    tol = 0.05 if dtype == "bfloat16" else 1e-4
    for a, b in zip(fused_lp, torch_lp, strict=True):
        for step_a, step_b in zip(a, b, strict=True):
            assert abs(step_a.logprob - step_b.logprob) <= tol


def test_not_used_for_prefill_or_large_batches_without_panels(tiny_model_dir, monkeypatch) -> None:
    """Without panels for every projection (here no packed copies at all) a step of more
    than gemv.MAX_ROWS rows is the torch path's, and a prefill step always is."""
    from kvrelay import LLM

    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "0")

    steps = _fused_steps(monkeypatch)
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    steps.clear()  # the LLM's warm-up: this test counts its own generate's steps
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in range(5, 5 + gemv.MAX_ROWS + 2)]
    _generate(llm, prompts, max_tokens=3)
    assert llm.engine.runner.model.packed == {}
    assert not steps  # every decode step had MAX_ROWS + 2 tokens


def test_off_with_either_native_kernel_off(tiny_model_dir, monkeypatch) -> None:
    from kvrelay import LLM

    monkeypatch.setenv("KVRELAY_NATIVE_ATTENTION", "0")
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    _generate(llm, [{"prompt_token_ids": [3, 4, 5]}], max_tokens=3)
    assert llm.engine.runner.model._fused is None


@pytest.mark.skipif(not cpu_panels.available(), reason="native library not built")
def test_wide_decode_steps_run_natively_on_panels(
    tiny_model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model whose projections have panels runs decode steps of more than
    gemv.MAX_ROWS rows in one native call too, with the torch path's greedy tokens and
    logprobs bit for bit: the same panel products, row ops and attention, in the same order."""
    from kvrelay import LLM

    monkeypatch.setattr(cpu_packed, "kernel", lambda: "panels")  # whatever this CPU prefers
    monkeypatch.setenv("KVRELAY_CPU_PACKED_WEIGHTS", "1")  # packed before the first step
    steps = _fused_steps(monkeypatch)
    # no prefix cache: the second generate must prefill its prompts whole, as the first does
    # (a cached prefix leaves a different tail of each prompt to prefill, whose attention
    # sums, blocks of rows or a row alone, are not this test's subject)
    llm = LLM(
        model=str(tiny_model_dir), seed=0, num_threads=2, dtype="float32",
        enable_prefix_caching=False,
    )  # fmt: skip
    model = llm.engine.runner.model
    assert model.wait_packed()
    assert cpu_decode.wide_panels(model.config, model.weights, model.packed) is not None
    rows = gemv.MAX_ROWS + 4
    prompts = [{"prompt_token_ids": list(range(3 + n, 20 + 3 * n))} for n in range(rows)]
    steps.clear()
    fused_tokens, fused_lp = _generate(llm, prompts)
    assert steps == [rows] * 5  # every decode step of the batch, natively
    monkeypatch.setattr(model, "_fused_for", lambda *a: None)
    steps.clear()
    torch_tokens, torch_lp = _generate(llm, prompts)
    assert not steps
    assert fused_tokens == torch_tokens
    for a, b in zip(fused_lp, torch_lp, strict=True):
        assert [s.logprob for s in a] == [s.logprob for s in b]


def test_wide_panels_need_every_projection_of_a_float32_model(tiny_model_dir) -> None:
    """Steps of more rows than gemv's stay on the torch path while any projection lacks its
    panels (still packing, or oneDNN's copies) or the model is not float32."""
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import load_weights

    config = ModelConfig.from_dir(tiny_model_dir)
    weights = load_weights(tiny_model_dir, config, "float32")
    names = [
        f"layers.{i}.{n}" for i in range(config.num_layers) for n in ("qkv", "o", "gate_up", "down")
    ]
    panels = {n: cpu_panels.pack(weights[n], transposed=True) for n in names}
    assert cpu_decode.wide_panels(config, weights, panels) == panels
    assert cpu_decode.wide_panels(config, weights, dict(list(panels.items())[:-1])) is None
    onednn = dict(panels, **{names[0]: weights[names[0]]})  # a oneDNN copy is a tensor
    assert cpu_decode.wide_panels(config, weights, onednn) is None
    bf16 = {n: w.to(torch.bfloat16) for n, w in weights.items()}
    assert cpu_decode.wide_panels(config, bf16, panels) is None
