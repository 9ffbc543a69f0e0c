"""Tool-call parsing (``tool_choice: "auto"``) and the router's reading of tool / format fields."""

from __future__ import annotations

import json

import pytest

from kvrelay.router.errors import ApiError
from kvrelay.router.structured import plan_tools, resolve_structured
from kvrelay.text.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolCall,
    create_tool_parser,
    detect_tool_parser,
)

TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
    },
}


def test_hermes_finds_every_block_and_keeps_the_text_before():
    text = (
        'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    )
    parsed = HermesParser().extract(text)
    assert parsed.content == "Let me look."
    assert parsed.calls == [ToolCall("f", '{"x": 1}'), ToolCall("g", "{}")]


def test_hermes_leaves_malformed_calls_as_text():
    for text in (
        "no calls here",
        '<tool_call>{"name": 3}</tool_call>',
        "<tool_call>{oops</tool_call>",
    ):
        parsed = HermesParser().extract(text)
        assert parsed.calls == [] and parsed.content == text


def test_hermes_content_len_holds_back_a_possible_call_start():
    parser = HermesParser()
    assert parser.content_len("Hello") == 5
    assert parser.content_len("Hello <tool") == 6
    assert parser.content_len("Hi <tool_call>{") == 3
    assert parser.content_len("a < b") == 5


def test_llama3_json_reads_one_or_several_calls():
    parser = Llama3JsonParser()
    one = parser.extract('{"name": "f", "parameters": {"x": 2}}')
    assert one.calls == [ToolCall("f", '{"x": 2}')] and one.content is None
    two = parser.extract(
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": "{\\"y\\": 1}"}'
    )
    assert two.calls == [ToolCall("f", "{}"), ToolCall("g", '{"y": 1}')]
    assert parser.extract("plain words").calls == []
    assert parser.content_len("  {") == 0 and parser.content_len("plain") == 5


def test_parser_detection_and_registry():
    assert detect_tool_parser("... <tool_call> ...") == "hermes"
    assert detect_tool_parser("Environment: ipython <|python_tag|>") == "llama3_json"
    assert detect_tool_parser("{{ messages }}") is None and detect_tool_parser(None) is None
    with pytest.raises(ValueError, match="hermes"):
        create_tool_parser("nope")


def test_required_is_a_json_array_grammar_over_the_tools():
    plan = plan_tools([TOOL], "required", False, None)
    assert plan.mode == "required" and plan.structured is not None
    schema = json.loads(plan.structured.spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"const": "f"}
    calls = plan.extract('[{"name": "f", "parameters": {"x": 4}}]').calls
    assert calls == [ToolCall("f", '{"x": 4}')]


def test_named_and_auto_and_none():
    named = plan_tools([TOOL], {"type": "function", "function": {"name": "f"}}, None, None)
    assert json.loads(named.structured.spec) == TOOL["function"]["parameters"]
    assert named.extract('{"x": 1}').calls == [ToolCall("f", '{"x": 1}')]
    auto = plan_tools([TOOL], None, None, HermesParser())
    assert auto.mode == "auto" and auto.structured is None
    with pytest.raises(ApiError) as info:
        plan_tools([TOOL], "auto", None, None)
    assert info.value.param == "tool_choice"
    assert plan_tools(None, None, None, None).mode == "none"


def test_resolve_structured_sources():
    assert resolve_structured({"type": "text"}, None, {}) is None
    assert resolve_structured({"type": "json_object"}, None, {}).kind == "json_object"
    spec = resolve_structured(None, None, {"guided_json": '{"type": "integer"}'})
    assert spec.kind == "json" and json.loads(spec.spec) == {"type": "integer"}
    assert resolve_structured(None, {"choice": ["a", "b"]}, {}).choices == ("a", "b")
    with pytest.raises(ApiError) as info:
        resolve_structured(None, {"regex": "a"}, {"guided_regex": "b"})
    assert info.value.param == "guided_regex"


# ------------------------------------------------------------------ streaming (partial_calls)


def _prefixes(text: str):
    return (text[:i] for i in range(len(text) + 1))


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (
            HermesParser(),
            'Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": [1, {"y": "a}\\"b"}]}}'
            '\n</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
        ),
        (
            Llama3JsonParser(),
            '<|python_tag|>{"name": "f", "parameters": {"x": "{[,"}}; {"name": "g", "parameters":'
            ' {"z": null}}',
        ),
    ],
)
def test_partial_calls_only_grow_and_end_as_the_parse(parser, text):
    """Every prefix's calls extend the previous prefix's: a name appears once complete and
    never changes, the arguments' raw text only grows, and the end parses as ``extract``."""
    seen: list = []
    for prefix in _prefixes(text):
        calls = parser.partial_calls(prefix)
        assert len(calls) >= len([c for c in seen if c.name is not None])
        for old, new in zip(seen, calls, strict=False):
            if old.name is not None:
                assert new.name == old.name
            assert new.arguments.startswith(old.arguments)
        seen = calls
    final = parser.extract(text).calls
    assert [c.name for c in seen] == [c.name for c in final]
    assert [json.loads(c.arguments) for c in seen] == [json.loads(c.arguments) for c in final]
    assert all(c.done for c in seen)


def test_partial_calls_of_plain_text_are_none():
    assert HermesParser().partial_calls("Just an answer, no <tool") == []
    assert Llama3JsonParser().partial_calls("Paris is the capital.") == []
