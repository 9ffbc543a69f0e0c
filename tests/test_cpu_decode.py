"""``kernels.cpu_decode``: a decode step's layers in one native call, against the torch path."""

from __future__ import annotations

import pytest

from kvrelay.kernels import cpu_decode, cpu_rows, gemv

pytestmark = pytest.mark.skipif(not gemv.available(), reason="native library not built")


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

    steps: list[int] = []
    real = cpu_decode.FusedDecode.forward

    def spy(self, x, *args):
        steps.append(x.shape[0])
        return real(self, x, *args)

    monkeypatch.setattr(cpu_decode.FusedDecode, "forward", spy)
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


def test_not_used_for_prefill_or_large_batches(tiny_model_dir, monkeypatch) -> None:
    from kvrelay import LLM

    steps: list[int] = []
    real = cpu_decode.FusedDecode.forward
    monkeypatch.setattr(
        cpu_decode.FusedDecode,
        "forward",
        lambda self, x, *a: steps.append(x.shape[0]) or real(self, x, *a),
    )
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    steps.clear()  # the LLM's warm-up: this test counts its own generate's steps
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in range(5, 5 + gemv.MAX_ROWS + 2)]
    _generate(llm, prompts, max_tokens=3)
    assert not steps  # every decode step had MAX_ROWS + 2 tokens


def test_off_with_either_native_kernel_off(tiny_model_dir, monkeypatch) -> None:
    from kvrelay import LLM

    monkeypatch.setenv("KVRELAY_NATIVE_ATTENTION", "0")
    llm = LLM(model=str(tiny_model_dir), seed=0, num_threads=2)
    _generate(llm, [{"prompt_token_ids": [3, 4, 5]}], max_tokens=3)
    assert llm.engine.runner.model._fused is None
