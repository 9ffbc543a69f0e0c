"""OpenAI's Responses API (``POST /v1/responses``), over the chat path.

The OpenAI Agents SDK drives a model through this endpoint by default, and LangChain's
``ChatOpenAI(use_responses_api=True)`` does too. A request becomes a chat completion:
``instructions`` the system message, each ``input`` message a chat message (``input_text`` /
``output_text`` parts joined), a ``function_call`` item an assistant tool call and a
``function_call_output`` item a tool message; function ``tools`` become chat tools,
``tool_choice`` and ``text.format`` (``json_object``, ``json_schema``) the chat's, so the chat
template, grammars and tool parsing are the chat endpoint's. The chat choice comes back as
output items: a ``message`` with one ``output_text`` part, then a ``function_call`` per call.
Streamed, it is OpenAI's event sequence (``response.created`` ... ``response.completed``,
each with its ``sequence_number``), made from the chat chunks as they come.

kvrelay keeps no responses: ``store: true``, ``previous_response_id``, ``conversation`` and
``background`` are 400s that say so (send the whole conversation as ``input``, which is what
the Agents SDK does without a stored response), as are built-in tools, images and files.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from kvrelay.router.backend import BackendError, Delta
from kvrelay.router.errors import ApiError, bad_request, from_backend_error
from kvrelay.router.request_models import ChatCompletionRequest, _Strict, check_fields
from kvrelay.router.responses import ChatBuilder

if TYPE_CHECKING:
    from fastapi import FastAPI

    from kvrelay.router.api import OpenAIApi
    from kvrelay.router.sse import ChoiceStream

logger = logging.getLogger(__name__)

# Fields of OpenAI's Responses requests kvrelay cannot honour, and why.
_UNSUPPORTED = {
    "previous_response_id": "not supported: kvrelay keeps no responses (send the whole "
    "conversation as 'input')",
    "conversation": "not supported: kvrelay keeps no conversations (send them as 'input')",
    "background": "not supported: responses run in the foreground",
    "reasoning": "not supported: the served models have no reasoning mode",
    "prompt": "not supported (stored prompt templates)",
    "max_tool_calls": "not supported",
    "top_logprobs": "not supported on /v1/responses (use /v1/chat/completions)",
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
    truncation: str | None = None
    metadata: dict[str, str] | None = None


def add_responses_routes(app: FastAPI, api: OpenAIApi) -> None:
    from kvrelay.router.api import parse_json_object, validate_request  # it imports this module

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
    if data.get("include"):
        raise bad_request(
            "'include' is not supported: nothing can be added to the output", "include"
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


# ---- chat -> response -----------------------------------------------------------------------


class ResponsesBuilder(ChatBuilder):
    """A chat builder whose full response is a Responses object (``response``)."""

    request: ResponsesRequest

    def response(self) -> dict[str, Any]:
        chat = super().response()
        choice = chat["choices"][0]
        items = _output_items(choice["message"])
        return self.response_object(_status(choice["finish_reason"]), items, _usage(chat["usage"]))

    def response_object(
        self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        req = self.request
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": "resp_" + self.id.removeprefix(self.id_prefix),
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [],
            "text": req.text or {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
            "metadata": req.metadata or {},
            "store": False,
        }


def _status(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    return {
        "input_tokens": chat["prompt_tokens"],
        "input_tokens_details": {
            "cached_tokens": chat["prompt_tokens_details"]["cached_tokens"],
            "cache_write_tokens": 0,  # kvrelay caches every full block; nothing is billed
        },
        "output_tokens": chat["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat["total_tokens"],
    }


def _output_items(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = []
    if message.get("content"):
        items.append(_message_item(_new_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(_call_item(_new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)] if status == "completed" else [],
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- streaming ------------------------------------------------------------------------------


class _Events:
    """The Responses events of one streamed response, made from its chat chunks."""

    def __init__(self, builder: ResponsesBuilder) -> None:
        self.builder = builder
        self.sequence = 0
        self.output: list[dict[str, Any]] = []  # finished items
        self.text: dict[str, Any] | None = None  # the open message item: id, index, text
        self.calls: dict[int, dict[str, Any]] = {}  # open function calls by chat index
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None

    def event(self, kind: str, **body: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **body}
        self.sequence += 1
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n".encode()

    def start(self) -> list[bytes]:
        shell = self.builder.response_object("in_progress", [], None)
        return [
            self.event("response.created", response=shell),
            self.event("response.in_progress", response=shell),
        ]

    def on_chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        out: list[bytes] = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _index(self) -> int:
        return len(self.output) + (self.text is not None) + len(self.calls)

    def _text_delta(self, text: str) -> list[bytes]:
        out = []
        if self.text is None:
            self.text = {"id": _new_id("msg"), "index": self._index(), "text": ""}
            item = _message_item(self.text["id"], "", "in_progress")
            where = {"item_id": self.text["id"], "output_index": self.text["index"]}
            out.append(
                self.event(
                    "response.output_item.added", output_index=where["output_index"], item=item
                )
            )
            out.append(
                self.event(
                    "response.content_part.added", **where, content_index=0, part=_text_part("")
                )
            )
        self.text["text"] += text
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=self.text["index"],
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[bytes]:
        out = []
        state = self.calls.get(call["index"])
        function = call.get("function") or {}
        if state is None:
            out += self._close_text()
            state = self.calls[call["index"]] = {
                "id": _new_id("fc"),
                "index": self._index(),
                "call_id": call.get("id") or _new_id("call"),
                "name": function.get("name") or "",
                "arguments": "",
            }
            item = _call_item(state["id"], state["call_id"], state["name"], "", "in_progress")
            out.append(
                self.event("response.output_item.added", output_index=state["index"], item=item)
            )
        if function.get("arguments"):
            state["arguments"] += function["arguments"]
            out.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=state["id"],
                    output_index=state["index"],
                    delta=function["arguments"],
                )
            )
        return out

    def _close_text(self) -> list[bytes]:
        if self.text is None:
            return []
        text, self.text = self.text, None
        where = {"item_id": text["id"], "output_index": text["index"]}
        item = _message_item(text["id"], text["text"], "completed")
        self.output.append(item)
        return [
            self.event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text["text"],
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                **where,
                content_index=0,
                part=_text_part(text["text"]),
            ),
            self.event("response.output_item.done", output_index=text["index"], item=item),
        ]

    def finish(self) -> list[bytes]:
        out = self._close_text()
        for state in self.calls.values():
            item = _call_item(state["id"], state["call_id"], state["name"], state["arguments"])
            self.output.append(item)
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=state["id"],
                    output_index=state["index"],
                    arguments=state["arguments"],
                    name=state["name"],
                )
            )
            out.append(
                self.event("response.output_item.done", output_index=state["index"], item=item)
            )
        self.calls = {}
        status = _status(self.finish_reason)
        final = self.builder.response_object(status, self.output, self.usage)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        out.append(self.event(kind, response=final))
        return out


async def response_events(
    first: tuple[int, Delta], stream: ChoiceStream, builder: ResponsesBuilder
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response; an error after it started is OpenAI's ``error``
    event followed by ``response.failed``."""
    events = _Events(builder)
    try:
        for data in events.start():
            yield data
        item: tuple[int, Delta] | None = first
        while item is not None:
            chunk = builder.delta_chunk(*item)
            if chunk is not None:
                for data in events.on_chunk(chunk):
                    yield data
            item = await stream.next()
        usage = builder.usage_chunk()
        if usage is not None:
            events.on_chunk(usage)
        for data in events.finish():
            yield data
    except BackendError as exc:
        logger.warning("response %s failed while streaming: %s", builder.id, exc)
        error = from_backend_error(exc)
        yield events.event("error", code=error.code, message=error.message, param=error.param)
        failed = builder.response_object("failed", events.output, None)
        failed["error"] = {"code": error.code or "server_error", "message": error.message}
        yield events.event("response.failed", response=failed)
    finally:
        stream.close()
