"""Streamed tool calls (``tool_choice`` auto and required): OpenAI-shaped ``delta.tool_calls``
whose arguments arrive as the model writes them, and add up to what a non-streamed response
returns. Drives the router's response builder with the deltas a worker's tokens make."""

from __future__ import annotations

import json

import pytest
from openai.types.chat import ChatCompletionChunk

from kvrelay.router.backend import Delta
from kvrelay.router.chat_builder import ChatBuilder
from kvrelay.router.responses import PromptInfo, ResponseOptions
from kvrelay.router.structured import plan_tools
from kvrelay.router.token_strings import TokenStrings
from kvrelay.text.tool_parsers import HermesParser, Llama3JsonParser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]
HERMES = (
    "Checking both.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"city": "Lima"}}\n</tool_call>'
)
REQUIRED = (
    '[{"name": "get_weather", "parameters": {"city": "Tokyo"}}, '
    '{"name": "get_time", "parameters": {}}]'
)


def _stream(builder: ChatBuilder, text: str, step: int) -> list[ChatCompletionChunk]:
    chunks = [ChatCompletionChunk.model_validate(c) for c in builder.start_chunks()]
    pieces = [text[i : i + step] for i in range(0, len(text), step)]
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = Delta([i], piece, finished=last, finish_reason="stop" if last else None)
        chunk = builder.delta_chunk(0, delta)
        if chunk is not None:
            chunks.append(ChatCompletionChunk.model_validate(chunk))
    return chunks


def _builder(mode: str, parser=None, parallel=True) -> ChatBuilder:
    tools = plan_tools(TOOLS, mode, parallel, parser)
    prompt = PromptInfo([1, 2], "")
    return ChatBuilder("m", [prompt], 1, TokenStrings(None), ResponseOptions(), tools)  # type: ignore[arg-type]


def _assemble(chunks: list[ChatCompletionChunk]):
    content, calls, finish, num_argument_parts = "", {}, None, 0
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or ():
            if part.id is not None:  # a call starts: id, type and the complete name at once
                assert part.index not in calls and part.type == "function"
                calls[part.index] = {"id": part.id, "name": part.function.name, "arguments": ""}
            else:
                assert part.function.name is None
            calls[part.index]["arguments"] += part.function.arguments or ""
            num_argument_parts += bool(part.function.arguments)
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish, num_argument_parts


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_auto_streams_content_then_calls_as_they_are_written(step):
    builder = _builder("auto", HermesParser())
    content, calls, finish, num_parts = _assemble(_stream(builder, HERMES, step))
    whole = _builder("auto", HermesParser()).tools.extract(HERMES)
    assert content == "Checking both.\n" and finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [
        json.loads(c.arguments) for c in whole.calls
    ]
    assert len({c["id"] for c in calls}) == 2
    if step == 1:  # one character a delta: the arguments arrive in many pieces
        assert num_parts > 20


def test_required_streams_each_call_incrementally():
    content, calls, finish, num_parts = _assemble(_stream(_builder("required"), REQUIRED, 2))
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Tokyo"}),
        ("get_time", {}),
    ]
    assert num_parts > 5


def test_parallel_off_streams_the_first_call_only():
    builder = _builder("auto", HermesParser(), parallel=False)
    _, calls, finish, _ = _assemble(_stream(builder, HERMES, 4))
    assert [c["name"] for c in calls] == ["get_weather"] and finish == "tool_calls"


def test_arguments_written_as_a_string_are_sent_whole_at_the_end():
    text = '{"name": "get_time", "parameters": "{\\"city\\": \\"Lima\\"}"}'
    _, calls, finish, num_parts = _assemble(_stream(_builder("auto", Llama3JsonParser()), text, 1))
    assert calls == [{"id": calls[0]["id"], "name": "get_time", "arguments": '{"city": "Lima"}'}]
    assert finish == "tool_calls" and num_parts == 1


def test_text_that_is_no_call_streams_as_content():
    text = "The weather in Paris is mild; <b>no</b> call needed."
    content, calls, finish, _ = _assemble(_stream(_builder("auto", HermesParser()), text, 2))
    assert content == text and calls == [] and finish == "stop"


def test_required_cut_off_by_length_keeps_the_complete_calls():
    """A small model may repeat calls until max_tokens: the complete ones come back, streamed
    and not, with finish_reason "length"; the cut-off one is dropped from the parse."""
    call = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
    text = f"[{call}, {call}, {call[:30]}"
    builder = _builder("required")
    builder.add(0, Delta([1], text, finished=True, finish_reason="length"))
    (choice,) = builder.response()["choices"]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Lima"})
    ] * 2
    chunks = [ChatCompletionChunk.model_validate(c) for c in builder.start_chunks()]
    streamed = _builder("required")
    for i in range(0, len(text), 5):
        last = i + 5 >= len(text)
        delta = Delta([i], text[i : i + 5], finished=last, finish_reason="length" if last else None)
        if (chunk := streamed.delta_chunk(0, delta)) is not None:
            chunks.append(ChatCompletionChunk.model_validate(chunk))
    _, streamed_calls, finish, _ = _assemble(chunks)
    assert finish == "length" and len(streamed_calls) == 3  # the third was under way
    assert [json.loads(c["arguments"]) for c in streamed_calls[:2]] == [{"city": "Lima"}] * 2


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_json_answer_that_names_no_declared_tool_is_content(step):
    """llama3_json's calls are bare JSON: an answer that is a JSON object with a "name" key
    (asked for by the user, say) names no declared tool, so it is content, streamed and not."""
    text = '{"name": "Alice", "age": 30, "city": "Paris"}'
    builder = _builder("auto", Llama3JsonParser())
    content, calls, finish, _ = _assemble(_stream(builder, text, step))
    assert (content, calls, finish) == (text, [], "stop")
    whole = _builder("auto", Llama3JsonParser()).tools.extract(text)
    assert whole.content == text and whole.calls == []


@pytest.mark.parametrize("step", [1, 1000])
def test_bare_json_calls_stop_at_the_first_undeclared_name(step):
    text = (
        '{"name": "get_time", "parameters": {"city": "Lima"}}; '
        '{"name": "Bob", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    )
    builder = _builder("auto", Llama3JsonParser())
    content, calls, finish, _ = _assemble(_stream(builder, text, step))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_time", {"city": "Lima"})
    ]
    assert content == "" and finish == "tool_calls"
    whole = _builder("auto", Llama3JsonParser()).tools.extract(text)
    assert [c.name for c in whole.calls] == ["get_time"] and whole.content is None


def test_hermes_keeps_a_marked_call_of_any_name():
    """Hermes marks its calls off with tags, so a call stays a call whatever it names."""
    text = '<tool_call>\n{"name": "not_declared", "arguments": {}}\n</tool_call>'
    whole = _builder("auto", HermesParser()).tools.extract(text)
    assert [c.name for c in whole.calls] == ["not_declared"]
