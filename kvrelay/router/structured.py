"""Structured outputs and tool choice of a request: which grammar constrains it, and how.

The grammar of a request comes from at most one of (checked in this order, 400 if two):

==========================================  =================================================
request field                               ``StructuredOutput``
==========================================  =================================================
``response_format: {"type": "json_object"}``  ``json_object``
``response_format: {"type": "json_schema",``  ``json`` (the schema; ``strict`` is accepted:
``  "json_schema": {"schema": ...}}``           the grammar is always enforced)
``structured_outputs: {"json"|"regex"|``      the one key given (vLLM's newer convention)
``  "choice"|"grammar"|"json_object": ...}``
``guided_json|regex|choice|grammar``          the same (vLLM's older spelling, kept as aliases)
``tool_choice: "required"`` / a function      ``json``: see ``ToolPlan``
==========================================  =================================================

The router cannot compile grammars (xgrammar imports torch): it checks schema shape with
``jsonschema`` and regexes with ``re``; a spec that passes here and fails to compile in the
worker comes back as a 400 error event naming the same field.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema
import jsonschema.exceptions
import jsonschema.validators

from kvrelay.protocol.sampling_params import StructuredOutput
from kvrelay.router.errors import bad_request
from kvrelay.text.tool_parsers import (
    ParsedTools,
    PartialCall,
    ToolCall,
    ToolParser,
    partial_objects,
)

STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
GUIDED_FIELDS = {f"guided_{key}": key for key in ("json", "regex", "choice", "grammar")}
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

ToolMode = Literal["none", "auto", "required", "named"]


def check_schema(schema: Any, param: str) -> str:
    """``schema`` as canonical JSON after checking it is a JSON schema; 400 naming ``param``."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON schema object", param)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.exceptions.SchemaError as exc:
        raise bad_request(f"'{param}' is not a valid JSON schema: {exc.message}", param) from None
    return json.dumps(schema, ensure_ascii=False)


def _spec(key: str, value: Any, param: str) -> StructuredOutput:
    """One ``structured_outputs`` entry as a StructuredOutput; 400 naming ``param``."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad_request(f"'{param}' is not valid JSON", param) from None
        return StructuredOutput("json", check_schema(value, param))
    if key == "json_object":
        if value is not True:
            raise bad_request(f"'{param}' must be true", param)
        return StructuredOutput("json_object")
    if key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(c, str) and c for c in value)):
            raise bad_request(f"'{param}' must be a non-empty list of non-empty strings", param)
        return StructuredOutput("choice", choices=tuple(value))
    if not (isinstance(value, str) and value):
        raise bad_request(f"'{param}' must be a non-empty string", param)
    if key == "regex":
        try:
            re.compile(value)
        except re.error as exc:
            message = f"'{param}' is not a valid regular expression: {exc}"
            raise bad_request(message, param) from None
    return StructuredOutput(key, value)


def _from_response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name", ""), str):
        raise bad_request(
            "'response_format.json_schema' must be an object with a 'schema'", "response_format"
        )
    if "strict" in spec and not isinstance(spec["strict"], bool | None):
        raise bad_request("'response_format.json_schema.strict' must be a bool", "response_format")
    if spec.get("schema") is None:
        return StructuredOutput("json_object")
    return StructuredOutput("json", check_schema(spec["schema"], "response_format"))


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutput:
    keys = [key for key, v in value.items() if v is not None]
    unknown = sorted(set(keys) - set(STRUCTURED_KEYS))
    if unknown:
        raise bad_request(
            f"'structured_outputs' options {unknown} are not supported "
            f"(supported: {list(STRUCTURED_KEYS)})",
            "structured_outputs",
        )
    if len(keys) != 1:
        raise bad_request(
            f"'structured_outputs' must set exactly one of {list(STRUCTURED_KEYS)}",
            "structured_outputs",
        )
    return _spec(keys[0], value[keys[0]], f"structured_outputs.{keys[0]}")


def resolve_structured(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
) -> StructuredOutput | None:
    """The request's grammar from its fields (see the module table); None for free text.

    Args:
        response_format: the request's ``response_format``.
        structured_outputs: the request's ``structured_outputs``.
        guided: the ``guided_*`` fields that are set, by name.

    Raises:
        ApiError: 400 naming the field that is invalid, or the second of two that are set.
    """
    found: list[tuple[str, StructuredOutput | None]] = []
    if response_format is not None:
        found.append(("response_format", _from_response_format(response_format)))
    if structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(structured_outputs)))
    for name, value in guided.items():
        found.append((name, _spec(GUIDED_FIELDS[name], value, name)))
    constraining = [(name, spec) for name, spec in found if spec is not None]
    if len(constraining) > 1:
        raise bad_request(
            f"'{constraining[1][0]}' cannot be combined with '{constraining[0][0]}'",
            constraining[1][0],
        )
    return constraining[0][1] if constraining else None


# ---- tools --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How a chat request's tools shape its output and how its choices are read back.

    ``mode``: ``none`` (free text), ``auto`` (free text; ``parser`` finds calls in it),
    ``required`` (a grammar forces a JSON array of ``{"name", "parameters"}``, one or more
    calls, as vLLM does), ``named`` (a grammar forces the named function's arguments).
    """

    mode: ToolMode
    tools: tuple[dict[str, Any], ...] = ()  # as the chat template receives them
    name: str = ""  # mode "named": the function
    parallel: bool = True  # more than one call allowed
    parser: ToolParser | None = None  # mode "auto"
    structured: StructuredOutput | None = None  # modes "required" and "named"
    names: frozenset[str] = frozenset()  # the declared functions

    def extract(self, text: str) -> ParsedTools:
        """The calls (and remaining content) of one finished choice's text.

        A parser whose calls are bare JSON (``llama3_json``) keeps the calls up to the first
        that names no declared tool; when that is the first, the text is a JSON answer, not a
        call, and all of it is content (streaming decides the same way, ``streamed``)."""
        if self.mode == "named":
            return ParsedTools(None, [ToolCall(self.name, text)])
        if self.mode == "required":
            return _parse_required(text)
        if self.mode == "auto" and self.parser is not None:
            found = self.parser.extract(text)
            if self.parser.bare_json:
                kept = self._declared(found.calls)
                if kept == 0 and found.calls:
                    return ParsedTools(text, [])
                found = ParsedTools(found.content, found.calls[:kept])
            if not self.parallel and len(found.calls) > 1:
                return ParsedTools(found.content, found.calls[:1])
            return found
        return ParsedTools(text, [])

    def streamed(self, text: str) -> tuple[list[PartialCall], int]:
        """For streaming ``auto`` and ``required``, from one scan of a choice's partial text:
        its calls so far, and how many leading characters are content for certain (0 for
        ``required``: all of it is the calls; all of it once a bare-JSON first call names no
        declared tool)."""
        if self.mode == "required":
            found, ready = _required_partial(text), 0
        elif self.mode == "auto" and self.parser is not None:
            found, ready = self.parser.partial_calls(text), self.parser.content_len(text)
            if self.parser.bare_json:
                kept = self._declared(found)
                if kept == 0 and found:  # the first call names an undeclared function
                    ready = len(text)
                found = found[:kept]
        else:
            return [], 0
        return (found if self.parallel else found[:1]), ready

    def _declared(self, calls: Sequence[ToolCall | PartialCall]) -> int:
        """How many leading calls name a declared tool (or, partial, no complete name yet)."""
        for i, call in enumerate(calls):
            if call.name is not None and call.name not in self.names:
                return i
        return len(calls)


