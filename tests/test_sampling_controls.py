"""``logit_bias`` (OpenAI), ``allowed_token_ids`` (vLLM), and requests that go on in another
process (seeded sampling, stop strings):
the sampler's arithmetic, the params' checks and wire form, the offline engine, and the whole
path with the official ``openai`` client and LangChain against real clusters, colocated and
1P+1D (the prefill worker samples the first token and the decode worker the rest, so the
params and the seeded generator's place cross the wire).
"""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.engine.admission import RequestError
from kvrelay.engine.sampling import Sampler, SampleRequest, create_generator
from kvrelay.protocol.messages import decode, encode
from tests.cluster_harness import running_cluster

EOS = 2
PROMPT = "The quick brown fox"


def _request(params: SamplingParams, output: tuple[int, ...] = ()) -> SampleRequest:
    return SampleRequest(params, (0,), output, None)


# ---- params --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -math.inf}}, "logit_bias"),
        ({"logit_bias": {5: math.nan}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: True}}, "logit_bias"),
        ({"logit_bias": [(1, 2.0), (1, 3.0)]}, "logit_bias"),
        ({"logit_bias": 7}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids"),
        ({"allowed_token_ids": ["3"]}, "allowed_token_ids"),
        ({"allowed_token_ids": 3.5}, "allowed_token_ids"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} must be"):
        SamplingParams(**kwargs)


def test_allowed_token_ids_and_a_grammar_are_refused_together() -> None:
    from kvrelay.protocol.sampling_params import StructuredOutput

    with pytest.raises(ValueError, match=r"allowed_token_ids must be None with structured"):
        SamplingParams(allowed_token_ids=[3], structured_outputs=StructuredOutput("json_object"))


def test_normalised_hashable_and_the_same_after_the_wire() -> None:
    params = SamplingParams(logit_bias={9: -1.5, 3: 100}, allowed_token_ids=[4, 3, 9])
    assert params.logit_bias == ((3, 100), (9, -1.5))
    assert params.allowed_token_ids == (4, 3, 9)
    assert params == SamplingParams(logit_bias=[(9, -1.5), (3, 100)], allowed_token_ids=(4, 3, 9))
    again = decode(encode(params))
    assert again == params and hash(again) == hash(params)
    assert SamplingParams().allowed_token_ids is None and SamplingParams().logit_bias == ()
    assert params.token_ids_over(9) == ("logit_bias", 9)
    assert SamplingParams(allowed_token_ids=[12]).token_ids_over(12) == ("allowed_token_ids", 12)
    assert params.token_ids_over(10) is None


# ---- sampler -------------------------------------------------------------------------------


def test_logit_bias_is_added_before_penalties_and_greedy() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, 3.0], [2.0, 1.0, 0.0, 3.0], [2.0, 1.0, 0.0, 3.0]])
    rows = [
        _request(SamplingParams(temperature=0, logit_bias={2: 3.5})),  # 3.5 > 3.0
        _request(SamplingParams(temperature=0, logit_bias={3: -1.5, 1: 0.4})),  # 2.0 > 1.5
        # vLLM's order: the bias, then the repetition penalty: (3.0 + 3.0) / 2 = 3.0 < 1.0 + 3.0
        # (the other order would give 3.0 / 2 + 3.0 = 4.5)
        _request(
            SamplingParams(temperature=0, logit_bias={3: 3.0, 1: 3.0}, repetition_penalty=2.0),
            output=(3,),
        ),
    ]
    assert Sampler([EOS])(logits, rows).token_ids == [2, 0, 1]
    assert logits[0].tolist() == [2.0, 1.0, 0.0, 3.0]  # the caller's logits untouched


def test_logit_bias_shifts_the_sampled_distribution() -> None:
    """Bias b on token t multiplies its odds by e^b: uniform logits over 4 tokens with
    log(3) on token 1 give it half the draws."""
    logits = torch.zeros(4000, 4)
    params = SamplingParams(logit_bias={1: math.log(3)}, seed=None)
    out = Sampler([EOS], seed=3)(logits, [_request(params)] * 4000)
    share = out.token_ids.count(1) / 4000
    assert 0.46 < share < 0.54, share


