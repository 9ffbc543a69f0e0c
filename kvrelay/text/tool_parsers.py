"""Tool calls in a model's free text (``tool_choice: "auto"``), one parser per template format.

A parser finds the calls a chat template taught the model to write and returns them with the
text around them (the message's ``content``). Parsers are registered by name in
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


class ToolParser(abc.ABC):
    """Finds the tool calls in one complete model output. Stateless; never raises on bad
    model output: text that is not a well-formed call stays ``content``."""

    name: str

    @abc.abstractmethod
    def extract(self, text: str) -> ParsedTools:
        """The calls in ``text`` in order, and the text around them."""

    @abc.abstractmethod
    def content_len(self, text: str) -> int:
        """How many leading characters of a partial output are content whatever follows
        (streaming sends them at once and holds the rest back until the output ends)."""


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


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
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
