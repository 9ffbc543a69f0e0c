"""``POST /v1/responses`` with the official ``openai`` client (and LangChain's
``use_responses_api``): every response and stream event is validated by the client's own
types; the output equals the chat endpoint's for the same conversation; function calls, call
outputs fed back, JSON-schema formats and what is not supported (a 400 naming the field).
Over the in-process server (tiny model), and once through a 1P+1D cluster of processes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from tests.cluster_harness import running_cluster
from tests.engine_backend import ApiServer

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Tokyo", "Lima"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
CHAT_WEATHER = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
}
SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "city": {"enum": ["Paris", "Lima"]}},
    "required": ["ok", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(api_server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{api_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60
    ) as c:
        yield c


def _create(client: openai.OpenAI, **kwargs: Any) -> Response:
    """``responses.create``, its raw body validated by the client's model (pydantic's
    validation: a field of the wrong type fails, where the client's own parsing is lenient)."""
    raw = client.responses.with_raw_response.create(**kwargs)
    Response.model_validate(raw.http_response.json())
    return raw.parse()


def test_text_equals_the_chat_endpoint_with_instructions_as_the_system_message(
    client: openai.OpenAI,
) -> None:
    out = _create(
        client, model="tiny", input="Hello there", instructions="Be brief.", max_output_tokens=6,
        temperature=0,
    )  # fmt: skip
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello there"},
        ],
        max_completion_tokens=6,
        temperature=0,
    )
    assert out.id.startswith("resp_") and out.object == "response"
    assert out.output_text == chat.choices[0].message.content
    assert out.status == (
        "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    )
    if out.status == "incomplete":
        assert out.incomplete_details is not None
        assert out.incomplete_details.reason == "max_output_tokens"
    (item,) = out.output
    assert (
        item.type == "message"
        and item.role == "assistant"
        and item.content[0].type == "output_text"
    )
    assert out.usage is not None
    assert out.usage.input_tokens == chat.usage.prompt_tokens
    assert out.usage.output_tokens == chat.usage.completion_tokens
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens
    assert out.instructions == "Be brief." and out.max_output_tokens == 6


def test_stream_events_build_the_same_response(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(
        model="tiny", input="Hello there", max_output_tokens=8, temperature=0
    )
    whole = _create(client, **kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added",
    ]  # fmt: skip
    assert kinds[-4:-1] == [
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
    ]  # fmt: skip
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage is not None
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_output_text_logprobs_as_the_chat_endpoints(client: openai.OpenAI) -> None:
    """``include: ["message.output_text.logprobs"]`` with ``top_logprobs``: the text part's
    logprobs are the chat's, entry for entry, and a stream's deltas carry the same."""
    kwargs: dict[str, Any] = dict(
        model="tiny", input="Hello there", max_output_tokens=6, temperature=0, top_logprobs=2,
        include=["message.output_text.logprobs"],
    )  # fmt: skip
    out = _create(client, **kwargs)
    part = out.output[0].content[0]
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hello there"}],
        max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
    )  # fmt: skip
    want = chat.choices[0].logprobs.content
    assert len(part.logprobs) == len(want) == out.usage.output_tokens
    for got, entry in zip(part.logprobs, want):
        assert (got.token, got.bytes) == (entry.token, entry.bytes)
        assert got.logprob == pytest.approx(entry.logprob, abs=1e-5)
        assert [t.token for t in got.top_logprobs] == [t.token for t in entry.top_logprobs]
        assert len(got.top_logprobs) == 2
    events = list(client.responses.create(**kwargs, stream=True))
    streamed = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [lp.token for lp in done.logprobs] == [lp.token for lp in part.logprobs]
    plain = _create(client, **{k: v for k, v in kwargs.items() if k != "include"})
    assert plain.output[0].content[0].logprobs == []


def test_required_and_named_function_calls_stream_and_not(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        kwargs: dict[str, Any] = dict(
            model="tiny", input="weather in Lima?", tools=[WEATHER], tool_choice=choice,
            max_output_tokens=60, temperature=0,
        )  # fmt: skip
        out = _create(client, **kwargs)
        calls = [item for item in out.output if item.type == "function_call"]
        assert calls and all(c.name == "get_weather" for c in calls)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
            assert call.call_id.startswith("call_") and call.id.startswith("fc_")
        with client.responses.stream(**kwargs) as stream:
            kinds = [event.type for event in stream]
            final = stream.get_final_response()
        assert "response.function_call_arguments.delta" in kinds
        assert "response.function_call_arguments.done" in kinds
        streamed = [item for item in final.output if item.type == "function_call"]
        assert [c.arguments for c in streamed] == [c.arguments for c in calls]


def test_function_call_outputs_feed_back_as_the_chat_endpoints_tool_messages(
    client: openai.OpenAI,
) -> None:
    """A turn after a call: its call and output items mean the chat's assistant tool call and
    tool message, so both endpoints answer the same (the tools themselves are left out: with
    them the template outgrows the test server's 256-token context)."""
    arguments = '{"city": "Lima"}'
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "weather in Lima?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": arguments,
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    out = client.responses.create(model="tiny", input=items, max_output_tokens=5, temperature=0)
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }
    chat = client.chat.completions.create(
        model="tiny",
        messages=[
            {"role": "user", "content": "weather in Lima?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        max_completion_tokens=5,
        temperature=0,
    )
    assert out.output_text == chat.choices[0].message.content
    assert out.usage is not None and out.usage.input_tokens == chat.usage.prompt_tokens


def test_json_schema_format(client: openai.OpenAI) -> None:
    out = client.responses.create(
        model="tiny",
        input="a record",
        text={
            "format": {"type": "json_schema", "name": "record", "schema": SCHEMA, "strict": True}
        },
        max_output_tokens=80,
        temperature=0,
    )
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), SCHEMA)
    assert out.text is not None and out.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": -1}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "wizard", "content": "hi"}]}, "input[0]"),
        ({"temprature": 0.5}, "temprature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 10_000}, "max_output_tokens"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": 5}, "input"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_it(
    api_server: ApiServer, body: dict[str, Any], param: str
) -> None:
    response = httpx.post(
        f"{api_server.base_url}/v1/responses",
        json={"model": "tiny", "input": "hi", "max_output_tokens": 2, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_no_op_fields_are_accepted(api_server: ApiServer) -> None:
    body = {
        "model": "tiny", "input": "hi", "max_output_tokens": 2, "store": False,
        "metadata": {"a": "b"}, "include": [], "truncation": "disabled", "user": "u",
        "service_tier": "auto", "stream_options": {"include_obfuscation": False},
        "previous_response_id": None, "reasoning": None,
    }  # fmt: skip
    response = httpx.post(f"{api_server.base_url}/v1/responses", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["metadata"] == {"a": "b"}


def test_langchain_use_responses_api(api_server: ApiServer) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        base_url=f"{api_server.base_url}/v1",
        api_key="unused",
        model="tiny",
        use_responses_api=True,
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    message = model.bind_tools([CHAT_WEATHER], tool_choice="any").invoke("weather in Lima?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], WEATHER["parameters"])
    assert isinstance(model.invoke("hello").text, str)


def test_through_a_disaggregated_cluster(tiny_model_dir: Any, tmp_path: Any) -> None:
    """Real processes: a function call and a streamed text answer through 1P+1D."""
    with running_cluster(
        tiny_model_dir, tmp_path, router_args=("--served-model-name", "tiny")
    ) as launcher:
        client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
        out = client.responses.create(
            model="tiny", input="weather?", tools=[WEATHER], tool_choice="required",
            max_output_tokens=60, temperature=0,
        )  # fmt: skip
        assert [item.type for item in out.output][:1] == ["function_call"]
        whole = client.responses.create(
            model="tiny", input="hi", max_output_tokens=8, temperature=0
        )
        events = list(
            client.responses.create(
                model="tiny", input="hi", max_output_tokens=8, temperature=0, stream=True
            )
        )
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == whole.output_text