def test_allowed_token_ids_never_sample_another_token() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(600, 50, generator=gen) * 4
    allowed = (7, 11, 42)
    rows = [_request(SamplingParams(allowed_token_ids=allowed, top_p=0.9))] * 300
    rows += [_request(SamplingParams(allowed_token_ids=allowed))] * 300
    out = Sampler([EOS], seed=5)(logits, rows)
    assert set(out.token_ids) == set(allowed)
    greedy = Sampler([EOS])(
        logits[:1], [_request(SamplingParams(temperature=0, allowed_token_ids=allowed))]
    )
    assert greedy.token_ids == [max(allowed, key=lambda t: logits[0, t].item())]


def test_bad_words_mask_a_words_last_id_while_the_output_ends_with_the_rest() -> None:
    logits = torch.zeros(4, 50)
    logits[:, 9] = 5.0  # greedy picks 9 unless it is masked, then 8
    logits[:, 8] = 4.0
    words = ((9, 3, 9), (1, 9))  # 9 after 9, 3; 9 after 1
    params = SamplingParams(temperature=0, bad_words_token_ids=words)
    rows = [_request(params, out) for out in ((), (9, 3), (7, 1), (3, 9))]
    assert Sampler([EOS])(logits, rows).token_ids == [9, 8, 8, 9]
    single = SamplingParams(temperature=0, bad_words_token_ids=[[9]])
    assert Sampler([EOS])(logits[:1], [_request(single)]).token_ids == [8]
    sampled = SamplingParams(seed=3, bad_words_token_ids=[[9], [8]])
    out = Sampler([EOS])(logits, [_request(sampled)] * 4)
    assert not {8, 9} & set(out.token_ids)


@pytest.mark.parametrize(
    "words",
    [[[]], [[-1]], [["a"]], ["ab"], [[1, 2.5]]],
)
def test_bad_words_must_be_token_id_sequences(words: Any) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.bad_words_token_ids must be"):
        SamplingParams(bad_words_token_ids=words)


def test_bad_words_may_not_ban_every_allowed_id() -> None:
    with pytest.raises(ValueError, match="leave one of allowed_token_ids"):
        SamplingParams(allowed_token_ids=[4, 5], bad_words_token_ids=[[4], [5], [6, 4]])
    SamplingParams(allowed_token_ids=[4, 5], bad_words_token_ids=[[4], [6, 5]])  # 5 may follow


def test_rows_without_them_are_untouched_and_logprobs_stay_raw() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(3, 30, generator=gen)
    plain = SamplingParams(temperature=0, logprobs=2)
    rows = [
        _request(plain),
        _request(
            SamplingParams(temperature=0, logprobs=2, logit_bias={int(logits[1].argmin()): 100})
        ),
        _request(
            SamplingParams(temperature=0, logprobs=2, allowed_token_ids=[int(logits[2].argmin())])
        ),
    ]
    out = Sampler([EOS])(logits, rows)
    assert out.token_ids == [
        int(logits[0].argmax()),
        int(logits[1].argmin()),
        int(logits[2].argmin()),
    ]
    raw = logits.log_softmax(dim=-1)
    for row in range(3):
        entry = out.logprobs[row]
        assert entry is not None
        assert entry.logprob == pytest.approx(raw[row, out.token_ids[row]].item(), abs=1e-6)
    assert out.logprobs[1].rank == 30  # the least likely token, forced


def test_a_generator_made_for_drawn_tokens_goes_on_where_they_left_it() -> None:
    params = SamplingParams(seed=123)
    first = create_generator(params)
    assert first is not None
    one = torch.empty(1, dtype=torch.float64)
    draws = [one.uniform_(generator=first).item() for _ in range(5)]
    later = create_generator(params, drawn=3)
    assert later is not None
    assert [one.uniform_(generator=later).item() for _ in range(2)] == draws[3:]
    greedy = create_generator(SamplingParams(seed=123, temperature=0), drawn=3)
    assert greedy is not None and one.uniform_(generator=greedy).item() == draws[0]  # no draws


