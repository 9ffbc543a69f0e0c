"""The forward in pieces around attention (``cuda_graphs.LayerGraphs``), run here on CPU.

On a GPU the pieces are CUDA graphs, captured per padded token count and replayed with each
layer's attention run eagerly between them (``tests/test_cuda.py`` checks that against the
reference where a GPU is present). ``capture=False`` runs the very same pieces, through the
same static buffers and the same padding, without capturing: so on CPU a real engine's
prompt and mixed steps check what the graphs replay. Every step's hidden states must match
the plain forward's rows, and greedy generations must be token for token the plain engine's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.cuda_graphs import TOKEN_SIZES, LayerGraphs, no_collection, token_sizes
from kvrelay.engine.engine import step_kind

PROMPTS = [
    "Prefill computes the prompt; decode continues it token by token. " * 5,
    "a",
    "The cache moves to the decode worker",
    "数据在两个进程之间移动 🚀 " * 3,
]
LENGTHS = [12, 20, 7, 16]  # staggered ends: later prompts join running decodes (mixed steps)


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in LENGTHS]


def test_token_sizes_cover_the_step_budget_and_grow_by_at_most_half():
    assert token_sizes(2048)[-1] == 2048
    assert token_sizes(160) == (16, 32, 48, 64, 96, 128, 192)
    assert token_sizes(1) == (16,)
    assert token_sizes(10**6) == TOKEN_SIZES
    assert all(b <= a * 1.5 for a, b in itertools.pairwise(TOKEN_SIZES[1:]))


def test_a_cpu_pool_cannot_be_captured(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=64, warm_up=False)
    runner = llm.engine.runner
    assert runner.layer_graphs is None  # a CPU engine has none
    with pytest.raises(ValueError, match="CUDA KV pool"):
        LayerGraphs(runner.model, runner.kv_cache, 256)


def test_pieces_reproduce_every_prompt_and_mixed_step(tiny_model_dir, monkeypatch):
    """Steps of 1-64 tokens padded to 16-64 rows: each step's hidden states from the pieces
    (attention between them over the real rows alone) are the plain forward's, and the
    generations are the plain engine's, token for token."""
    expected = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, num_blocks=128,
                max_num_batched_tokens=64, warm_up=False).generate(PROMPTS, _params())]  # fmt: skip

    llm = LLM(tiny_model_dir, num_blocks=128, max_num_batched_tokens=64, warm_up=False)
    runner = llm.engine.runner
    pieces = LayerGraphs(runner.model, runner.kv_cache, 64, capture=False)
    assert pieces.sizes == (16, 32, 48, 64)
    forward, checked = runner.model.forward, []

    def both(input_ids, positions, kv_cache, meta):
        plain = forward(input_ids, positions, kv_cache, meta)  # stores the step's K/V
        # the pieces store the same K/V in the same slots again, then attend over them
        got = pieces.run(input_ids, positions, meta).clone()
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
        checked.append(input_ids.numel())
        return got

    run, kinds = runner.run, []

    def recording(plan):
        kinds.append(step_kind(plan))
        return run(plan)

    monkeypatch.setattr(runner.model, "forward", both)
    monkeypatch.setattr(runner, "run", recording)
    outs = llm.generate(PROMPTS, _params())
    assert [o.outputs[0].token_ids for o in outs] == expected
    sizes = set(checked)
    assert max(sizes) > 16 and any(n not in pieces.sizes for n in sizes)  # padded steps
    assert set(pieces.pieces) <= set(pieces.sizes) and len(pieces.pieces) > 1
    assert pieces.replays == len(checked)
    assert 64 in sizes  # the long prompt fills the step budget: it comes in chunks
    assert {"prefill", "mixed", "decode"} <= set(kinds)
    llm.engine.block_manager.check_integrity()


def test_the_runner_serves_through_the_pieces(tiny_model_dir):
    """Installed as the runner's ``layer_graphs`` (as on a GPU), the pieces take every step
    the decode graphs cannot (here: all of them) and the tokens stay the plain engine's."""
    params = _params()
    expected = [o.outputs[0].token_ids for o in LLM(tiny_model_dir, num_blocks=128,
                max_num_batched_tokens=48, warm_up=False).generate(PROMPTS, params)]  # fmt: skip
    llm = LLM(tiny_model_dir, num_blocks=128, max_num_batched_tokens=48, warm_up=False)
    runner = llm.engine.runner
    runner.layer_graphs = LayerGraphs(runner.model, runner.kv_cache, 48, capture=False)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)] == expected
    assert runner.layer_graphs.replays > sum(LENGTHS) // len(LENGTHS)


def test_captures_run_with_the_collector_off_and_restore_it():
    """A collection inside a capture could destroy an old engine's graphs, which invalidates
    the capture: captures run under ``no_collection``, which restores the collector's state
    after, on an exception too, and leaves a disabled collector disabled."""
    import gc

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
