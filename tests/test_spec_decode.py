"""Speculative decoding with n-gram drafts (engine.spec_decode): the proposer, the settings,
and the engine's outputs against the same engine without drafts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.engine.config import ConfigError
from kvrelay.engine.spec_decode import accepted, ngram_draft
from kvrelay.protocol.sampling_params import StructuredOutput
from kvrelay.protocol.speculative import SpeculativeConfig, SpeculativeConfigError
from tests.structured_cases import MAX_TOKENS, SCHEMAS, spec_text

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}

# token-id prompts that repeat, so a random model's greedy continuation often copies them
PROMPTS = [
    [5, 6, 7, 8, 9, 10] * 6,
    list(range(40, 70)) + list(range(40, 55)),
    [11, 12, 13, 14] * 3 + [200, 201, 202, 11, 12],
    [300 + i % 7 for i in range(50)],
]


def _draft(tokens: list[int], k: int = 3, low: int = 1, high: int = 3) -> list[int]:
    return ngram_draft(np.array(tokens, dtype=np.int64), k, low, high)


def test_ngram_draft_takes_the_longest_suffix_at_its_latest_occurrence() -> None:
    # suffix [1, 2] occurred twice: at 0 (then 9) and at 4 (then 7); [x, 1, 2] only at 3
    assert _draft([1, 2, 9, 5, 1, 2, 7, 8, 5, 1, 2]) == [7, 8, 5]
    # without the 3-gram, the latest 2-gram wins
    assert _draft([1, 2, 9, 9, 1, 2, 7, 8, 6, 1, 2]) == [7, 8, 6]
    # a match shorter than prompt_lookup_min is no draft
    assert _draft([1, 2, 9, 3, 4, 6, 8, 2], low=2) == []
    # never the suffix itself, and the draft stops at the end of the tokens
    assert _draft([4, 4], k=5) == [4]
    assert _draft([1, 2, 3, 4], k=2) == []
    assert _draft([7], k=2) == []
    # k caps the draft
    assert _draft([*range(10), 0, 1], k=2) == [2, 3]


def test_accepted_keeps_matches_and_the_first_other_token() -> None:
    assert accepted((3, 4, 5), [3, 4, 5, 6]) == 4  # all three and the bonus token
    assert accepted((3, 4, 5), [3, 9, 5, 6]) == 2  # 3, then 9 instead of 4
    assert accepted((3,), [8, 3]) == 1


def test_settings_use_vllms_keys_and_refuse_the_rest() -> None:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_max": 5})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)
    spec = SpeculativeConfig.from_dict({"method": "ngram", "prompt_lookup_min": 6})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (6, 6)
    assert SpeculativeConfig.parse(spec.to_json()) == spec
    bad = [
        ({"method": "eagle"}, "'eagle' is not supported"),
        ({"method": "ngram", "model": "x"}, "unsupported key(s) 'model'"),
        ({"num_speculative_tokens": 2}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup"),
        ({"method": "ngram", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ]
    for value, message in bad:
        with pytest.raises(SpeculativeConfigError) as err:
            SpeculativeConfig.from_dict(value)
        assert message in str(err.value)
    with pytest.raises(SpeculativeConfigError, match="not JSON"):
        SpeculativeConfig.parse("{method: ngram}")


@pytest.fixture(scope="module")
def plain(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, warm_up=False)


@pytest.fixture(scope="module")
def spec(tiny_model_dir: Path) -> LLM:
    return LLM(tiny_model_dir, warm_up=False, speculative_config=SPEC)


def _run(llm: LLM, params: SamplingParams, prompts=PROMPTS):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def _accepted(llm: LLM) -> int:
    return llm.engine.scheduler.num_accepted_tokens


def test_greedy_output_is_unchanged_and_drafts_are_accepted(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    before = _accepted(spec)
    want = _run(plain, params)
    got = _run(spec, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.outputs[0].token_ids) == 48  # max_tokens, never more
        assert g.outputs[0].text == w.outputs[0].text
    assert _accepted(spec) - before > 20  # the repeated prompts are copied
    assert spec.engine.block_manager.num_leaked() == 0
    spec.engine.block_manager.check_integrity()


def test_a_step_computes_the_draft_and_keeps_only_accepted_kv(spec: LLM) -> None:
    """The scheduler plans the draft's rows, and after the step the sequence's computed
    tokens and blocks cover the kept tokens only."""
    engine = spec.engine
    engine.add_request("kv", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=40))
    engine.step()  # the prompt
    seen = False
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        assert plan is not None
        item = plan.scheduled[0]
        result = engine.runner.run(plan)
        engine.scheduler.update(plan, result)
        engine._make_output(item.seq, result.token_ids[0])
        seq = item.seq
        assert len(result.token_ids[0]) <= len(item.draft) + 1
        if item.draft and not seq.is_finished:
            seen = True
            assert item.num_new_tokens == len(item.draft) + 1
            assert seq.num_computed_tokens == seq.num_tokens - 1
            assert len(seq.block_ids) == -(
                -seq.num_computed_tokens // engine.block_manager.block_size
            )
    assert seen
    assert engine.block_manager.num_leaked() == 0


def test_penalties_and_logprobs_see_the_draft_as_history(plain: LLM, spec: LLM) -> None:
    """Each draft row is sampled with the tokens before it: a repetition penalty and
    frequency penalty change greedy choices, and they stay those of the plain engine."""
    params = SamplingParams(
        temperature=0.0,
        max_tokens=40,
        ignore_eos=True,
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        logprobs=2,
    )
    want = _run(plain, params)
    got = _run(spec, params)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for a, b in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and a.rank == b.rank
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


def test_stop_tokens_inside_a_draft_end_the_output_there(plain: LLM, spec: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    full = _run(plain, params, PROMPTS[:1])[0].outputs[0]
    token = full.token_ids[20]
    first = full.token_ids.index(token)
    stop_params = SamplingParams(
        temperature=0.0, max_tokens=48, ignore_eos=True, stop_token_ids=[token]
    )
    want, got = (_run(llm, stop_params, PROMPTS[:1])[0].outputs[0] for llm in (plain, spec))
    assert got.token_ids == want.token_ids == full.token_ids[: first + 1]
    assert got.finish_reason == "stop" and got.stop_reason == token
    assert spec.engine.block_manager.num_leaked() == 0


def test_stop_strings_inside_a_draft_end_the_output_there(real_model_dir: Path) -> None:
    """SmolLM2 copies a repeated sentence; a stop string that ends with the first of a
    step's several tokens ends the output there, as without drafts."""
    plain = LLM(real_model_dir, warm_up=False, num_threads=2)
    spec = LLM(real_model_dir, warm_up=False, num_threads=2, speculative_config=SPEC)
    prompt = "Repeat exactly: " + "The quick brown fox jumps over the lazy dog. " * 4 + "\nRepeat:"
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    full = plain.generate(prompt, params)[0].outputs[0]
    engine = spec.engine
    engine.add_request("steps", engine.tokenizer.encode(prompt), params)
    firsts, num_out = [], 0  # output index of the first token of each step that kept drafts
    while engine.has_unfinished_requests():
        for out in engine.step():
            if len(out.new_token_ids) > 1:
                firsts.append(num_out)
            num_out += len(out.new_token_ids)
    assert firsts
    tried = 0
    for j in firsts[:6]:
        prefix = engine.tokenizer.decode(full.token_ids[: j + 1])
        if not full.text.startswith(prefix):
            continue
        # its shortest suffix whose first occurrence in the output ends there
        size = next(
            n for n in range(1, len(prefix) + 1) if full.text.find(prefix[-n:]) == len(prefix) - n
        )
        stop = prefix[-size:]
        stop_params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop])
        want, got = (llm.generate(prompt, stop_params)[0].outputs[0] for llm in (plain, spec))
        assert got.text == want.text == prefix[:-size]
        assert got.token_ids == want.token_ids == full.token_ids[: j + 1]
        assert got.stop_reason == stop and got.finish_reason == "stop"
        tried += 1
    assert tried
    assert engine.block_manager.num_leaked() == 0


