"""Malformed and hostile requests get OpenAI-shaped errors and never hurt the server.

Raw bodies go over a real socket (httpx) to uvicorn serving ``create_app`` over the real
in-process engine. Each case asserts the exact status, the error shape, and the ``param``
where one field is at fault. Afterwards the server still serves and no KV block leaked.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from tests.engine_backend import API_MAX_MODEL_LEN, ApiServer

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_PROMPT = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
OK_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
UNSET = object()  # the case does not check param


class Case(NamedTuple):
    name: str
    path: str
    body: bytes | dict[str, Any]
    status: int
    param: object = UNSET  # expected error.param (None included) or UNSET
    code: str | None = None  # expected error.code, when it matters


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**base, **changes}


def _without(base: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in base.items() if k != key}


def _user(content: Any) -> dict[str, Any]:
    return _with(OK_CHAT, messages=[{"role": "user", "content": content}])


CASES = [
    # -- not JSON / not an object
    Case("bad_json", COMPLETIONS, b'{"prompt": ', 400, None),
    Case("json_array", COMPLETIONS, b"[1, 2, 3]", 400, None),
    Case("json_string", CHAT, b'"hello"', 400, None),
    Case("empty_body", COMPLETIONS, b"", 400, None),
    Case("invalid_utf8", COMPLETIONS, b'{"prompt": "\xff\xfe\xc3("}', 400, None),
    Case("lone_surrogate", COMPLETIONS, b'{"prompt": "a\\ud800b"}', 400, None),
    Case("nan_literal", COMPLETIONS, b'{"prompt": "a", "temperature": NaN}', 400, None),
    Case("deep_nesting", COMPLETIONS, b'{"prompt": ' + b"[" * 100_000, 400, None),
    Case("huge_int", COMPLETIONS, b'{"prompt": "a", "seed": ' + b"9" * 5000 + b"}", 400, None),
    # -- wrong types
    Case("max_tokens_str", COMPLETIONS, _with(OK_PROMPT, max_tokens="ten"), 400, "max_tokens"),
    Case("max_tokens_bool", COMPLETIONS, _with(OK_PROMPT, max_tokens=True), 400, "max_tokens"),
    Case("max_tokens_float", COMPLETIONS, _with(OK_PROMPT, max_tokens=1.5), 400, "max_tokens"),
    Case("temperature_str", CHAT, _with(OK_CHAT, temperature="hot"), 400, "temperature"),
    Case("messages_str", CHAT, _with(OK_CHAT, messages="hello"), 400, "messages"),
    Case("stream_str", CHAT, _with(OK_CHAT, stream="yes"), 400, "stream"),
    Case("model_int", COMPLETIONS, _with(OK_PROMPT, model=123), 400, "model"),
    Case("stop_int_list", COMPLETIONS, _with(OK_PROMPT, stop=[1]), 400, "stop[0]"),
    Case("nested_garbage", COMPLETIONS, _with(OK_PROMPT, prompt={"a": [[[{}]]]}), 400, "prompt"),
    Case("mixed_prompt", COMPLETIONS, _with(OK_PROMPT, prompt=["a", 1]), 400, "prompt"),
    Case("stream_options_str", CHAT, _with(OK_CHAT, stream_options="x"), 400, "stream_options"),
    Case("null_prompt", COMPLETIONS, _with(OK_PROMPT, prompt=None), 400, "prompt"),
    Case("null_messages", CHAT, _with(OK_CHAT, messages=None), 400, "messages"),
    Case("missing_prompt", COMPLETIONS, _without(OK_PROMPT, "prompt"), 400, "prompt"),
    Case("missing_messages", CHAT, _without(OK_CHAT, "messages"), 400, "messages"),
    # -- bad values
    Case("n_zero", COMPLETIONS, _with(OK_PROMPT, n=0), 400, "n"),
    Case("n_huge", CHAT, _with(OK_CHAT, n=1000), 400, "n"),
    Case("max_tokens_negative", COMPLETIONS, _with(OK_PROMPT, max_tokens=-5), 400, "max_tokens"),
    Case(
        "max_tokens_huge",
        COMPLETIONS,
        _with(OK_PROMPT, max_tokens=10**9),
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    Case(
        "max_completion_tokens_huge",
        CHAT,
        _with(OK_CHAT, max_completion_tokens=API_MAX_MODEL_LEN),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    ),
    Case("top_p_zero", COMPLETIONS, _with(OK_PROMPT, top_p=0), 400, "top_p"),
    Case("top_p_two", CHAT, _with(OK_CHAT, top_p=2), 400, "top_p"),
    Case("temperature_negative", CHAT, _with(OK_CHAT, temperature=-1), 400, "temperature"),
    Case("presence_penalty", CHAT, _with(OK_CHAT, presence_penalty=5), 400, "presence_penalty"),
    Case("seed_too_big", COMPLETIONS, _with(OK_PROMPT, seed=2**70), 400, "seed"),
    Case("cache_salt_int", COMPLETIONS, _with(OK_PROMPT, cache_salt=7), 400, "cache_salt"),
    Case("cache_salt_empty", CHAT, _with(OK_CHAT, cache_salt=""), 400, "cache_salt"),
    Case("cache_salt_long", COMPLETIONS, _with(OK_PROMPT, cache_salt="x" * 257), 400, "cache_salt"),
    Case("min_over_max", COMPLETIONS, _with(OK_PROMPT, min_tokens=5), 400, "min_tokens"),
    Case("logprobs_100", COMPLETIONS, _with(OK_PROMPT, logprobs=100), 400, "logprobs"),
    Case(
        "top_logprobs_100",
        CHAT,
        _with(OK_CHAT, logprobs=True, top_logprobs=100),
        400,
        "top_logprobs",
    ),
    Case("top_logprobs_alone", CHAT, _with(OK_CHAT, top_logprobs=2), 400, "top_logprobs"),
    Case(
        "stop_1000", COMPLETIONS, _with(OK_PROMPT, stop=[f"s{i}" for i in range(1000)]), 400, "stop"
    ),
    Case("stop_empty", COMPLETIONS, _with(OK_PROMPT, stop=""), 400, "stop"),
    Case("stop_token_negative", CHAT, _with(OK_CHAT, stop_token_ids=[-1]), 400, "stop_token_ids"),
    Case("suffix", COMPLETIONS, _with(OK_PROMPT, suffix="tail"), 400, "suffix"),
    Case(
        "unknown_model",
        COMPLETIONS,
        _with(OK_PROMPT, model="gpt-9"),
        404,
        "model",
        "model_not_found",
    ),
    Case("unknown_model_chat", CHAT, _with(OK_CHAT, model="x" * 10_000), 404, "model"),
    # -- prompts and messages
    Case("empty_prompt", COMPLETIONS, _with(OK_PROMPT, prompt=""), 400, "prompt"),
    Case("empty_prompt_list", COMPLETIONS, _with(OK_PROMPT, prompt=[]), 400, "prompt"),
    Case("empty_token_prompt", COMPLETIONS, _with(OK_PROMPT, prompt=[[]]), 400, "prompt"),
    Case("token_out_of_vocab", COMPLETIONS, _with(OK_PROMPT, prompt=[1, 99_999]), 400, "prompt"),
    Case("token_negative", COMPLETIONS, _with(OK_PROMPT, prompt=[5, -1]), 400, "prompt"),
    Case(
        "prompt_too_long_ids",
        COMPLETIONS,
        _with(OK_PROMPT, prompt=[5] * (API_MAX_MODEL_LEN + 10)),
        400,
        "prompt",
        "context_length_exceeded",
    ),
    Case(
        "prompt_too_long_text",
        CHAT,
        _user("many words " * 2000),
        400,
        "messages",
        "context_length_exceeded",
    ),
    Case("empty_messages", CHAT, _with(OK_CHAT, messages=[]), 400, "messages"),
    Case(
        "bad_role",
        CHAT,
        _with(OK_CHAT, messages=[{"role": "wizard", "content": "hi"}]),
        400,
        "messages[0].role",
    ),
    Case("message_not_object", CHAT, _with(OK_CHAT, messages=["hi"]), 400, "messages[0]"),
    Case("user_content_null", CHAT, _user(None), 400, "messages[0]"),
    Case(
        "image_part",
        CHAT,
        _user([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]),
        400,
        "messages[0].content[0]",
    ),
    Case("part_without_text", CHAT, _user([{"type": "text"}]), 400, "messages[0].content[0]"),
    Case(
        "system_not_first",
        CHAT,
        _with(
            OK_CHAT, messages=[{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        ),
        400,
        "messages",
    ),
    Case(
        "reserved_template_kwarg",
        CHAT,
        _with(OK_CHAT, chat_template_kwargs={"messages": []}),
        400,
        "chat_template_kwargs",
    ),
    # -- fields kvrelay does not honour: never ignored silently
    Case(
        "unknown_field",
        CHAT,
        _with(OK_CHAT, temprature=0.2),
        400,
        "temprature",
        "unrecognized_field",
    ),
    Case("unknown_field_completion", COMPLETIONS, _with(OK_PROMPT, best_off=2), 400, "best_off"),
    Case("functions", CHAT, _with(OK_CHAT, functions=[{"name": "f"}]), 400, "functions"),
    Case("function_call", CHAT, _with(OK_CHAT, function_call="auto"), 400, "function_call"),
    Case("audio", CHAT, _with(OK_CHAT, audio={"voice": "alloy"}), 400, "audio"),
    Case("modalities_audio", CHAT, _with(OK_CHAT, modalities=["text", "audio"]), 400, "modalities"),
    Case("prediction", CHAT, _with(OK_CHAT, prediction={"type": "content"}), 400, "prediction"),
    Case("reasoning_effort", CHAT, _with(OK_CHAT, reasoning_effort="low"), 400, "reasoning_effort"),
    Case("store_true", CHAT, _with(OK_CHAT, store=True), 400, "store"),
    Case("logit_bias_key", CHAT, _with(OK_CHAT, logit_bias={"a": 1}), 400, "logit_bias"),
    Case(
        "logit_bias_value", COMPLETIONS, _with(OK_PROMPT, logit_bias={"1": 101}), 400, "logit_bias"
    ),
    Case(
        "logit_bias_vocab",
        COMPLETIONS,
        _with(OK_PROMPT, logit_bias={"99999": 1}),
        400,
        "logit_bias",
    ),
    Case(
        "allowed_out_of_vocab",
        CHAT,
        _with(OK_CHAT, allowed_token_ids=[99_999]),
        400,
        "allowed_token_ids",
    ),
    # -- size and routing
    Case("body_10mb", COMPLETIONS, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413, None),
    Case("unknown_route", "/v1/engines/davinci/completions", OK_PROMPT, 404, None),
    Case("wrong_method", "/v1/models", OK_PROMPT, 405, None),
]


@pytest.fixture(scope="module")
def http(api_server: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=api_server.base_url, timeout=30) as client:
        yield client


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    return error


def test_table_has_enough_cases() -> None:
    assert len(CASES) >= 25
    assert len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(http: httpx.Client, case: Case) -> None:
    content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
    response = http.post(case.path, content=content, headers={"Content-Type": "application/json"})
    error = assert_openai_error(response, case.status)
    if case.param is not UNSET:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error


def test_chunked_body_over_limit_is_413(http: httpx.Client) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"prompt": "'
        for _ in range(50):
            yield b"a" * (100 << 10)
        yield b'"}'

    headers = {"Content-Type": "application/json"}
    assert_openai_error(http.post(COMPLETIONS, content=chunks(), headers=headers), 413)


def test_content_length_over_limit_is_refused_before_reading(api_server: ApiServer) -> None:
    """Only headers are sent: the 413 must come without the server waiting for the body."""
    host, port = api_server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1073741824\r\n\r\n"
        )
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}}"):
            data = sock.recv(65536)
            if not data:
                break
            reply += data
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413")
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_null_optional_fields_mean_unset(http: httpx.Client) -> None:
    body = {
        **OK_CHAT,
        "temperature": None,
        "top_p": None,
        "stop": None,
        "n": None,
        "seed": None,
        "user": None,
        "stream": None,
        "logprobs": None,
        "add_generation_prompt": None,
        "metadata": {"anything": ["goes"]},
        "store": False,
        "response_format": {"type": "text"},
        "service_tier": "auto",
        "modalities": ["text"],
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "functions": None,
        "logit_bias": None,
        "some_future_field": None,
    }
    response = http.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1


FUZZ_VALUES: list[Any] = [None, True, -1, 0, 1.5, 1e308, "x", "", [], [None], {}, {"a": 1}]
FUZZ_FIELDS = [
    "model", "prompt", "messages", "n", "max_tokens", "max_completion_tokens", "temperature",
    "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logprobs", "top_logprobs", "echo", "stream", "stream_options",
    "ignore_eos", "min_tokens", "stop_token_ids", "include_stop_str_in_output",
    "skip_special_tokens", "user", "best_of", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs", "return_tokens_as_token_ids", "response_format",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "tools", "tool_choice", "parallel_tool_calls", "chat_template", "logit_bias",
    "allowed_token_ids", "store", "modalities", "functions", "metadata", "prompt_logprobs",
]  # fmt: skip


def test_fuzz_fields_never_crash(http: httpx.Client) -> None:
    """Every field x a set of odd values: a success or a clean 4xx, never a 5xx."""
    for path, base in ((COMPLETIONS, OK_PROMPT), (CHAT, OK_CHAT)):
        for name in FUZZ_FIELDS:
            for value in FUZZ_VALUES:
                response = http.post(path, json={**base, name: value})
                assert response.status_code in (200, 400, 404), (path, name, value, response.text)
                if response.status_code != 200:
                    assert_openai_error(response, response.status_code)


def test_server_still_serves_and_no_blocks_leaked(
    http: httpx.Client, api_server: ApiServer
) -> None:
    for path, body in ((COMPLETIONS, OK_PROMPT), (CHAT, OK_CHAT)):
        response = http.post(path, json=_with(body, max_tokens=3))
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert api_server.backend.is_ready()
    api_server.backend.check_no_leaks()


def test_every_bad_request_against_a_real_cluster(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The same table against router + prefill + decode processes; then it still serves."""
    from tests.cluster_harness import running_cluster

    router_args = ("--served-model-name", "tiny", "--max-model-len", str(API_MAX_MODEL_LEN))
    with (
        running_cluster(tiny_model_dir, tmp_path, router_args=router_args) as launcher,
        httpx.Client(base_url=launcher.url, timeout=30) as client,
    ):
        for case in CASES:
            content = case.body if isinstance(case.body, bytes) else json.dumps(case.body).encode()
            response = client.post(
                case.path, content=content, headers={"Content-Type": "application/json"}
            )
            error = assert_openai_error(response, case.status)
            if case.code is not None:
                assert error["code"] == case.code, (case.name, error)
        ok = client.post(COMPLETIONS, json={**OK_PROMPT, "max_tokens": 4})
        assert ok.status_code == 200, ok.text
        assert ok.json()["usage"]["completion_tokens"] == 4
