"""The OpenAI-compatible HTTP API end to end: the official ``openai`` client against uvicorn
serving ``create_app`` over a real in-process engine (tiny model).

Every response is re-validated strictly with the ``openai`` package's own models, and any
field they do not know must be one of kvrelay's documented extensions (drift check).
Every test ends with a KV-block leak check on the engine.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypeVar

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel

from kvrelay import LLM, SamplingParams
from kvrelay.router.api import create_app
from kvrelay.router.api_settings import ApiSettings
from kvrelay.router.backend import (
    Backend,
    Delta,
    GenerateInput,
    GenerationFailed,
    Overloaded,
    Unavailable,
)
from kvrelay.router.token_strings import TokenStrings
from kvrelay.text.tokenizer import Tokenizer
from tests.engine_backend import API_ADMIN_TOKEN, API_MAX_MODEL_LEN, API_MODEL_NAMES, ApiServer

ModelT = TypeVar("ModelT", bound=BaseModel)
EXTENSIONS = frozenset(
    {"stop_reason", "kvrelay_cached_tokens_by_tier", "max_model_len", "root", "parent"}
)
PROMPT = "The quick brown fox"
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there!"},
]
IDS = {"return_tokens_as_token_ids": True}


# ---- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(api_server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_model_dir: Any) -> LLM:
    return LLM(tiny_model_dir, num_blocks=128, max_model_len=API_MAX_MODEL_LEN)


@pytest.fixture(autouse=True)
def _no_leaks(api_server: ApiServer) -> Iterator[None]:
    yield
    api_server.backend.check_no_leaks()


def validate(model: type[ModelT], data: Any) -> ModelT:
    """Strict validation with the openai model; unknown fields must be our extensions."""
    if isinstance(data, BaseModel):
        data = data.to_dict() if hasattr(data, "to_dict") else data.model_dump()
    obj = model.model_validate(data, strict=True)
    _check_extras(obj, model.__name__)
    return obj


def _check_extras(value: Any, path: str) -> None:
    if isinstance(value, BaseModel):
        unknown = set(value.model_extra or {}) - EXTENSIONS
        assert not unknown, f"unexpected fields {unknown} in {path}"
        for name in type(value).model_fields:
            _check_extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_extras(item, f"{path}[{i}]")


def validate_completion_chunk(chunk: Completion) -> Completion:
    """Streamed completions reuse ``Completion``, whose finish_reason is not nullable."""
    data = chunk.to_dict()
    for choice in data["choices"]:
        assert choice["finish_reason"] in (None, "stop", "length")
        choice["finish_reason"] = choice["finish_reason"] or "length"
    return validate(Completion, data)


def token_ids(tokens: list[str]) -> list[int]:
    """Ids back from ``return_tokens_as_token_ids`` tokens (``token_id:123``)."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# ---- import hygiene -----------------------------------------------------------------------