# ---- the offline engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Any) -> LLM:
    return LLM(tiny_model_dir, num_blocks=128)


def _ids(llm: LLM, params: SamplingParams, prompt: str = PROMPT) -> list[int]:
    return list(llm.generate(prompt, params)[0].outputs[0].token_ids)


def test_engine_bias_forces_bans_and_restricts(llm: LLM) -> None:
    greedy = _ids(llm, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    forced = _ids(llm, SamplingParams(temperature=0, max_tokens=6, logit_bias={17: 100}))
    assert forced == [17] * 6
    banned = _ids(
        llm,
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logit_bias={greedy[0]: -100}),
    )
    assert banned[0] != greedy[0]
    allowed = (21, 22, 23)
    restricted = _ids(
        llm, SamplingParams(max_tokens=12, ignore_eos=True, seed=4, allowed_token_ids=allowed)
    )
    assert len(restricted) == 12 and set(restricted) <= set(allowed)


def test_a_seeded_request_resumed_with_its_tokens_goes_on_as_before(llm: LLM) -> None:
    """A re-run (or a decode worker's import) carries the tokens already sampled: the rest
    is what the uninterrupted request sampled."""
    params = SamplingParams(max_tokens=10, ignore_eos=True, seed=77, top_p=0.95)
    done = llm.generate(PROMPT, params)[0]
    whole = list(done.outputs[0].token_ids)
    engine = llm.engine
    engine.add_request("resumed", list(done.prompt_token_ids), params, output_token_ids=whole[:4])
    rest: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            rest += out.new_token_ids
    assert rest == whole[4:]