def test_seeded_sampling_is_reproducible_with_drafts(spec: LLM) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=32, ignore_eos=True)
    first = _run(spec, params)
    again = _run(spec, params)
    for a, b in zip(first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.outputs[0].token_ids) == 32


def test_drafted_blocks_serve_the_prefix_cache_correctly(plain: LLM, spec: LLM) -> None:
    """Blocks filled by accepted drafts are published to the prefix cache; a request whose
    prompt is a finished one's prompt and output reuses them and decodes as if computed
    from scratch."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = _run(spec, params, PROMPTS[:1])[0]
    prompt = PROMPTS[0] + first.outputs[0].token_ids
    got = spec.generate({"prompt_token_ids": prompt}, params)[0]
    assert got.num_cached_tokens >= 64
    want = plain.generate({"prompt_token_ids": prompt}, params)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids


def test_preemption_with_drafts_loses_nothing(tiny_model_dir: Path, plain: LLM) -> None:
    """A pool too small for every sequence at once: drafts never preempt a sequence, and
    preempted ones recompute to the same tokens."""
    llm = LLM(tiny_model_dir, warm_up=False, num_blocks=24, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = PROMPTS * 2
    want = _run(plain, params, prompts)
    got = _run(llm, params, prompts)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert llm.engine.scheduler.num_accepted_tokens > 0
    assert llm.engine.block_manager.num_leaked() == 0
    llm.engine.block_manager.check_integrity()


@pytest.mark.parametrize("case", ["regex", *sorted(SCHEMAS)])
def test_grammar_rows_draft_and_keep_the_plain_engines_tokens(plain: LLM, spec: LLM, case: str):
    """A row with a grammar drafts too: each draft row is masked by the grammar after the
    draft tokens before it, so the output is the plain engine's, greedy and valid."""
    if case == "regex":
        grammar, max_tokens = StructuredOutput("regex", "[ab]{24}"), 24
    else:
        grammar, max_tokens = StructuredOutput("json", spec_text(SCHEMAS[case])), MAX_TOKENS
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=grammar)
    before = spec.engine.scheduler.num_drafts
    prompts = PROMPTS[:2]
    want = _run(plain, params, prompts)
    got = _run(spec, params, prompts)
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        if case == "regex":
            assert re.fullmatch("[ab]{24}", g.outputs[0].text)
        else:
            jsonschema.validate(json.loads(g.outputs[0].text), SCHEMAS[case])
    assert spec.engine.scheduler.num_drafts > before
    assert spec.engine.block_manager.num_leaked() == 0


