"""The Responses API's output (``responses_api``): a chat choice as a Responses object, and
a stream's chat chunks as OpenAI's ``response.*`` events.

Non-stream, ``ResponsesBuilder.response`` turns the chat response into output items: a
``message`` with one ``output_text`` part, then a ``function_call`` per call, ``status``
``incomplete`` (``max_output_tokens``) when the length ended it. Streamed, ``response_events``
opens an item when its first text or call delta comes and closes it when the next begins or
the choice ends, every event numbered (``sequence_number``), ``response.completed`` or
``response.incomplete`` last; an error after the stream began is an ``error`` event and
``response.failed``.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from kvrelay.router.backend import BackendError, Delta
from kvrelay.router.chat_builder import ChatBuilder
from kvrelay.router.errors import from_backend_error

if TYPE_CHECKING:
    from kvrelay.router.responses_api import ResponsesRequest
    from kvrelay.router.sse import ChoiceStream

logger = logging.getLogger(__name__)


# ---- chat -> response -----------------------------------------------------------------------


class ResponsesBuilder(ChatBuilder):
    """A chat builder whose full response is a Responses object (``response``)."""

    request: ResponsesRequest

    def response(self) -> dict[str, Any]:
        chat = super().response()
        choice = chat["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        items = _output_items(choice["message"], logprobs)
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
            "top_logprobs": req.top_logprobs,
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


def _output_items(message: dict[str, Any], logprobs: list[Any]) -> list[dict[str, Any]]:
    items = []
    if message.get("content"):
        items.append(_message_item(_new_id("msg"), message["content"], "completed", logprobs))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(_call_item(_new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def _message_item(
    item_id: str, text: str, status: str, logprobs: list[Any] | None = None
) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text, logprobs)] if status == "completed" else [],
    }


def _text_part(text: str, logprobs: list[Any] | None = None) -> dict[str, Any]:
    """An ``output_text`` part; its logprobs are the chat's entries (token, logprob, bytes,
    top_logprobs: the same shape)."""
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


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
        self.pending: list[Any] = []  # logprobs of tokens whose text is not shown yet

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
            self.pending += (choice.get("logprobs") or {}).get("content") or []
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
            self.text = {"id": _new_id("msg"), "index": self._index(), "text": "", "logprobs": []}
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
        logprobs, self.pending = self.pending, []  # with the text they came with (or before)
        self.text["logprobs"] += logprobs
        out.append(
            self.event(
                "response.output_text.delta",
                item_id=self.text["id"],
                output_index=self.text["index"],
                content_index=0,
                delta=text,
                logprobs=logprobs,
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
        logprobs, self.pending = text["logprobs"] + self.pending, []
        where = {"item_id": text["id"], "output_index": text["index"]}
        item = _message_item(text["id"], text["text"], "completed", logprobs)
        self.output.append(item)
        return [
            self.event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text["text"],
                logprobs=logprobs,
            ),
            self.event(
                "response.content_part.done",
                **where,
                content_index=0,
                part=_text_part(text["text"], logprobs),
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