def test_a_resumed_request_finds_a_stop_string_begun_in_its_tokens(llm: LLM) -> None:
    """A stop string whose first character came from a token made elsewhere (the prefill
    worker's first token) and whose last comes from the next one ends the request there,
    as it does where one process made both (the worker's check once began at the new token,
    leaving it to the router to notice and abort)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    done = llm.generate(PROMPT, params)[0]
    tokens, tokenizer = list(done.outputs[0].token_ids), llm.engine.tokenizer
    texts = [tokenizer.decode(tokens[:k]) for k in range(len(tokens) + 1)]

    def spans(k: int) -> str | None:
        """Two characters across tokens k - 2 and k - 1 (the last of texts[k - 1] and the first
        token k - 1 adds), first found there; None if none."""
        before, now = texts[k - 1], texts[k]
        if not before or not now.startswith(before) or len(now) == len(before):
            return None
        stop = before[-1] + now[len(before)]
        earlier = texts[k - 2]  # the stop's first character is token k - 2's own
        clean = "\ufffd" not in stop and len(earlier) < len(before) and before.startswith(earlier)
        return stop if clean and now.find(stop) == len(before) - 1 else None

    k = next(k for k in range(2, len(tokens)) if spans(k) is not None)
    stop = spans(k)
    assert stop is not None
    engine = llm.engine
    resumed = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop])
    prompt = list(done.prompt_token_ids)
    engine.add_request("stop", prompt, resumed, output_token_ids=tokens[: k - 1])
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert [t for out in outs for t in out.new_token_ids] == [tokens[k - 1]]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert outs[-1].text == texts[k - 1][:-1]  # the whole output's text, cut at the stop


def test_engine_refuses_ids_outside_the_vocabulary(llm: LLM) -> None:
    vocab = llm.engine.config.model_config.vocab_size
    engine = llm.engine
    for params, field in [
        (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=[1, vocab + 5]), "allowed_token_ids"),
    ]:
        with pytest.raises(RequestError, match="outside the vocabulary") as info:
            engine.add_request("r", [1, 2, 3], params)
        assert info.value.param == field
    eos = next(iter(engine.eos_token_ids))
    with pytest.raises(RequestError, match="nothing could be sampled"):
        engine.add_request("r", [1, 2, 3], SamplingParams(allowed_token_ids=[eos], min_tokens=2))
    assert not engine.has_unfinished_requests()


# ---- through the cluster -------------------------------------------------------------------


@pytest.fixture(scope="module")
def colocated(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_cluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("colocated"),
        num_prefill=0,
        num_decode=0,
        num_colocated=1,
        router_args=("--served-model-name", "tiny"),
    ) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def disagg(tiny_model_dir: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with running_cluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("disagg"),
        router_args=("--served-model-name", "tiny"),
    ) as launcher:
        yield launcher


def _client(launcher: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


def test_the_same_tokens_colocated_disaggregated_and_offline(
    colocated: Any, disagg: Any, llm: LLM
) -> None:
    """Greedy with a bias that moves the 1st and a later token, a seeded draw restricted to a
    few ids, and a plain seeded draw: the same ids on both clusters as offline, streamed or
    not (1P+1D's decode worker once restarted the seeded generator: its tokens were shifted
    by one draw)."""
    base = _ids(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    bias = {base[0]: -100.0, base[3]: -100.0, 40: 4.0}
    allowed = [30, 31, 32, 33]
    want_biased = _ids(
        llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias)
    )
    want_allowed = _ids(
        llm,
        SamplingParams(max_tokens=8, ignore_eos=True, seed=9, allowed_token_ids=allowed),
    )
    want_seeded = _ids(llm, SamplingParams(max_tokens=8, ignore_eos=True, seed=5))
    assert want_biased != base
    for launcher in (colocated, disagg):
        client = _client(launcher)
        common: dict[str, Any] = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8}
        ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}
        biased = client.completions.create(
            **common,
            temperature=0,
            logit_bias={str(k): v for k, v in bias.items()},
            logprobs=0,
            extra_body=ids,
        )
        assert _token_ids(biased.choices[0].logprobs.tokens) == want_biased
        streamed = client.completions.create(
            **common,
            seed=9,
            stream=True,
            logprobs=0,
            extra_body={**ids, "allowed_token_ids": allowed},
        )
        tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
        assert _token_ids(tokens) == want_allowed
        seeded = client.completions.create(**common, seed=5, logprobs=0, extra_body=ids)
        assert _token_ids(seeded.choices[0].logprobs.tokens) == want_seeded


def test_bad_words_through_both_clusters(colocated: Any, disagg: Any, llm: LLM) -> None:
    """vLLM's ``bad_words``: a word of the greedy output, as the router tokenizes it, never
    appears in the output, which is the offline engine's with those ids banned, colocated
    and 1P+1D (the prefill worker's first token obeys it too)."""
    from kvrelay.router.request_models import bad_words_ids

    tokenizer = llm.get_tokenizer()
    greedy = _ids(llm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    ids_of = {}
    for width in (1, 2):  # the first token, then the first pair, that the router tokenizes
        for start in range(len(greedy) - width + 1):  # back to the output's own ids
            word = tokenizer.decode(greedy[start : start + width])
            seqs = bad_words_ids(lambda w: tokenizer.encode(w, False), [word])
            if tuple(greedy[start : start + width]) in seqs:
                ids_of[word] = seqs
                break
    assert ids_of, "no word of the greedy output tokenizes back to its own ids"
    words = list(ids_of)
    banned = tuple(seq for seqs in ids_of.values() for seq in seqs)
    want = _ids(
        llm,
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, bad_words_token_ids=banned),
    )
    assert want != greedy
    for launcher in (colocated, disagg):
        got = _client(launcher).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True,
                        "bad_words": words},
        )  # fmt: skip
        out = _token_ids(got.choices[0].logprobs.tokens)
        assert out == want
        for seq in banned:
            assert all(tuple(out[i : i + len(seq)]) != seq for i in range(len(out)))


