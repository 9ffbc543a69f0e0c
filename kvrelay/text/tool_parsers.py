"""Tool calls in a model's free text (``tool_choice: "auto"``), one parser per template format.

A parser finds the calls a chat template taught the model to write and returns them with the
text around them (the message's ``content``). Streaming reads the calls of a
partial output with ``partial_calls``: each call's name once its string is complete, and the raw
text of its arguments object so far, which only ever grows (the router streams the growth as
``delta.tool_calls[].function.arguments``). Parsers are registered by name in
``TOOL_PARSERS`` (the names of vLLM's ``--tool-call-parser``); ``detect_tool_parser`` picks one
from a chat template's source. Torch-free: the router uses it.

=============  ==============================================================================
name           the model writes
=============  ==============================================================================
hermes         ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call
               (Hermes, Qwen 2.5 / 3, SmolLM3)
llama3_json    ``{"name": ..., "parameters": {...}}`` as the whole message, optionally after
               ``<|python_tag|>``; several calls separated by ``;`` (Llama 3.1 / 3.2)
=============  ==============================================================================
"""

from __future__ import annotations

import abc
import json
import re
from typing import Any, NamedTuple


class ToolCall(NamedTuple):
    name: str
    arguments: str  # a JSON object, serialised


class ParsedTools(NamedTuple):
    content: str | None  # the text that is not a call; None when nothing is left
    calls: list[ToolCall]


