"""Structured outputs and tool calls through the cluster, with the official ``openai`` client.

Runs colocated and 1P+1D (real processes): every completion of a random-weight model validates
against its schema, greedy output is the same on both and offline, a decode worker killed
mid-stream leaves the grammar intact, and what is not supported is a 400 naming the field.
``model_dir`` can be overridden by a module that runs these on another checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from pathlib import Path
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from kvrelay import LLM, SamplingParams
from kvrelay.protocol.sampling_params import StructuredOutput
from tests.cluster_harness import running_cluster, worker_stats
from tests.structured_cases import (
    LONG_MAX_TOKENS,
    LONG_SCHEMA,
    MAX_TOKENS,
    SCHEMAS,
    schema_format,
    spec_text,
)

ROUTER_ARGS = ("--dead-after", "1.5", "--served-model-name", "tiny", "--tool-call-parser", "hermes")
PROMPT = "Describe the record as JSON"
MESSAGES = [{"role": "user", "content": PROMPT}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir


@pytest.fixture(scope="module")
def colocated(model_dir, tmp_path_factory):
    """A colocated worker that builds the grammar tables on a thread at start: the default,
    which conftest turns off for the suite's other workers (KVRELAY_GRAMMAR_WARM_UP=0)."""
    log_dir = tmp_path_factory.mktemp("colocated")
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("KVRELAY_GRAMMAR_WARM_UP", "1")
            cluster = running_cluster(
                model_dir, log_dir, num_prefill=0, num_decode=0, num_colocated=1,
                router_args=ROUTER_ARGS,
            )  # fmt: skip
            launcher = stack.enter_context(cluster)
        yield launcher


@pytest.fixture(scope="module")
def disagg(model_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("disagg")
    with running_cluster(model_dir, log_dir, router_args=ROUTER_ARGS) as launcher:
        yield launcher


@pytest.fixture(params=["colocated", "disagg"])
def cluster(request):
    return request.getfixturevalue(request.param)


def test_grammar_tables_build_at_start_or_on_the_first_structured_request(colocated, disagg):
    """By default a worker builds xgrammar's tables on its warm-up thread as it starts serving;
    with KVRELAY_GRAMMAR_WARM_UP=0 (disagg here) on the first structured request instead."""
    built = "built the grammar compiler's tokenizer tables in "

    def lines(launcher) -> list[str]:
        return [
            line
            for path in sorted(Path(launcher.spec.log_dir).glob("*.log"))
            for line in path.read_text().splitlines()
            if built in line
        ]

    deadline = time.monotonic() + 60
    while not lines(colocated) and time.monotonic() < deadline:  # unless a test asked already
        time.sleep(0.2)
    assert [line.endswith("(grammar-warm-up thread)") for line in lines(colocated)] == [True]
    assert not any("grammar-warm-up" in line for line in lines(disagg))
    reply = _client(disagg).chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert reply.choices[0].message.content in ("yes", "no")
    deferred = lines(disagg)
    assert deferred and all(line.endswith("(MainThread thread)") for line in deferred), deferred


def _client(launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


def _stream_text(stream) -> tuple[str, str | None]:
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_choice_validates_stream_and_not(cluster, name):
    schema = SCHEMAS[name]
    client = _client(cluster)
    fmt = schema_format(name, schema)
    greedy = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, temperature=0, max_tokens=MAX_TOKENS
    )
    sampled = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=fmt, n=3, seed=11, max_tokens=MAX_TOKENS
    )
    for choice in [*greedy.choices, *sampled.choices]:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        response_format=fmt,
        temperature=0.9,
        max_tokens=MAX_TOKENS,
        stream=True,
    )
    text, finish = _stream_text(stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), schema)


def test_greedy_is_the_same_colocated_disaggregated_and_offline(colocated, disagg, model_dir):
    """The first token is sampled on prefill; decode goes on from a replayed matcher; a prefix
    cache hit (the second disaggregated run) changes nothing."""
    schema = SCHEMAS["nested"]
    prompt = " ".join([PROMPT] * 8)  # several full KV blocks: the repeat hits the cache
    llm = LLM(model_dir, num_blocks=256)
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutput("json", spec_text(schema)),
    )
    offline = llm.generate(prompt, params)[0].outputs[0].text
    texts, cached = [], []
    for launcher in (colocated, disagg, disagg):
        out = _client(launcher).completions.create(
            model="tiny",
            prompt=prompt,
            temperature=0,
            max_tokens=MAX_TOKENS,
            extra_body={"response_format": schema_format("nested", schema)},
        )
        texts.append(out.choices[0].text)
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert texts == [offline] * 3
    assert cached[2] > 0
    jsonschema.validate(json.loads(offline), schema)


def test_vllm_structured_outputs_and_guided_aliases(colocated):
    client = _client(colocated)
    bodies = [
        {"structured_outputs": {"choice": ["left", "right"]}},
        {"guided_choice": ["left", "right"]},
        {"structured_outputs": {"regex": "(left|right)-[0-9]"}},
        {"guided_regex": "(left|right)-[0-9]"},
    ]
    for body in bodies:
        out = client.completions.create(
            model="tiny", prompt="go", max_tokens=20, seed=3, n=2, extra_body=body
        )
        for choice in out.choices:
            assert choice.text.split("-")[0] in ("left", "right"), (body, choice.text)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    name: str = Field(max_length=6)


def test_openai_parse_returns_a_parsed_object(cluster):
    completion = _client(cluster).chat.completions.parse(
        model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=MAX_TOKENS, seed=2
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Pet)
    assert completion.choices[0].finish_reason == "stop"


def _check_call(call, tools) -> None:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])