def _token_ids(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_chat_logit_bias_with_the_openai_client_and_langchain(colocated: Any) -> None:
    from langchain_openai import ChatOpenAI

    messages = [{"role": "user", "content": "Say something"}]
    client = _client(colocated)
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logit_bias={"17": 100},
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
    )
    assert [t.token for t in out.choices[0].logprobs.content] == ["token_id:17"] * 5
    model = ChatOpenAI(
        base_url=colocated.url + "/v1",
        api_key="unused",
        model="tiny",
        max_tokens=5,
        temperature=0,
        max_retries=0,
        logit_bias={17: 100},
    )
    assert model.invoke("Say something").content == out.choices[0].message.content


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"logit_bias": {"x1": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "outside the vocabulary"),
        ({"logit_bias": {"3": 100.5}}, "logit_bias", "[-100, 100]"),
        ({"allowed_token_ids": [1, 99999999]}, "allowed_token_ids", "outside the vocabulary"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "1 to"),
        ({"bad_words": [" "]}, "bad_words", "non-empty words"),
        ({"bad_words": ["x"] * 1025}, "bad_words", "more than 1024"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(
    colocated: Any, body: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        _client(colocated).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, extra_body=body
        )
    assert info.value.body["param"] == param, info.value.body
    assert words in info.value.body["message"]


# ---- prompt logprobs (completions' echo with logprobs) -------------------------------------

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 10


def test_prompt_logprobs_equal_transformers_in_chunks_and_past_the_cache(
    tiny_model_dir: Any,
) -> None:
    """Every prompt token's logprob, rank and top-3 equal transformers' log-softmax over one
    forward of the whole prompt; in 48-token chunks; and again when the prompt is cached
    (it is computed, not read from the cache)."""
    transformers = pytest.importorskip("transformers")
    llm = LLM(tiny_model_dir, num_blocks=128, max_num_batched_tokens=48)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    first = llm.generate(LONG_PROMPT, params)[0]
    again = llm.generate(LONG_PROMPT, params)[0]
    plain = llm.generate(LONG_PROMPT, SamplingParams(temperature=0, max_tokens=1))[0]
    assert plain.num_cached_tokens > 0 and plain.prompt_logprobs is None
    assert again.num_cached_tokens == 0
    ids = list(first.prompt_token_ids)
    assert len(ids) > 100
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    reference = logits.log_softmax(dim=-1)
    for out in (first, again):
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            assert entry is not None and entry.token_id == ids[position]
            row = reference[position - 1]
            assert entry.logprob == pytest.approx(row[ids[position]].item(), abs=1e-4)
            value = row[ids[position]].item()  # ranks and the top allow for rounding ties
            assert (
                int((row > value + 1e-4).sum()) < entry.rank <= int((row > value - 1e-4).sum()) + 1
            )
            assert [v for _, v in entry.top] == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
            for token_id, v in entry.top:
                assert row[token_id].item() == pytest.approx(v, abs=1e-4)


def test_echo_with_logprobs_gives_the_prompt_tokens_theirs(
    colocated: Any, disagg: Any, llm: LLM
) -> None:
    """What lm-evaluation-harness sends for a loglikelihood (echo, max_tokens 1, logprobs
    1): every prompt token after the first has its logprob and top alternatives, the same
    as offline, streamed or not, colocated and 1P+1D (the prefill worker computes them)."""
    want = llm.generate(
        LONG_PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    )[0]
    entries = want.prompt_logprobs
    assert entries is not None
    for launcher in (colocated, disagg, disagg):  # the repeat: a prefix-cache hit, bypassed
        client = _client(launcher)
        out = client.completions.create(
            model="tiny", prompt=LONG_PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1,
            extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        lp = out.choices[0].logprobs
        n = len(entries)
        assert _token_ids(lp.tokens[:n]) == list(want.prompt_token_ids)
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:n] == pytest.approx([e.logprob for e in entries[1:]], abs=1e-4)
        for got, entry in zip(lp.top_logprobs[1:n], entries[1:]):
            assert f"token_id:{entry.token_id}" in got
            assert f"token_id:{entry.top[0][0]}" in got
        assert len(lp.tokens) == n + 1 and lp.token_logprobs[n] is not None
        streamed = client.completions.create(
            model="tiny", prompt=LONG_PROMPT, max_tokens=1, temperature=0, echo=True, logprobs=1,
            stream=True, extra_body={"return_tokens_as_token_ids": True},
        )  # fmt: skip
        values = [v for chunk in streamed for v in chunk.choices[0].logprobs.token_logprobs]
        assert values[1:n] == pytest.approx(lp.token_logprobs[1:n], abs=1e-6)


def test_prompt_logprobs_cross_the_wire() -> None:
    from kvrelay.protocol.messages import TokenEvent

    event = TokenEvent("r", "i", [5], 0, prompt_logprobs=[None, [3, -1.5, 2, [[4, -0.5]]]])
    again = decode(encode(event))
    assert again.prompt_logprobs == [None, [3, -1.5, 2, [[4, -0.5]]]]
    assert decode(encode(TokenEvent("r", "i", [5], 0))).prompt_logprobs is None


def test_vllm_prompt_logprobs_field_on_completions_and_chat(
    colocated: Any, disagg: Any, llm: LLM
) -> None:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or {"id": {logprob, rank,
    decoded_token}} holding the token and the top k, the same as offline; on a chat, one per
    token of the rendered prompt, beside the choices; not when streaming (a 400)."""
    for launcher in (colocated, disagg):
        client = _client(launcher)
        out = client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"prompt_logprobs": 2}
        )
        got = out.choices[0].model_extra["prompt_logprobs"]
        want = llm.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2))[
            0
        ].prompt_logprobs
        assert want is not None and len(got) == len(want) and got[0] is None
        for entry, mine in zip(got[1:], want[1:]):
            assert mine is not None
            assert entry[str(mine.token_id)]["logprob"] == pytest.approx(mine.logprob, abs=1e-4)
            assert entry[str(mine.token_id)]["rank"] == mine.rank
            assert {str(t) for t, _ in mine.top} <= set(entry) and len(entry) <= 3
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=1,
            extra_body={"prompt_logprobs": 0},
        )
        rendered = chat.model_extra["prompt_logprobs"]
        assert rendered[0] is None and chat.usage.prompt_tokens == len(rendered)
        assert all(len(entry) == 1 for entry in rendered[1:])  # the token alone
    with pytest.raises(openai.BadRequestError) as info:
        _client(colocated).completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, stream=True,
            extra_body={"prompt_logprobs": 1},
        )  # fmt: skip
    assert info.value.body["param"] == "prompt_logprobs"


def test_echo_with_max_tokens_0_scores_the_prompt_alone(
    colocated: Any, disagg: Any, llm: LLM
) -> None:
    """As vLLM takes it: the prompt's text, tokens and logprobs, no output token, finish
    ``length``, no completion tokens in the usage; streamed alike. Without echo it is a 400."""
    want = llm.generate(LONG_PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
    entries = want.prompt_logprobs
    assert entries is not None
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt=LONG_PROMPT, max_tokens=0, echo=True, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    for launcher in (colocated, disagg):
        client = _client(launcher)
        out = client.completions.create(**kwargs)
        choice = out.choices[0]
        assert choice.text == LONG_PROMPT and choice.finish_reason == "length"
        assert _token_ids(choice.logprobs.tokens) == list(want.prompt_token_ids)
        assert choice.logprobs.token_logprobs[0] is None
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [e.logprob for e in entries[1:]], abs=1e-4
        )
        assert out.usage.completion_tokens == 0
        assert out.usage.prompt_tokens == len(want.prompt_token_ids)
        chunks = list(client.completions.create(**kwargs, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == LONG_PROMPT
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        tokens = [
            t
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens
        ]
        assert _token_ids(tokens) == list(want.prompt_token_ids)
    with pytest.raises(openai.BadRequestError) as info:
        _client(colocated).completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
