"""Grammar-constrained decoding in the engine (offline ``LLM``), on a random-weight model.

Only the grammar can make a random model's output valid, so every completion parsing and
validating is the grammar at work. Tests take ``model_dir``; a module that overrides that
fixture runs them on another checkpoint.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.admission import RequestError
from kvrelay.engine.sampling import Sampler, SampleRequest
from kvrelay.protocol.messages import GenerateRequest, decode, encode
from kvrelay.protocol.sampling_params import StructuredOutput
from tests.structured_cases import MAX_TOKENS, SCHEMAS, spec_text


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, num_blocks=512)


def _json(schema) -> StructuredOutput:
    return StructuredOutput("json", spec_text(schema))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_completion_validates_greedy_and_sampled(llm, name):
    schema = SCHEMAS[name]
    grammar = _json(schema)
    cases = [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=grammar),
        SamplingParams(
            temperature=1.0, seed=5, n=3, max_tokens=MAX_TOKENS, structured_outputs=grammar
        ),
        SamplingParams(
            temperature=0.8,
            top_p=0.9,
            top_k=50,
            n=2,
            max_tokens=MAX_TOKENS,
            structured_outputs=grammar,
        ),
        SamplingParams(
            temperature=0,
            repetition_penalty=1.3,
            max_tokens=MAX_TOKENS,
            structured_outputs=grammar,
        ),
    ]
    for params in cases:
        for output in llm.generate(["Hello", "Give me JSON"], params):
            assert len(output.outputs) == params.n
            for choice in output.outputs:
                assert choice.finish_reason == "stop", choice.text
                jsonschema.validate(json.loads(choice.text), schema)


def test_without_a_grammar_the_model_writes_no_json(llm):
    """The control: the same prompt unconstrained is not valid JSON (random weights)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    text = llm.generate("Give me JSON", params)[0].outputs[0].text
    with pytest.raises(ValueError):
        json.loads(text)


def test_regex_choice_grammar_and_json_object(llm):
    cases = {
        StructuredOutput("regex", r"[a-c]{2}-\d{3}"): re.compile(r"[a-c]{2}-\d{3}"),
        StructuredOutput("choice", choices=("yes", "no", "maybe")): re.compile(r"yes|no|maybe"),
        StructuredOutput("grammar", 'root ::= "x" ("y" | "z") "!"'): re.compile(r"x[yz]!"),
    }
    for grammar, pattern in cases.items():
        params = SamplingParams(
            temperature=1.0, seed=1, n=3, max_tokens=40, structured_outputs=grammar
        )
        for choice in llm.generate("pick", params)[0].outputs:
            assert pattern.fullmatch(choice.text), (grammar.kind, choice.text)
    params = SamplingParams(
        temperature=0, max_tokens=60, structured_outputs=StructuredOutput("json_object")
    )
    choice = llm.generate("object", params)[0].outputs[0]
    if choice.finish_reason == "stop":  # any JSON object: its strings have no length bound
        assert isinstance(json.loads(choice.text), dict)
    else:
        assert choice.text.startswith("{") and len(choice.token_ids) == 60


def test_a_resumed_request_continues_the_grammar_from_its_output_tokens(llm):
    """What a decode worker or a re-run does: replay the tokens already sent, then go on."""
    schema = SCHEMAS["nested"]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=_json(schema))
    generated = llm.generate("Hello", params)[0]
    full, prompt = generated.outputs[0], generated.prompt_token_ids
    engine = llm.engine
    for cut in (1, 7):
        engine.add_request(f"resume-{cut}", prompt, params, output_token_ids=full.token_ids[:cut])
        tokens = list(full.token_ids[:cut])
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens = out.token_ids
        assert tokens == full.token_ids


def test_output_tokens_outside_the_grammar_are_refused(llm):
    engine = llm.engine
    params = SamplingParams(
        max_tokens=20, structured_outputs=StructuredOutput("choice", choices=("yes",))
    )
    bad = engine.tokenizer.encode("no", add_special_tokens=False)
    with pytest.raises(RequestError, match="does not match the grammar"):
        engine.add_request("bad-replay", [5, 6, 7], params, output_token_ids=bad)
    assert not engine.has_unfinished_requests()