def test_router_never_imports_torch(tiny_model_dir: Any) -> None:
    code = f"""
import sys
from kvrelay.text.tokenizer import Tokenizer
from kvrelay.router import api, errors, request_models, responses, sse
from kvrelay.router.backend import Backend

class Idle(Backend):
    model_name, max_model_len = "m", 16
    def is_ready(self): return True
    async def generate(self, request):
        yield None

api.create_app(Idle(), Tokenizer.from_pretrained({str(tiny_model_dir)!r}), api.ApiSettings())
assert "torch" not in sys.modules, "kvrelay.router imported torch"
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_token_bytes_are_true_bytes_for_partial_characters(api_server: ApiServer) -> None:
    tok = api_server.tokenizer
    strings = TokenStrings(tok)
    for text in ("😀 naïve 你好", "plain ascii"):
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(bytes(strings.utf8(i)) for i in ids) == text.encode()
        assert "".join(strings.text(i) for i in ids).replace("\ufffd", "") in text
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in strings.text(i)]
    assert partial, "the byte-level vocabulary has tokens holding part of a character"
    assert all(len(strings.utf8(i)) == len(tok.convert_ids_to_tokens(i)) for i in partial)


# ---- operations -----------------------------------------------------------------------------


def test_models_health_ready(client: openai.OpenAI, api_server: ApiServer) -> None:
    models = list(client.models.list())
    assert [m.id for m in models] == list(API_MODEL_NAMES)
    for m in models:
        validate(Model, m)
        assert m.model_extra is not None and m.model_extra["max_model_len"] == API_MAX_MODEL_LEN
    assert httpx.get(f"{api_server.base_url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{api_server.base_url}/ready").status_code == 200


def test_admin_token_dependency(api_server: ApiServer) -> None:
    url = f"{api_server.base_url}/admin/ping"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_ADMIN_TOKEN}):
        r = httpx.get(url, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    auth = {"Authorization": f"Bearer {API_ADMIN_TOKEN}"}
    r = httpx.get(url, headers=auth)
    assert r.status_code == 200 and r.json() == {"status": "pong"}


def test_routes_added_by_the_lead_keep_the_error_shape(api_server: ApiServer) -> None:
    url = f"{api_server.base_url}/admin/scale"
    auth = {"Authorization": f"Bearer {API_ADMIN_TOKEN}"}
    assert httpx.post(url, json={"num_decode": 2}).status_code == 401
    assert httpx.post(url, json={"num_decode": 2}, headers=auth).json() == {"num_decode": 2}
    r = httpx.post(url, json={"num_decode": "many"}, headers=auth)
    assert r.status_code == 400  # FastAPI's 422 never reaches a client
    assert r.json()["error"]["param"] == "num_decode"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_api_settings_are_validated() -> None:
    for bad in ({"max_n": 0}, {"max_body_bytes": 10}, {"admin_token": ""}, {"max_logprobs": 99}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ApiSettings(**bad)  # type: ignore[arg-type]


# ---- completions ----------------------------------------------------------------------------


def test_completion_greedy_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8))[0]
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=0, extra_body=IDS
    )
    resp = validate(Completion, resp)
    choice = resp.choices[0]
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    assert token_ids(choice.logprobs.tokens) == expected.outputs[0].token_ids
    assert choice.text == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    usage = resp.usage
    assert usage is not None
    assert usage.prompt_tokens == len(expected.prompt_token_ids)
    assert usage.completion_tokens == len(expected.outputs[0].token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert usage.model_extra is not None and "kvrelay_cached_tokens_by_tier" in usage.model_extra


def test_completion_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs, logprobs=0, extra_body=IDS)
    chunks = list(
        client.completions.create(
            **kwargs,
            logprobs=0,
            extra_body=IDS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for chunk in chunks:
        validate_completion_chunk(chunk)
    *deltas, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in deltas)
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    tokens = [t for c in deltas if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert whole.choices[0].logprobs is not None
    assert tokens == whole.choices[0].logprobs.tokens
    assert [c.choices[0].finish_reason for c in deltas][-1] == whole.choices[0].finish_reason
    assert {c.id for c in chunks} == {chunks[0].id}


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(
    client: openai.OpenAI,
) -> None:
    """vLLM's ``stream_options.continuous_usage_stats``: with ``include_usage``, each chunk
    carries the usage up to it; the last (no choices) equals the non-stream usage."""
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    for create, kwargs in (
        (client.completions.create, {"prompt": PROMPT}),
        (client.chat.completions.create, {"messages": MESSAGES}),
    ):
        chunks = list(
            create(
                model="tiny",
                max_tokens=8,
                temperature=0,
                stream=True,
                stream_options=options,
                **kwargs,
            )
        )
        usages = [c.usage for c in chunks]
        assert all(u is not None for u in usages)
        counts = [u.completion_tokens for u in usages if u is not None]
        assert counts == sorted(counts) and counts[-1] > counts[0]
        assert len({u.prompt_tokens for u in usages if u is not None}) == 1
        assert chunks[-1].choices == []
        if create == client.completions.create:
            assert chunks[-1].usage == whole.usage
    plain = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=4, stream=True,
            stream_options={"continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )  # fmt: skip
    assert all(c.usage is None for c in plain)  # without include_usage: no usage at all


def test_completion_token_prompt_and_batch(client: openai.OpenAI, api_server: ApiServer) -> None:
    other = "Another prompt"
    single = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0)
    ids = api_server.tokenizer.encode(PROMPT)
    by_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert by_ids.choices[0].text == single.choices[0].text
    batch = client.completions.create(
        model="tiny",
        prompt=[PROMPT, other],
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    batch = validate(Completion, batch)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    texts = [c.text for c in batch.choices]
    assert texts[0] == texts[1] == single.choices[0].text
    assert texts[2] == texts[3]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == len(ids) + len(api_server.tokenizer.encode(other))
    assert batch.usage.completion_tokens == 4 * 4


def test_default_max_tokens_and_prefix_cache_usage(client: openai.OpenAI) -> None:
    prompt = "A prompt long enough to fill more than two KV blocks of sixteen tokens each, " * 2
    first = client.completions.create(model="tiny", prompt=prompt, extra_body={"ignore_eos": True})
    assert first.usage is not None and first.usage.completion_tokens == 16  # OpenAI's default
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    usage = validate(Completion, again).usage
    assert usage is not None and usage.prompt_tokens_details is not None
    cached = usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 32 <= cached < usage.prompt_tokens and cached % 16 == 0
    assert usage.model_extra == {"kvrelay_cached_tokens_by_tier": {"device": cached}}


def test_n_with_seed_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    params = SamplingParams(n=2, seed=1234, temperature=1.0, max_tokens=6, ignore_eos=True)
    expected = offline.generate(PROMPT, params)[0]
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=2,
        seed=1234,
        temperature=1.0,
        max_tokens=6,
        logprobs=0,
        extra_body={**IDS, "ignore_eos": True},
    )
    resp = validate(Completion, resp)
    got = [token_ids(c.logprobs.tokens) for c in resp.choices if c.logprobs and c.logprobs.tokens]
    assert got == [o.token_ids for o in expected.outputs]
    assert got[0] != got[1]
    assert resp.usage is not None and resp.usage.completion_tokens == 12


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    resp = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    resp = validate(Completion, resp)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert resp.usage is not None
    num = resp.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == num
    assert lp.text_offset[0] == 0
    for i in range(1, num):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) >= logprob


def test_stop_strings_cut_text(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    base = client.completions.create(**kwargs).choices[0].text
    cut = next(k for k in range(2, len(base) - 2) if base.find(base[k : k + 2]) == k)
    stop = base[cut : cut + 2]
    resp = validate(Completion, client.completions.create(**kwargs, stop=[stop, "\x00never"]))
    choice = resp.choices[0]
    assert choice.text == base[:cut] and choice.finish_reason == "stop"
    assert choice.model_extra == {"stop_reason": stop}
    kwargs["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(**kwargs, stop=stop)
    assert kept.choices[0].text == base[: cut + 2]
    streamed = client.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == base[: cut + 2]


def test_echo(client: openai.OpenAI, api_server: ApiServer) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0)
    plain = client.completions.create(**kwargs).choices[0].text
    echoed = client.completions.create(**kwargs, echo=True)
    assert echoed.choices[0].text == PROMPT + plain
    streamed = list(client.completions.create(**kwargs, echo=True, stream=True))
    assert streamed[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in streamed) == PROMPT + plain
    # With logprobs every prompt token but the first has its logprob and top alternatives
    # (OpenAI's legacy completions; what lm-evaluation-harness reads for loglikelihoods).
    r = httpx.post(
        f"{api_server.base_url}/v1/completions", json={**kwargs, "echo": True, "logprobs": 1}
    )
    lp = r.json()["choices"][0]["logprobs"]
    num_prompt = len(api_server.tokenizer.encode(PROMPT))
    assert len(lp["tokens"]) == num_prompt + r.json()["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(x, float) for x in lp["token_logprobs"][1:])
    assert all(len(top) in (1, 2) for top in lp["top_logprobs"][1:])  # the top 1 and the token


def _prompt_ids(res: Completion) -> list[int]:
    """The prompt's token ids of an echoed completion (``max_tokens: 0``, token ids as text)."""
    logprobs = res.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    return [int(t.removeprefix("token_id:")) for t in logprobs.tokens]