def _call_of(obj: Any, arguments_key: str) -> ToolCall | None:
    """A call from ``{"name": str, arguments_key: {...}}``; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, {})
    if isinstance(arguments, str):  # some models serialise the arguments themselves
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class PartialCall(NamedTuple):
    """A call in a partial output: ``name`` is None until its string is complete; ``arguments``
    is the raw JSON text of the arguments value so far ("" before it starts), a prefix of what
    the finished output holds there; ``done``: that value is complete."""

    name: str | None
    arguments: str
    done: bool


class _Object(NamedTuple):
    values: dict[str, str]  # top-level key -> raw value text so far (stripped)
    complete: set[str]  # keys whose value is complete
    end: int | None  # index after the closing brace; None while the object is open


def _scan_object(text: str, start: int) -> _Object:
    """Reads the JSON object starting at ``text[start] == "{"`` as far as ``text`` goes.

    Tracks nesting and strings only (no validation): enough to tell each top-level key's value
    apart while the object is still being written."""
    bounds: dict[str, list[int]] = {}  # key -> [value start, value end (-1 while open)]
    depth, in_string, escaped = 0, False, False
    key_start: int | None = None
    pending: str | None = None  # a key read, its ':' not yet
    current: str | None = None  # the key whose value is being read
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if key_start is not None:
                    try:
                        pending = json.loads(text[key_start : i + 1])
                    except ValueError:
                        pending = None
                    key_start = None
            continue
        if c == '"':
            in_string = True
            if depth == 1 and current is None and pending is None:
                key_start = i
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if current is not None and depth <= 1 and bounds[current][1] < 0:
                bounds[current][1] = i + 1 if depth == 1 else i
            if depth == 0:
                return _object_of(text, bounds, i + 1)
        elif c == ":" and depth == 1 and pending is not None:
            bounds[pending] = [i + 1, -1]
            current, pending = pending, None
        elif c == "," and depth == 1 and current is not None:
            if bounds[current][1] < 0:
                bounds[current][1] = i
            current = None
    return _object_of(text, bounds, None)


def _object_of(text: str, bounds: dict[str, list[int]], end: int | None) -> _Object:
    values = {k: text[a : b if b >= 0 else len(text)].strip() for k, (a, b) in bounds.items()}
    return _Object(values, {k for k, (_, b) in bounds.items() if b >= 0}, end)


def _partial_call(obj: _Object, arguments_keys: tuple[str, ...]) -> PartialCall:
    name = None
    if "name" in obj.complete:
        try:
            value = json.loads(obj.values["name"])
        except ValueError:
            value = None
        name = value if isinstance(value, str) else None
    key = next((k for k in arguments_keys if k in obj.values), None)
    if key is None:
        return PartialCall(name, "", obj.end is not None)
    return PartialCall(name, obj.values[key], key in obj.complete)


def partial_objects(
    text: str, position: int, separators: str, arguments_keys: tuple[str, ...]
) -> list[PartialCall]:
    """The call objects from ``position`` on, one after another with ``separators`` between."""
    calls: list[PartialCall] = []
    while True:
        while position < len(text) and text[position] in separators:
            position += 1
        if position >= len(text) or text[position] != "{":
            return calls
        obj = _scan_object(text, position)
        calls.append(_partial_call(obj, arguments_keys))
        if obj.end is None:
            return calls
        position = obj.end


class ToolParser(abc.ABC):
    """Finds the tool calls in one complete model output. Stateless; never raises on bad
    model output: text that is not a well-formed call stays ``content``."""

    name: str
    # calls are bare JSON, not marked off from text (llama3_json): a JSON answer with a "name"
    # key reads as a call, so the router keeps only calls that name a declared tool
    bare_json: bool = False

    @abc.abstractmethod
    def extract(self, text: str) -> ParsedTools:
        """The calls in ``text`` in order, and the text around them."""

    @abc.abstractmethod
    def content_len(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows
        (streaming sends them at once and holds the rest back until the output ends)."""

    @abc.abstractmethod
    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls of a partial output so far, in order (streaming)."""


class HermesParser(ToolParser):
    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> ParsedTools:
        if "<tool_call>" not in text:
            return ParsedTools(text, [])
        calls = []
        for match in self._BLOCK.finditer(text):
            try:
                call = _call_of(json.loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                return ParsedTools(text, [])  # a malformed block: show the text as it is
            calls.append(call)
        content = text[: text.index("<tool_call>")].strip()
        return ParsedTools(content or None, calls)

    def content_len(self, text: str) -> int:
        start = text.find("<tool_call>")
        if start >= 0:
            return start
        for size in range(min(len(text), len("<tool_call>") - 1), 0, -1):
            if "<tool_call>".startswith(text[-size:]):
                return len(text) - size
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        calls = []
        position = text.find("<tool_call>")
        while position >= 0:
            found = partial_objects(text, position + len("<tool_call>"), " \n\t", ("arguments",))
            if not found:
                break
            calls.append(found[0])
            if not found[0].done:
                break
            position = text.find("<tool_call>", position + len("<tool_call>"))
        return calls


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    bare_json = True
    _TAG = "<|python_tag|>"

    def extract(self, text: str) -> ParsedTools:
        body = text.strip()
        if body.startswith(self._TAG):
            body = body[len(self._TAG) :].strip()
        if not body.startswith("{"):
            return ParsedTools(text, [])
        calls = []
        decoder = json.JSONDecoder()
        position = 0
        while position < len(body):
            try:
                obj, end = decoder.raw_decode(body, position)
            except ValueError:
                return ParsedTools(text, [])
            call = _call_of(obj, "parameters" if "parameters" in obj else "arguments")
            if call is None:
                return ParsedTools(text, [])
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \n\t;":
                position += 1
        return ParsedTools(None, calls)

    def content_len(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self._TAG.startswith(body[: len(self._TAG)]):
            return 0  # the whole message may be calls
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        start = len(text) - len(text.lstrip())
        if text.startswith(self._TAG, start):
            start += len(self._TAG)
        return partial_objects(text, start, " \n\t;", ("parameters", "arguments"))


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesParser.name: HermesParser,
    Llama3JsonParser.name: Llama3JsonParser,
}


def create_tool_parser(name: str) -> ToolParser:
    """The parser registered as ``name``; ValueError naming the choices otherwise."""
    cls = TOOL_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return cls()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's tool-call format needs, or None when it has no known one."""
    if not chat_template:
        return None
    if "<tool_call>" in chat_template:
        return HermesParser.name
    if "<|python_tag|>" in chat_template or "Environment: ipython" in chat_template:
        return Llama3JsonParser.name
    return None
