"""OpenAI's Responses API (``POST /v1/responses``), over the chat path.

The OpenAI Agents SDK drives a model through this endpoint by default, and LangChain's
``ChatOpenAI(use_responses_api=True)`` does too. A request becomes a chat completion:
``instructions`` the system message, each ``input`` message a chat message (``input_text`` /
``output_text`` parts joined), a ``function_call`` item an assistant tool call and a
``function_call_output`` item a tool message; function ``tools`` become chat tools,
``tool_choice`` and ``text.format`` (``json_object``, ``json_schema``) the chat's, so the chat
template, grammars and tool parsing are the chat endpoint's. The chat choice comes back as
output items, or streamed as OpenAI's ``response.*`` events (``responses_output``).

kvrelay keeps no responses: ``store: true``, ``previous_response_id``, ``conversation`` and
``background`` are 400s that say so (send the whole conversation as ``input``, which is what
the Agents SDK does without a stored response), as are built-in tools, images and files.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from kvrelay.protocol.sampling_params import MAX_LOGPROBS
from kvrelay.router.errors import ApiError, bad_request
from kvrelay.router.request_body import parse_json_object, validate_request
from kvrelay.router.request_models import ChatCompletionRequest, _Strict, check_fields
from kvrelay.router.responses_output import ResponsesBuilder, response_events

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvrelay.router.api import OpenAIApi

LOGPROBS = "message.output_text.logprobs"  # the one ``include`` kvrelay can add
# Fields of OpenAI's Responses requests kvrelay cannot honour, and why.
_UNSUPPORTED = {
    "previous_response_id": "not supported: kvrelay keeps no responses (send the whole "
    "conversation as 'input')",
    "conversation": "not supported: kvrelay keeps no conversations (send them as 'input')",
    "background": "not supported: responses run in the foreground",
    "reasoning": "not supported: the served models have no reasoning mode",
    "prompt": "not supported (stored prompt templates)",
    "max_tool_calls": "not supported",
}
_NO_OP = frozenset(
    (
        "metadata",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "user",
        "stream_options",  # include_obfuscation: no padding is added to the events here
    )
)


class ResponsesRequest(_Strict):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None


def add_responses_routes(app: FastAPI, api: OpenAIApi) -> None:
    async def responses(request: Request) -> Response:
        data = parse_json_object(await request.body())
        _check_fields(data)
        req = validate_request(data, ResponsesRequest)
        try:
            chat = validate_request(to_chat(req), ChatCompletionRequest)
            builder, inputs = await api.prepare_chat(chat, ResponsesBuilder)
        except ApiError as exc:  # the chat request's field names -> this request's
            exc.param = _responses_param(exc.param)
            raise
        assert isinstance(builder, ResponsesBuilder)
        builder.request = req
        return await api.respond(request, builder, inputs, req.stream, response_events)

    app.add_api_route("/v1/responses", responses, methods=["POST"])


_CHAT_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
}


def _responses_param(param: str | None) -> str | None:
    """A chat request's field as the Responses request names it (``messages[..]`` is
    ``input``: instructions shift the indices, so no index is given)."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    head = head.split("[", 1)[0] if head.startswith("messages") else head
    name = _CHAT_NAMES.get(head)
    if name is None:
        return param
    return name if head == "messages" else name + dot + rest


def _check_fields(data: dict[str, Any]) -> None:
    for name, why in _UNSUPPORTED.items():
        if data.get(name) not in (None, False):
            raise bad_request(f"'{name}' is {why}", name)
    if data.get("store") is True:
        raise bad_request(
            "'store' is not supported: kvrelay keeps no responses (send false or leave it out)",
            "store",
        )
    extra = (
        set(data.get("include") or ()) - {LOGPROBS} if isinstance(data.get("include"), list) else ()
    )
    if extra:
        raise bad_request(
            f"'include' may hold only {LOGPROBS!r}, got {sorted(map(str, extra))}", "include"
        )
    if data.get("truncation") not in (None, "disabled"):
        raise bad_request(
            "'truncation' must be 'disabled': a conversation longer than the context is a 400",
            "truncation",
        )
    check_fields({k: v for k, v in data.items() if k not in _NO_OP}, ResponsesRequest)


# ---- request -> chat ------------------------------------------------------------------------


def to_chat(req: ResponsesRequest) -> dict[str, Any]:
    """The chat completion request a Responses request means (400 naming what cannot be)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    for i, item in enumerate(items):
        _add_item(messages, item, f"input[{i}]")
    chat: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name, value in (
        ("max_completion_tokens", req.max_output_tokens),
        ("temperature", req.temperature),
        ("top_p", req.top_p),
        ("parallel_tool_calls", req.parallel_tool_calls),
    ):
        if value is not None:
            chat[name] = value
    if req.tools:
        chat["tools"] = [_chat_tool(tool, f"tools[{i}]") for i, tool in enumerate(req.tools)]
    if req.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
    if req.text is not None:
        chat["response_format"] = _chat_format(req.text)
    if req.stream:
        chat["stream_options"] = {"include_usage": True}
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
        raise bad_request(
            f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs"
        )
    if LOGPROBS in (req.include or ()):  # OpenAI's: the output text's logprobs, top k each
        chat["logprobs"] = True
        chat["top_logprobs"] = req.top_logprobs or 0
    return chat


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    if not isinstance(item, dict):
        raise bad_request(f"'{where}' must be an object", where)
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise bad_request(f"'{where}.role' must be user, system, developer or assistant", where)
        messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
    elif kind == "function_call":
        call = {
            "id": _string(item, "call_id", where),
            "type": "function",
            "function": {
                "name": _string(item, "name", where),
                "arguments": _string(item, "arguments", where),
            },
        }
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and "tool_calls" in last:
            last["tool_calls"].append(call)  # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        if not isinstance(output, str):
            output = _text(output, f"{where}.output")
        messages.append(
            {"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": output}
        )
    else:
        raise bad_request(
            f"'{where}.type' {kind!r} is not supported: only message, function_call and "
            "function_call_output items",
            f"{where}.type",
        )


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or input_text / output_text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"'{where}' must be a string or a list of text parts", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise bad_request(
                f"'{where}[{j}]' must be an input_text or output_text part with a 'text' "
                f"(got type {kind!r}: this server takes text only)",
                f"{where}[{j}]",
            )
        parts.append(part["text"])
    return "\n".join(parts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"'{where}.{key}' must be a string", f"{where}.{key}")
    return value


def _chat_tool(tool: dict[str, Any], where: str) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise bad_request(
            f"'{where}.type' {tool.get('type')!r} is not supported: only function tools "
            "(this server has no built-in tools)",
            f"{where}.type",
        )
    function = {"name": tool.get("name"), "parameters": tool.get("parameters") or {}}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}',
        "tool_choice",
    )


def _chat_format(text: dict[str, Any]) -> dict[str, Any]:
    fmt = text.get("format") or {"type": "text"}
    if not isinstance(fmt, dict):
        raise bad_request("'text.format' must be an object", "text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # text / json_object, checked as the chat's response_format