def test_a_schema_that_does_not_compile_is_a_request_error_naming_the_field(llm):
    params = SamplingParams(structured_outputs=StructuredOutput("regex", "(unclosed"))
    with pytest.raises(RequestError, match=r"invalid 'structured_outputs\.regex'") as info:
        llm.engine.add_request("bad-regex", [5, 6], params)
    assert info.value.param == "structured_outputs.regex"


def test_compiled_grammars_are_cached_per_spec(llm):
    grammars = llm.engine.grammars
    spec = StructuredOutput("regex", "cache-[0-9]")
    before = grammars.num_compiled
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=10, structured_outputs=spec)
        llm.generate("x", params)
    assert grammars.num_compiled == before + 1


def test_logprobs_under_a_grammar_cover_only_allowed_tokens(llm):
    """As vLLM: logprobs come from the logits after the grammar mask (before penalties)."""
    grammar = StructuredOutput("choice", choices=("yes", "no"))
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5, structured_outputs=grammar)
    choice = llm.generate("pick", params)[0].outputs[0]
    first = choice.logprobs[0]
    allowed = {t for t, lp in first.top if lp > float("-inf")}
    texts = {llm.engine.tokenizer.decode([t]) for t in allowed}
    assert all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    assert first.logprob > float("-inf") and first.rank == 1


def test_eos_is_masked_until_the_grammar_may_end():
    """The sampler never picks eos while the grammar is unfinished, even if eos is likeliest."""
    pytest.importorskip("xgrammar")
    from kvrelay.engine.structured import GrammarMasker

    class Matcher:  # what fill_next_token_bitmask gives for "only token 7 allowed"
        def fill_next_token_bitmask(self, bitmask, index):
            bitmask[index].zero_()
            bitmask[index, 0] = 1 << 7

    logits = torch.zeros(2, 64)
    logits[:, 1] = 10.0  # eos
    sampler = Sampler([1])
    rows = [
        SampleRequest(SamplingParams(temperature=0), [3], [], None, Matcher()),
        SampleRequest(SamplingParams(temperature=1.0, seed=3), [3], [], None, Matcher()),
    ]
    assert sampler(logits, rows).token_ids == [7, 7]
    masked = logits.clone()
    GrammarMasker().apply(masked, [None, Matcher()])
    assert masked[0].eq(logits[0]).all() and masked[1, 7] == 0 and masked[1, 1] == float("-inf")


def test_structured_outputs_travel_in_messages():
    params = SamplingParams(
        structured_outputs=StructuredOutput("choice", choices=("a", "b")), max_tokens=4
    )
    msg = GenerateRequest("r", [1, 2], params, output_token_ids=[3])
    assert decode(encode(msg)) == msg


def test_params_refuse_what_a_grammar_cannot_honour():
    grammar = StructuredOutput("json_object")
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=grammar)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=grammar)
    with pytest.raises(ValueError, match="kind"):
        StructuredOutput("xml", "x")
    with pytest.raises(ValueError, match="spec"):
        StructuredOutput("json")


