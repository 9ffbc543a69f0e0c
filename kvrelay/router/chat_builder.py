"""Chat completion bodies and chunks (``ChatBuilder``): a choice's text, or its tool calls."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvrelay.protocol.sampling_params import TokenLogprobs
from kvrelay.router.backend import Delta
from kvrelay.router.responses import ChoiceState, PromptInfo, ResponseBuilder, ResponseOptions
from kvrelay.router.structured import ToolPlan, new_call_id
from kvrelay.router.token_strings import TokenStrings, clamped
from kvrelay.text.tool_parsers import PartialCall, ToolCall


def _tool_calls(calls: Iterable[Any], with_index: bool) -> list[dict[str, Any]]:
    return [
        {
            **({"index": i} if with_index else {}),
            "id": new_call_id(),
            "type": "function",
            "function": {"name": call.name, "arguments": call.arguments},
        }
        for i, call in enumerate(calls)
    ]


def _finish_reason(choice: ChoiceState, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and choice.finish_reason == "stop" else choice.finish_reason


class ChatBuilder(ResponseBuilder):
    """Chat responses; with ``tools``, a choice's text is read back as tool calls.

    Streaming with tools: a ``named`` choice streams its arguments as they come; ``auto`` and
    ``required`` stream the text that cannot be part of a call (``ToolParser.content_len``;
    none for ``required``), and each call as the model writes it: its id and name once the
    name is complete, then its arguments' raw JSON text as it grows (``ToolPlan.streamed``).
    """

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(
        self,
        model: str,
        prompts: Sequence[PromptInfo],
        n: int,
        tokens: TokenStrings,
        options: ResponseOptions,
        tools: ToolPlan | None = None,
    ) -> None:
        super().__init__(model, prompts, n, tokens, options)
        self.tools = tools or ToolPlan("none")

    def response(self) -> dict[str, Any]:
        body = super().response()
        if self.options.prompt_logprobs:  # vLLM's: the one prompt's, beside the choices
            body["prompt_logprobs"] = self._prompt_logprobs(self.choices[0])
        return body

    def start_chunks(self) -> list[dict[str, Any]]:
        role = {"role": "assistant", "content": ""}
        return [
            self.chunk([{"index": c.index, "delta": role, "logprobs": None, "finish_reason": None}])
            for c in self.choices
        ]

    def _final_choice(self, choice: ChoiceState) -> dict[str, Any]:
        text = "".join(choice.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parsed = self.tools.extract(text)
        calls = parsed.calls
        if calls:
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": _tool_calls(parsed.calls, with_index=False),
            }
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.logprobs) if self.options.want_logprobs else None,
            "finish_reason": _finish_reason(choice, bool(calls)),
            "stop_reason": choice.stop_reason,
        }

    def delta_chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        if self.tools.mode == "none":
            return super().delta_chunk(index, delta)
        choice = self.choices[index]
        first = not choice.started
        choice.started = True
        choice.add(delta)
        body = self._delta_choice(choice, delta, first)
        if self.tools.mode == "named":
            body["delta"] = self._named_delta(delta, first)
        else:
            body["delta"] = self._parsed_delta(choice, delta.finished)
        if delta.finished:
            has_calls = self.tools.mode == "named" or bool(choice.calls_sent)
            body["finish_reason"] = _finish_reason(choice, has_calls)
            body["stop_reason"] = delta.stop_reason
        elif not body["delta"] and not (self.options.want_logprobs and delta.logprobs):
            return None
        return self.chunk([body])

    def _named_delta(self, delta: Delta, first: bool) -> dict[str, Any]:
        """The forced function's call: its name first, then its arguments as they come."""
        if first:
            call = _tool_calls([ToolCall(self.tools.name, delta.text)], with_index=True)
            return {"tool_calls": call}
        if delta.text:
            return {"tool_calls": [{"index": 0, "function": {"arguments": delta.text}}]}
        return {}

    def _parsed_delta(self, choice: ChoiceState, finished: bool) -> dict[str, Any]:
        """Content that cannot be part of a call at once; each call's name once its string is
        complete, then its arguments as they grow; at the end, what is left."""
        text = "".join(choice.text)
        final = self.tools.extract(text).calls if finished else []
        partial, ready = self.tools.streamed(text)
        parts = self._call_parts(choice, partial, final)
        if finished and not choice.calls_sent:
            ready = len(text)  # no call after all: the rest is content
        content = text[choice.num_sent_chars : ready]
        choice.num_sent_chars = max(choice.num_sent_chars, ready)
        body: dict[str, Any] = {"content": content} if content else {}
        if parts:
            body["tool_calls"] = parts
        return body

    def _call_parts(
        self, choice: ChoiceState, partial: list[PartialCall], final: list[ToolCall]
    ) -> list[dict[str, Any]]:
        """``delta.tool_calls`` entries for what the calls gained since the last chunk: a new
        call's id and name (once the name is complete), then the growth of its arguments.
        Arguments written as an object stream as raw text; any other form (a JSON string of
        the object, say) is sent whole, as the final parse reads it, when the choice ends."""
        parts = []
        for i, call in enumerate(partial):
            if call.name is None:
                break  # later calls wait for this one's name
            part: dict[str, Any] = {"index": i, "function": {}}
            if i == len(choice.calls_sent):
                part |= {"id": new_call_id(), "type": "function"}
                part["function"] = {"name": call.name, "arguments": ""}
                choice.calls_sent.append(0)
            sent = choice.calls_sent[i]
            new = ""
            if call.arguments.startswith("{") and sent >= 0:
                new = call.arguments[sent:]
                choice.calls_sent[i] += len(new)
            elif i < len(final) and sent == 0:
                new = final[i].arguments
                choice.calls_sent[i] = -1  # sent whole
            if new:
                part["function"]["arguments"] = new
            if "id" in part or new:
                parts.append(part)
        for i in range(len(choice.calls_sent), len(final)):  # a form the scan cannot follow
            parts.extend(_tool_calls([final[i]], with_index=True))
            parts[-1]["index"] = i
            choice.calls_sent.append(-1)
        return parts

    def _delta_choice(self, choice: ChoiceState, delta: Delta, first: bool) -> dict[str, Any]:
        logprobs = None
        if self.options.want_logprobs:
            logprobs = self._logprobs(delta.logprobs or ())
        return {
            "index": choice.index,
            "delta": {"content": delta.text} if delta.text else {},
            "logprobs": logprobs,
            "finish_reason": None,
        }

    def _logprobs(self, entries: Iterable[TokenLogprobs]) -> dict[str, Any]:
        return {
            "content": [
                {
                    **self._token(entry.token_id, entry.logprob),
                    "top_logprobs": [self._token(i, lp) for i, lp in entry.top],
                }
                for entry in entries
            ],
            "refusal": None,
        }

    def _token(self, token_id: int, logprob: float) -> dict[str, Any]:
        return {
            "token": self._token_text(token_id),
            "logprob": clamped(logprob),
            "bytes": self.tokens.utf8(token_id),
        }
