"""Prompt and mixed steps as CUDA graphs (``cuda_graphs.StepGraphs``, ``LayerGraphs``), run
here on CPU.

On a GPU a whole step is one CUDA graph per padded token count, its attention reading the
step's metadata from static buffers (``StepGraphs``); with SDPA's prefill, the layers around
attention are graphs and attention runs eagerly between them (``LayerGraphs``).
``tests/test_cuda.py`` checks both against the reference where a GPU is present.
``capture=False`` runs the very same padded steps through the same static buffers without
capturing, so on CPU a real engine's prompt and mixed steps check what the graphs replay:
``StepGraphs`` with Triton's kernels in the interpreter (conftest sets ``TRITON_INTERPRET=1``
where there is no GPU), ``LayerGraphs`` with the CPU's attention. Every step's hidden states
must match the plain forward's rows, and greedy generations must be token for token the plain
engine's.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.cuda_graphs import (
    TOKEN_SIZES,
    LayerGraphs,
    StepGraphs,
    no_collection,
    token_sizes,
)
from kvrelay.engine.engine import step_kind
from kvrelay.kernels import attention, cpu_attention, triton_attention

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


def _triton_on_cpu(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU's attention path on CPU tensors: prompt segments as ``PrefillBatch`` tiles and
    the store and decode in Triton's kernels (interpreted), as a CUDA engine runs them."""
    runner = llm.engine.runner
    cfg = runner.model.config
    runner.native_prefill_tokens = 0
    runner.prefill_tile_tokens = triton_attention.prefill_tile_tokens(
        cfg.num_heads // cfg.num_kv_heads
    )
    monkeypatch.setattr(attention, "store_kv", triton_attention.store_kv)
    monkeypatch.setattr(cpu_attention, "decode", triton_attention.decode)


@pytest.mark.skipif(not triton_attention.interpreted(), reason="needs Triton's interpreter")
def test_whole_step_graphs_reproduce_every_step(tiny_model_dir, monkeypatch):
    """Steps of 1-32 tokens padded to 16-32 tokens and a scratch row, their attention reading
    static metadata: padding slots -1, padding decode rows of context 0 on the scratch row,
    padding tiles of no rows. Each step's hidden states are the unpadded step's, and the
    generations are the plain engine's (the same kernels, unpadded), token for token.

    Every interpreted step takes seconds whatever its rows (its grids are the padded size's):
    three tokens each make three prompt steps, a mixed one, a decode step of 3 rows and, the
    last prompt having joined a step later, one of 1 row, and no more."""
    params = [SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)] * 3
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]

    def engine() -> LLM:
        llm = LLM(tiny_model_dir, num_blocks=64, max_num_batched_tokens=32, max_num_seqs=4,
                  warm_up=False)  # fmt: skip
        _triton_on_cpu(llm, monkeypatch)
        return llm

    expected = [o.outputs[0].token_ids for o in engine().generate(prompts, params)]
    llm = engine()
    runner = llm.engine.runner
    steps = StepGraphs(runner.model, runner.kv_cache, 32, 4, 8, runner.prefill_tile_tokens,
                       runner.window, capture=False)  # fmt: skip
    assert steps.sizes == (16, 32) and steps.max_tiles(32) == 1 + 4
    forward, checked, kinds = runner.model.forward, [], []

    def both(input_ids, positions, kv_cache, meta):
        plain = forward(input_ids, positions, kv_cache, meta)
        assert steps.fits(input_ids.numel(), meta)
        got = steps.run(input_ids, positions, meta).clone()  # calls forward: padded, static
        torch.testing.assert_close(got, plain, rtol=1e-4, atol=1e-4)
        checked.append((input_ids.numel(), meta.native_prefill is not None))
        return got

    run = runner.run

    def recording(plan):
        kinds.append(step_kind(plan))
        return run(plan)

    def forward_of(*args):  # the pieces' own forward calls come through here too
        if args[0].data_ptr() == steps.input_ids.data_ptr():
            return forward(*args)
        return both(*args)

    monkeypatch.setattr(runner.model, "forward", forward_of)
    monkeypatch.setattr(runner, "run", recording)
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert {"prefill", "mixed", "decode"} <= set(kinds)
    assert any(tiles for _, tiles in checked) and any(n not in steps.sizes for n, _ in checked)
    assert steps.replays == len(checked) and set(steps.graphs) == {16, 32}
    llm.engine.block_manager.check_integrity()


def test_whole_step_graphs_refuse_what_they_cannot_hold(tiny_model_dir, monkeypatch):
    """Over the largest size, SDPA's segments, CPU's prefill rows or tables wider than the
    static ones: the step is not for a graph."""
    llm = LLM(tiny_model_dir, num_blocks=64, warm_up=False)
    runner = llm.engine.runner
    steps = StepGraphs(runner.model, runner.kv_cache, 32, 4, 8, 64, None, capture=False)
    rows = torch.zeros(2, dtype=torch.long)
    narrow = cpu_attention.NativeDecode(rows, torch.zeros(2, 16, dtype=torch.int32),
                                        torch.ones(2, dtype=torch.int32))  # fmt: skip
    wide = cpu_attention.NativeDecode(rows, torch.zeros(2, 32, dtype=torch.int32),
                                      torch.ones(2, dtype=torch.int32))  # fmt: skip
    slots = torch.zeros(2, dtype=torch.long)
    assert steps.fits(2, attention.AttentionMetadata(slot_mapping=slots, native_decode=narrow))
    assert not steps.fits(33, attention.AttentionMetadata(slot_mapping=slots))
    assert not steps.fits(2, attention.AttentionMetadata(slot_mapping=slots, native_decode=wide))
    shared = cpu_attention.NativeDecode(narrow.rows, narrow.tables, narrow.ctx_lens,
                                        torch.zeros(2, dtype=torch.int32))  # fmt: skip
    assert not steps.fits(2, attention.AttentionMetadata(slot_mapping=slots, native_decode=shared))
    segment = attention.PrefillSegment(0, 2, None, 2, None)
    assert not steps.fits(2, attention.AttentionMetadata(slot_mapping=slots, prefills=[segment]))
    many = triton_attention.make_prefill([(i, 0, 1, [i]) for i in range(5)], 64)
    assert not steps.fits(5, attention.AttentionMetadata(slot_mapping=slots, native_prefill=many))
    four = triton_attention.make_prefill([(i, 0, 1, [i]) for i in range(4)], 64)
    assert steps.fits(5, attention.AttentionMetadata(slot_mapping=slots, native_prefill=four))
    with pytest.raises(ValueError, match="CUDA KV pool"):
        StepGraphs(runner.model, runner.kv_cache, 32, 4, 8, 64, None)