def test_large_batches_run_without_drafts(tiny_model_dir: Path) -> None:
    limited = LLM(
        tiny_model_dir,
        warm_up=False,
        speculative_config={**SPEC, "disable_by_batch_size": 2},
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    _run(limited, greedy, PROMPTS[:3])  # three at once: no drafts until one is left
    _run(limited, greedy, PROMPTS[:1])
    scheduler = limited.engine.scheduler
    assert scheduler.num_drafts > 0
    assert scheduler.num_drafts < 32  # the lone request's steps only


def test_bad_settings_are_refused_at_start(tiny_model_dir: Path) -> None:
    with pytest.raises(ConfigError, match="'medusa' is not supported"):
        LLM(tiny_model_dir, warm_up=False, speculative_config={"method": "medusa"})


def test_each_draft_row_is_sampled_with_the_tokens_before_it(spec: LLM) -> None:
    """Penalties, min_tokens and bad words read a row's history: row j's is the output and
    the draft's first j tokens."""
    from kvrelay.engine.scheduler import ScheduledSeq
    from kvrelay.engine.sequence import Sequence

    seq = Sequence("rows", [1, 2, 3], SamplingParams(temperature=0.0, repetition_penalty=1.2))
    seq.token_ids += [4, 5]  # two output tokens
    item = ScheduledSeq(seq, 4, 4, (6, 7, 8))
    histories = [list(r.output_token_ids) for r in spec.engine.runner._sample_requests(item)]
    assert histories == [[4, 5], [4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7, 8]]


@pytest.mark.parametrize("env", ["KVRELAY_NATIVE_ATTENTION", "KVRELAY_NATIVE_MATMUL"])
def test_torch_paths_give_the_same_tokens(env: str, tiny_model_dir: Path, plain: LLM, monkeypatch):
    """Without the native attention (torch's decode attention per row) or without the native
    library at all, the draft's rows give the plain engine's greedy tokens too."""
    monkeypatch.setenv(env, "0")
    llm = LLM(tiny_model_dir, warm_up=False, speculative_config=SPEC)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for w, g in zip(_run(plain, params), _run(llm, params), strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert llm.engine.scheduler.num_accepted_tokens > 0