def test_add_special_tokens(client: openai.OpenAI, api_server: ApiServer) -> None:
    """vLLM's ``add_special_tokens``: completions add the tokenizer's bos by default, chat
    does not (its template writes what it needs); either way round on request."""
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    with_bos = client.completions.create(**kwargs, extra_body=IDS)
    without = client.completions.create(**kwargs, extra_body={**IDS, "add_special_tokens": False})
    tokenizer = api_server.tokenizer
    assert _prompt_ids(with_bos) == tokenizer.encode(PROMPT, True)
    assert _prompt_ids(without) == tokenizer.encode(PROMPT, False)
    assert len(_prompt_ids(with_bos)) == len(_prompt_ids(without)) + 1  # the tiny model's bos
    chat = dict(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**chat)
    added = client.chat.completions.create(**chat, extra_body={"add_special_tokens": True})
    assert plain.usage is not None and added.usage is not None
    assert added.usage.prompt_tokens == plain.usage.prompt_tokens + 1


def test_truncate_prompt_tokens_keeps_the_last_tokens(
    client: openai.OpenAI, api_server: ApiServer
) -> None:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last k tokens, text or ids; -1 keeps
    the context window; a long prompt that would be refused is served truncated."""
    long_text = " ".join(f"word{i}" for i in range(200))  # over the 256-token window
    ids = api_server.tokenizer.encode(long_text, True)
    assert len(ids) > API_MAX_MODEL_LEN
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=4, temperature=0, logprobs=0)
    kept = client.completions.create(
        prompt=long_text, **kwargs, extra_body={**IDS, "truncate_prompt_tokens": 40}
    )
    reference = client.completions.create(prompt=ids[-40:], **kwargs, extra_body=IDS)
    assert kept.usage is not None and kept.usage.prompt_tokens == 40
    assert kept.choices[0].text == reference.choices[0].text
    echoed = client.completions.create(
        prompt=ids, model="tiny", max_tokens=0, echo=True, logprobs=0,
        extra_body={**IDS, "truncate_prompt_tokens": 7},
    )  # fmt: skip
    assert _prompt_ids(echoed) == ids[-7:]
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"truncate_prompt_tokens": 5}
    )
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    # the whole window: no room is left for output, the usual context-length error
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(prompt=long_text, model="tiny", max_tokens=1,
                                  extra_body={"truncate_prompt_tokens": -1})  # fmt: skip
    assert _error(caught)["code"] == "context_length_exceeded"
    assert "256 tokens" in _error(caught)["message"]
    for bad in (0, -2, API_MAX_MODEL_LEN + 1):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(
                prompt=PROMPT, model="tiny", max_tokens=1,
                extra_body={"truncate_prompt_tokens": bad},
            )  # fmt: skip
        assert _error(caught)["param"] == "truncate_prompt_tokens"


def _error(caught: pytest.ExceptionInfo[openai.BadRequestError]) -> dict[str, Any]:
    body = caught.value.body
    assert isinstance(body, dict)
    return body


def test_served_model_alias(client: openai.OpenAI) -> None:
    resp = client.completions.create(model="tiny-alias", prompt=PROMPT, max_tokens=1)
    assert resp.model == "tiny-alias"


# ---- chat -----------------------------------------------------------------------------------


def test_chat_greedy_matches_offline(client: openai.OpenAI, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=8))[0]
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, extra_body=IDS
    )  # type: ignore[call-overload]
    resp = validate(ChatCompletion, resp)
    choice = resp.choices[0]
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert token_ids([e.token for e in choice.logprobs.content]) == expected.outputs[0].token_ids
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert resp.usage.completion_tokens == len(expected.outputs[0].token_ids)


def test_chat_stream_matches_non_stream(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    for chunk in chunks:
        validate(ChatCompletionChunk, chunk)
    *deltas, last = chunks
    assert last.choices == [] and last.usage == whole.usage
    assert deltas[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    assert text == whole.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_chat_logprobs_shape_and_bytes(client: openai.OpenAI, api_server: ApiServer) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    resp = validate(ChatCompletion, client.chat.completions.create(**kwargs))
    content = resp.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and resp.usage is not None
    assert len(content) == resp.usage.completion_tokens
    special = {
        api_server.tokenizer.decode([i], False) for i in api_server.tokenizer.all_special_ids
    }
    joined = b"".join(bytes(e.bytes or []) for e in content if e.token not in special)
    assert joined.decode("utf-8", "replace") == resp.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob
    streamed = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        logprobs = validate(ChatCompletionChunk, chunk).choices[0].logprobs
        streamed += logprobs.content or [] if logprobs else []
    assert [e.token for e in streamed] == [e.token for e in content]


def test_chat_max_completion_tokens_and_default_length(
    client: openai.OpenAI, api_server: ApiServer
) -> None:
    resp = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert resp.usage is not None and resp.usage.completion_tokens == 3
    assert resp.choices[0].finish_reason == "length"
    # Without a limit, chat runs to the end of the context window.
    words = "word " * 300
    tok = api_server.tokenizer
    while len(tok.encode_chat([{"role": "user", "content": words}])) > API_MAX_MODEL_LEN - 5:
        words = words[:-5]
    num_prompt = len(tok.encode_chat([{"role": "user", "content": words}]))
    resp = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": words}], extra_body={"ignore_eos": True}
    )
    assert resp.usage is not None and resp.usage.prompt_tokens == num_prompt
    assert resp.usage.completion_tokens == API_MAX_MODEL_LEN - num_prompt
    assert resp.choices[0].finish_reason == "length"


def test_chat_content_parts_and_continue_final_message(
    client: openai.OpenAI, api_server: ApiServer
) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", max_tokens=3, temperature=0)
    as_text = client.chat.completions.create(
        **kwargs, messages=[{"role": "user", "content": "Hello\nthere"}]
    )
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]
    as_parts = client.chat.completions.create(
        **kwargs, messages=[{"role": "user", "content": parts}]
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage == as_text.usage
    messages = [*MESSAGES, {"role": "assistant", "content": "Sure, "}]
    resp = client.chat.completions.create(
        **kwargs,
        messages=messages,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    rendered = api_server.tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    rendered = rendered[: rendered.rfind("Sure, ") + len("Sure, ")]
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(api_server.tokenizer.encode(rendered, False))


def test_async_client_chat_n2_stream_interleaves(api_server: ApiServer) -> None:
    async def run() -> tuple[dict[int, str], dict[int, str], list[int]]:
        async with openai.AsyncOpenAI(
            base_url=f"{api_server.base_url}/v1", api_key="unused", max_retries=0
        ) as aclient:
            kwargs: dict[str, Any] = dict(
                model="tiny", messages=MESSAGES, n=2, seed=7, temperature=1.0, max_tokens=5
            )
            whole = await aclient.chat.completions.create(**kwargs)
            stream: AsyncIterator[ChatCompletionChunk] = await aclient.chat.completions.create(
                **kwargs, stream=True
            )
            texts: dict[int, str] = {0: "", 1: ""}
            order = []
            async for chunk in stream:
                validate(ChatCompletionChunk, chunk)
                for choice in chunk.choices:
                    order.append(choice.index)
                    texts[choice.index] += choice.delta.content or ""
        expected = {c.index: c.message.content or "" for c in whole.choices}
        return texts, expected, order

    texts, expected, order = asyncio.run(run())
    assert texts == expected
    assert order[:2] == [0, 1]  # the role chunks come first
    assert set(order) == {0, 1}


# ---- disconnects ------------------------------------------------------------------------------


def test_disconnect_mid_stream_aborts(api_server: ApiServer) -> None:
    backend = api_server.backend
    backend.step_delay_s = 0.05
    before = backend.num_aborted
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "n": 2, "stream": True}
    try:
        with (
            httpx.Client(base_url=api_server.base_url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json={**body, "ignore_eos": True}) as r,
        ):
            assert r.status_code == 200
            events = (line for line in r.iter_lines() if line.startswith("data: "))
            first = [json.loads(next(events).removeprefix("data: ")) for _ in range(4)]
        assert {c["choices"][0]["index"] for c in first} == {0, 1}
        assert backend.num_aborted == before  # still running when the client left
        assert wait_for(lambda: backend.num_aborted == before + 2)
    finally:
        backend.step_delay_s = 0.0


def test_disconnect_while_waiting_non_stream_aborts(api_server: ApiServer) -> None:
    backend = api_server.backend
    backend.step_delay_s = 0.05
    before = backend.num_aborted
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 150, "ignore_eos": True}
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{api_server.base_url}/v1/completions", json=body, timeout=0.5)
        assert wait_for(lambda: backend.num_aborted == before + 1)
    finally:
        backend.step_delay_s = 0.0


# ---- backend errors (a scripted backend: the engine cannot be made to fail on cue) --------------


class ScriptedBackend(Backend):
    """Yields one delta, then fails or finishes as told."""

    model_name = "scripted"
    max_model_len = 64

    def __init__(
        self,
        before: Exception | None = None,
        after: Exception | None = None,
        finish_reason: str = "stop",
        ready: bool = True,
    ) -> None:
        self.before, self.after = before, after
        self.finish_reason = finish_reason
        self.ready = ready
        self.num_closed = 0

    def is_ready(self) -> bool:
        return self.ready

    async def generate(self, request: GenerateInput) -> AsyncIterator[Delta]:
        try:
            if self.before is not None:
                raise self.before
            yield Delta([5], "a", num_prompt_tokens=len(request.prompt_token_ids))
            if self.after is not None:
                raise self.after
            yield Delta([6], "b", finished=True, finish_reason=self.finish_reason)
        finally:
            self.num_closed += 1


def _scripted_call(tokenizer: Tokenizer, backend: ScriptedBackend, body: dict[str, Any]) -> Any:
    async def run() -> httpx.Response:
        app = create_app(backend, tokenizer, ApiSettings())
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            if body:
                return await http.post("/v1/completions", json={"prompt": "hi", **body})
            return await http.get("/ready")

    return asyncio.run(run())


@pytest.mark.parametrize(
    ("error", "status", "retry_after"),
    [
        (Overloaded("queues full", retry_after=2.5), 429, "3"),
        (Unavailable("no decode instance"), 503, "1"),
        (GenerationFailed("every worker died"), 500, None),
        (RuntimeError("a bug in a backend"), 500, None),
    ],
)
def test_backend_errors_before_first_delta(
    api_server: ApiServer, error: Exception, status: int, retry_after: str | None
) -> None:
    backend = ScriptedBackend(before=error)
    for stream in (False, True):
        r = _scripted_call(api_server.tokenizer, backend, {"stream": stream, "n": 2})
        assert r.status_code == status
        assert r.headers.get("retry-after") == retry_after
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert backend.num_closed == 4


def test_backend_error_mid_stream_is_an_sse_event(api_server: ApiServer) -> None:
    backend = ScriptedBackend(after=GenerationFailed("decode worker died"))
    r = _scripted_call(api_server.tokenizer, backend, {"stream": True})
    events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    error = json.loads(events[-2])["error"]
    assert error["message"] == "decode worker died" and error["code"] == "generation_failed"
    aborted = ScriptedBackend(finish_reason="abort")
    r = _scripted_call(api_server.tokenizer, aborted, {"stream": False})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_ready_reflects_backend(api_server: ApiServer) -> None:
    r = _scripted_call(api_server.tokenizer, ScriptedBackend(ready=False), {})
    assert r.status_code == 503 and r.json()["error"]["code"] == "not_ready"
    assert _scripted_call(api_server.tokenizer, ScriptedBackend(), {}).status_code == 200