def test_tool_choice_required_and_named(cluster):
    check_tool_choice(cluster, [WEATHER, CLOCK], "get_time")


def check_tool_choice(cluster, tools, named_function, parallel_finish=("tool_calls",)) -> None:
    """``required`` (with parallel calls or one) and a named function give valid calls;
    ``parallel_finish``: the finish reasons allowed when parallel calls are."""
    client = _client(cluster)
    for parallel in (True, False):
        out = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=tools,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=MAX_TOKENS,
            seed=4,
            n=2,
        )
        for choice in out.choices:
            assert choice.finish_reason in (parallel_finish if parallel else ("tool_calls",))
            assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
            for call in choice.message.tool_calls:
                _check_call(call, tools)
    named = {"type": "function", "function": {"name": named_function}}
    out = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=tools, tool_choice=named, max_tokens=MAX_TOKENS
    )
    (call,) = out.choices[0].message.tool_calls
    assert out.choices[0].finish_reason == "tool_calls" and call.function.name == named_function
    _check_call(call, tools)


def test_tool_calls_stream_openai_shaped_deltas(cluster):
    check_tool_call_stream(cluster)


def check_tool_call_stream(cluster, **extra) -> None:
    """A named and a required tool call stream as OpenAI-shaped deltas whose pieces add up to
    valid arguments; ``extra`` goes into each request. With parallel calls allowed a sampled
    model may add calls until ``max_tokens`` (the random model does for some draws): then the
    finish is "length", every call before the last is complete and valid, and the last one
    was cut off (or is complete too)."""
    client = _client(cluster)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice_kind in (named, "required"):
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=choice_kind,
            max_tokens=MAX_TOKENS,
            stream=True,
            **extra,
        )
        calls: dict[int, dict] = {}
        finish, num_chunks = None, 0
        for chunk in stream:
            delta = chunk.choices[0].delta
            for part in delta.tool_calls or ():
                num_chunks += 1
                call = calls.setdefault(part.index, {"name": "", "arguments": "", "id": None})
                call["id"] = call["id"] or part.id
                call["name"] += (part.function and part.function.name) or ""
                call["arguments"] += (part.function and part.function.arguments) or ""
            finish = chunk.choices[0].finish_reason or finish
        parallel = choice_kind == "required" and extra.get("parallel_tool_calls") is not False
        assert calls and finish in (("tool_calls", "length") if parallel else ("tool_calls",))
        complete = list(calls.values())
        if finish == "length":
            last = complete.pop()
            assert complete and last["name"] == "get_weather"
            with contextlib.suppress(json.JSONDecodeError):  # cut off between two calls
                json.loads(last["arguments"])
                complete.append(last)
        for call in complete:
            assert call["name"] == "get_weather" and call["id"].startswith("call_")
            jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
        assert num_chunks > 2  # the arguments arrive as they are generated (both kinds)


def test_tool_messages_round_trip_through_the_template(colocated):
    messages = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    out = _client(colocated).chat.completions.create(
        model="tiny", messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=3
    )
    with_tools = out.usage.prompt_tokens
    out = _client(colocated).chat.completions.create(
        model="tiny", messages=messages[:1], max_tokens=3
    )
    assert with_tools > out.usage.prompt_tokens + 20  # the tools and the call were rendered
    assert out.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(open"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"whitespace_pattern": "x"}}, "structured_outputs"),
        ({"guided_choice": ["a"], "response_format": {"type": "json_object"}}, "guided_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
        ),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        (
            {"structured_outputs": {"grammar": "root ::= missing_rule"}},
            "structured_outputs.grammar",
        ),
    ],
)
def test_unsupported_or_invalid_is_a_400_naming_the_field(colocated, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        _client(colocated).chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=5, extra_body=body
        )
    assert info.value.status_code == 400
    assert info.value.body["param"] == param, info.value.body


def test_decode_killed_mid_stream_keeps_the_grammar(model_dir, tmp_path):
    """The re-run replays the streamed tokens into a new matcher and finishes the array."""
    llm = LLM(model_dir, num_blocks=256)
    grammar = StructuredOutput("json", spec_text(LONG_SCHEMA))
    params = SamplingParams(temperature=0, max_tokens=LONG_MAX_TOKENS, structured_outputs=grammar)
    reference = llm.generate(PROMPT, params)[0].outputs[0].text
    with running_cluster(
        model_dir, tmp_path, num_prefill=1, num_decode=2, router_args=ROUTER_ARGS
    ) as launcher:
        stream = _client(launcher).completions.create(
            model="tiny",
            prompt=PROMPT,
            temperature=0,
            max_tokens=LONG_MAX_TOKENS,
            stream=True,
            extra_body={"response_format": schema_format("long", LONG_SCHEMA)},
        )
        parts, victim = [], None
        for chunk in stream:
            parts.append(chunk.choices[0].text)
            if victim is None and len(parts) == 5:
                busy = [i for i, s in worker_stats(launcher).items() if s["num_running"]]
                assert len(busy) == 1 and busy[0].startswith("decode"), busy
                victim = busy[0]
                launcher.kill(victim, signal.SIGKILL)
        assert victim is not None
    assert "".join(parts) == reference
    jsonschema.validate(json.loads(reference), LONG_SCHEMA)  # ended by the grammar, not length


def test_langchain_bind_tools_and_with_structured_output(colocated):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=colocated.url + "/v1",
        api_key="unused",
        model="tiny",
        max_tokens=MAX_TOKENS,
        temperature=0,
        max_retries=0,
    )
    message = model.bind_tools([WEATHER], tool_choice="any").invoke("weather in Lima?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["function"]["parameters"])
    pet = model.with_structured_output(Pet, method="json_schema").invoke("a pet")
    assert isinstance(pet, Pet)