def _parse_required(text: str) -> ParsedTools:
    try:
        calls = [
            ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False))
            for item in json.loads(text)
        ]
    except (ValueError, TypeError, KeyError):
        # cut off by max_tokens (a small model may repeat calls until then): the calls that
        # were complete, as a stream would have sent them; the raw text when there are none
        complete = [
            ToolCall(call.name, json.dumps(json.loads(call.arguments), ensure_ascii=False))
            for call in _required_partial(text)
            if call.name is not None and call.done and _is_object(call.arguments)
        ]
        return ParsedTools(None, complete) if complete else ParsedTools(text, [])
    return ParsedTools(None, calls)


def _required_partial(text: str) -> list[PartialCall]:
    """The calls of ``required``'s array (``[{"name", "parameters"}, ...]``) written so far."""
    start = len(text) - len(text.lstrip())
    if not text.startswith("[", start):
        return []
    return partial_objects(text, start + 1, " \n\t,", ("parameters",))


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _check_tool(index: int, tool: Any) -> tuple[str, dict[str, Any]]:
    param = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise bad_request(f"'{param}' must be an object with type 'function'", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"'{param}.function' must be an object", "tools")
    name = function.get("name")
    if not (isinstance(name, str) and _FUNCTION_NAME.match(name)):
        raise bad_request(
            f"'{param}.function.name' must be 1-64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    check_schema(parameters, "tools")
    return name, parameters


def plan_tools(
    tools: list[Any] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    parser: ToolParser | None,
) -> ToolPlan:
    """Checks ``tools`` / ``tool_choice`` / ``parallel_tool_calls``; 400 naming the field."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return ToolPlan("none")
    schemas = dict(_check_tool(i, tool) for i, tool in enumerate(tools))
    if len(schemas) != len(tools):
        raise bad_request("'tools' has two functions with the same name", "tools")
    parallel = parallel_tool_calls is not False
    common = {"tools": tuple(tools), "parallel": parallel, "names": frozenset(schemas)}
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", **common)  # type: ignore[arg-type]
    if choice == "auto":
        if parser is None:
            raise bad_request(
                "'tool_choice' 'auto' needs a tool-call parser, and this model's chat template "
                "has no known tool-call format (start the router with --tool-call-parser)",
                "tool_choice",
            )
        return ToolPlan("auto", parser=parser, **common)  # type: ignore[arg-type]
    if choice == "required":
        return ToolPlan("required", structured=_required_grammar(schemas, parallel), **common)  # type: ignore[arg-type]
    name = _named_choice(choice)
    if name not in schemas:
        raise bad_request(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
    spec = StructuredOutput("json", json.dumps(schemas[name], ensure_ascii=False))
    return ToolPlan("named", name=name, structured=spec, **common)  # type: ignore[arg-type]


def _named_choice(choice: object) -> str:
    function = choice.get("function") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(function, dict)
        or not isinstance(function.get("name"), str)
    ):
        raise bad_request(
            "'tool_choice' must be 'none', 'auto', 'required' or "
            '{"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return function["name"]


def _required_grammar(schemas: dict[str, dict[str, Any]], parallel: bool) -> StructuredOutput:
    """A JSON array of one (or, with parallel calls, more) ``{"name", "parameters"}``."""
    variants = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "parameters": schema},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for name, schema in schemas.items()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        array["maxItems"] = 1
    return StructuredOutput("json", json.dumps(array, ensure_ascii=False))
