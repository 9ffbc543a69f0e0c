"""``LLMEngine.warm_up``: throwaway requests before a worker serves, leaving nothing behind."""

from __future__ import annotations

from kvrelay.engine.engine import LLMEngine
from kvrelay.protocol.sampling_params import SamplingParams
from tests.engine_steps import greedy_tokens


def _engine(model_dir, **kwargs) -> LLMEngine:
    return LLMEngine.from_args(model_dir, num_threads=2, seed=0, **kwargs)


def test_leaves_no_blocks_cache_entries_or_counts(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir)
    bm = engine.block_manager
    free_before = bm.num_free_blocks
    loader = engine.scheduler.prefix_loader
    seconds = engine.warm_up(prompt_len=100, batch=11)
    assert seconds > 0
    assert not engine.has_unfinished_requests()
    assert bm.num_free_blocks == free_before and bm.num_refs() == 0
    assert bm.cached_hashes() == [] and bm.num_cached_blocks == 0
    events = bm.pop_events()
    assert events.stored == [] and events.evicted == []
    assert bm.num_query_tokens == 0 and bm.num_hit_tokens == 0
    assert engine.scheduler.prefix_loader is loader
    bm.check_integrity()


def test_runs_every_kind_of_step(tiny_model_dir, monkeypatch) -> None:
    """A long prefill, a batch of more rows than the fused decode takes, and small steps."""
    engine = _engine(tiny_model_dir)
    rows: list[int] = []
    real = engine.runner.run
    monkeypatch.setattr(
        engine.runner, "run", lambda plan: rows.append(len(plan.scheduled)) or real(plan)
    )
    engine.warm_up(prompt_len=64, batch=10)
    assert max(rows) == 10 and min(rows) <= 8


def test_output_after_warm_up_is_a_fresh_engines(tiny_model_dir) -> None:
    prompts = [list(range(3, 3 + n)) for n in (5, 33, 17)]
    fresh = greedy_tokens(_engine(tiny_model_dir), prompts, 5)
    warmed = _engine(tiny_model_dir)
    warmed.warm_up()
    assert greedy_tokens(warmed, prompts, 5) == fresh


def test_fits_a_small_context_and_pool(tiny_model_dir) -> None:
    engine = _engine(tiny_model_dir, max_model_len=24, num_blocks=8, block_size=4)
    engine.warm_up()  # prompts capped to the context; a pool of 32 tokens takes turns
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_refs() == 0


def test_each_step_says_its_kind(tiny_model_dir) -> None:
    """``last_step_kind`` (the worker's ``kvrelay_engine_step_seconds{kind}``): prompt chunks
    only, decode tokens only, or both in one step."""
    engine = _engine(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    kinds = []
    engine.step()
    kinds.append(engine.last_step_kind)
    engine.step()
    kinds.append(engine.last_step_kind)
    engine.add_request("b", list(range(3, 12)), params)  # its prompt joins a's decode
    engine.step()
    kinds.append(engine.last_step_kind)
    assert kinds == ["prefill", "decode", "mixed"]


def test_offline_llm_warms_up_unless_told_not_to(tiny_model_dir, monkeypatch) -> None:
    """``LLM(...)`` runs the engine's warm-up before returning (as a serving worker does) and
    leaves nothing of it; ``warm_up=False`` skips it."""
    from kvrelay import LLM
    from kvrelay.engine.engine import LLMEngine

    runs: list[float] = []
    real = LLMEngine.warm_up
    monkeypatch.setattr(LLMEngine, "warm_up", lambda self: runs.append(real(self)) or runs[-1])
    llm = LLM(model=str(tiny_model_dir), seed=0)
    assert len(runs) == 1 and runs[0] > 0
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_query_tokens == 0  # the prefix-cache counters restored
    LLM(model=str(tiny_model_dir), seed=0, warm_up=False)
    assert len(runs) == 1