def test_json_strings_never_hold_raw_control_characters(llm):
    """xgrammar's JSON strings admit U+0000-U+001F; JSON (and json.loads) does not."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}},
        "required": ["name"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=1.0, seed=0, n=8, max_tokens=60, structured_outputs=_json(schema)
    )
    for output in llm.generate(["a pet", "hello"], params):
        for choice in output.outputs:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), schema)
    control = llm.engine.tokenizer.encode("\x03", add_special_tokens=False)
    bits = llm.engine.grammars._json_bits
    assert all(not (int(bits[t // 32]) >> (t % 32)) & 1 for t in control)


def test_batched_mask_fill_equals_one_row_at_a_time(llm):
    """``GrammarMasker`` fills many rows in one xgrammar call: the masks are exactly those each
    matcher gives alone (with the JSON rows' control-character filter), whatever their state."""
    from kvrelay.engine.structured import GrammarMasker

    grammars = llm.engine.grammars
    tokenizer = llm.get_tokenizer()
    cases = [  # a grammar, and text whose tokens (as far as it allows) it has accepted
        (_json(SCHEMAS["array"]), '{"tags": ["a"'),
        (_json(SCHEMAS["nested"]), '{"'),
        (_json(SCHEMAS["numbers"]), '{"count": 1'),
        (StructuredOutput("choice", choices=("left", "right")), "le"),
        (_json(SCHEMAS["nested"]), ""),
    ]
    matchers = []
    for spec, text in cases:
        probe = grammars.create_matcher(spec)
        accepted = []
        for token in tokenizer.encode(text):
            if not probe.accept_token(token):
                break
            accepted.append(token)
        matchers.append(grammars.create_matcher(spec, accepted))
    vocab = llm.engine.config.model_config.vocab_size
    logits = torch.randn(len(matchers) + 1, vocab)
    rows = [None, *matchers]  # a row without a grammar keeps every token
    batched = logits.clone()
    GrammarMasker().apply(batched, rows)
    for j, matcher in enumerate(matchers, start=1):
        alone = logits[j : j + 1].clone()
        GrammarMasker().apply(alone, [matcher])
        assert torch.equal(batched[j], alone[0]), j
        assert batched[j].isinf().any() and not batched[j].isinf().all()
    assert torch.equal(batched[0], logits[0])


def test_grammar_tables_from_tokenizer_json_equal_autotokenizers(model_dir, tmp_path):
    """The grammar compiler reads the tokenizer from tokenizer.json directly (a worker starts
    1.5 s sooner than through AutoTokenizer): the same xgrammar tables as AutoTokenizer's;
    a checkpoint without tokenizer.json goes through AutoTokenizer."""
    import shutil

    import xgrammar as xgr
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from kvrelay.engine.structured import _hf_tokenizer

    def tables(tokenizer):
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[0])
        return info.dump_metadata(), info.decoded_vocab, info.special_token_ids

    direct = _hf_tokenizer(str(model_dir))
    assert type(direct) is PreTrainedTokenizerFast
    assert tables(direct) == tables(AutoTokenizer.from_pretrained(model_dir))
    other = tmp_path / "no-tokenizer-json"
    shutil.copytree(model_dir, other)
    (other / "tokenizer.json").unlink()
    with pytest.raises((OSError, ValueError)):  # no tokenizer at all: AutoTokenizer's error
        _hf_tokenizer(str(other))


def test_tables_built_in_the_background_are_built_once(model_dir, monkeypatch):
    """A worker builds the grammar tables on a thread after it registers; a structured request
    that comes meanwhile waits for that build (the cache's lock) instead of starting another,
    and then compiles its grammar on them."""
    import threading
    import time

    from kvrelay.engine import structured

    built: list[str] = []
    release = threading.Event()
    real = structured._hf_tokenizer

    def slow_tokenizer(path):
        built.append(threading.current_thread().name)
        release.wait(30)  # the request below arrives while the tables are being built
        return real(path)

    monkeypatch.setattr(structured, "_hf_tokenizer", slow_tokenizer)
    cache = structured.GrammarCache(model_dir, vocab_size=256, stop_token_ids=[0])
    thread = cache.warm_up_in_background()
    for _ in range(3000):  # the build has begun (holds the lock) before the request comes
        if built:
            break
        time.sleep(0.01)
    compiled: list[object] = []
    request = threading.Thread(
        target=lambda: compiled.append(cache.compile(_json({"type": "integer"})))
    )
    request.start()
    assert thread.is_alive() and request.is_alive() and not compiled
    release.set()
    thread.join(30)
    request.join(30)
    assert built == ["grammar-warm-up"]  # once, on the background thread
    assert len(compiled) == 1 and cache.num_compiled == 1


def test_a_failed_background_build_is_logged_and_raised_by_the_request(tmp_path, caplog):
    """Without a tokenizer the background build logs its failure and the worker goes on; the
    structured request that needs the tables gets the error itself."""
    from kvrelay.engine.structured import GrammarCache

    cache = GrammarCache(tmp_path, vocab_size=256, stop_token_ids=[0])
    with caplog.at_level("ERROR", logger="kvrelay.engine.structured"):
        cache.warm_up_in_background().join(60)
    assert "grammar compiler's tokenizer tables failed" in caplog.text
    with pytest.raises((OSError, ValueError)):
        cache.compile(_json({"type": "integer"}))
