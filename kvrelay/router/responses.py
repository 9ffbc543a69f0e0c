"""Response bodies of ``/v1/completions`` and ``/v1/chat/completions``: what the client sees.

Decides how the ``Delta`` stream of every choice is shown: ``ResponseBuilder`` turns it into
OpenAI response bodies, stream chunks, usage and logprobs; ``CompletionBuilder`` writes
completions, ``chat_builder.ChatBuilder`` chat completions; ``token_strings.TokenStrings``
gives each token's text and bytes for logprobs, as vLLM reports them.
"""

from __future__ import annotations

import abc
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvrelay.protocol.sampling_params import TokenLogprobs
from kvrelay.router.backend import Delta
from kvrelay.router.token_strings import TokenStrings, clamped

# ---- responses ----------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    prompt_index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    text_offset: int = 0  # completions logprobs: characters of token text reported so far
    num_sent_chars: int = 0  # chat with tools, stream: characters of text sent as content
    calls_sent: list[int] = field(default_factory=list)  # per call streamed: argument chars sent
    started: bool = False  # a delta arrived (echo and role chunks are sent once)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # echo: the prompt tokens'

    def add(self, delta: Delta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.logprobs.extend(delta.logprobs or ())
        if delta.num_cached_tokens:
            self.num_cached_tokens += delta.num_cached_tokens
            for tier, count in delta.cached_tokens_by_tier.items():
                self.cached_tokens_by_tier[tier] = self.cached_tokens_by_tier.get(tier, 0) + count
        if delta.finished:
            self.finish_reason = delta.finish_reason
            self.stop_reason = delta.stop_reason


@dataclass(frozen=True, slots=True)
class ResponseOptions:
    """What a response carries besides text."""

    include_usage: bool = False  # stream: a final chunk with usage and no choices
    continuous_usage: bool = False  # stream: every chunk carries the usage so far (vLLM's)
    want_logprobs: bool = False  # logprobs of every output token
    echo: bool = False  # completions: the prompt text (and its tokens) come first
    tokens_as_ids: bool = False  # logprob tokens as "token_id:{id}" (vLLM's extension)
    num_logprobs: int = 0  # completions: top alternatives shown per token (echoed prompt too)
    prompt_only: bool = False  # completions' echo with max_tokens 0: the prompt, no output
    prompt_logprobs: bool = False  # vLLM's ``prompt_logprobs`` field in the response


@dataclass(frozen=True, slots=True)
class PromptInfo:
    token_ids: list[int]
    text: str  # the prompt as given, or the decoded token ids (for echo)


def make_usage(prompts: Sequence[PromptInfo], choices: Iterable[ChoiceState]) -> dict[str, Any]:
    """OpenAI usage; a prompt's cached tokens are those of its best-cached choice."""
    best: dict[int, ChoiceState] = {}
    num_completion = 0
    for choice in choices:
        num_completion += len(choice.token_ids)
        current = best.get(choice.prompt_index)
        if current is None or choice.num_cached_tokens > current.num_cached_tokens:
            best[choice.prompt_index] = choice
    by_tier: dict[str, int] = {}
    for choice in best.values():
        for tier, count in choice.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + count
    num_prompt = sum(len(p.token_ids) for p in prompts)
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
        "prompt_tokens_details": {"cached_tokens": sum(c.num_cached_tokens for c in best.values())},
        "kvrelay_cached_tokens_by_tier": by_tier,
    }


class ResponseBuilder(abc.ABC):
    """Builds the bodies of one request: a full response, or its stream chunks.

    Choice ``i`` of prompt ``p`` has index ``p * n + i`` (as OpenAI numbers a batch).
    Subclasses say how a choice and its logprobs look; this class keeps per-choice state.
    """

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(
        self,
        model: str,
        prompts: Sequence[PromptInfo],
        n: int,
        tokens: TokenStrings,
        options: ResponseOptions,
    ) -> None:
        self.id = f"{self.id_prefix}{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.prompts = list(prompts)
        self.tokens = tokens
        self.options = options
        self.choices = [
            ChoiceState(index=p * n + i, prompt_index=p)
            for p in range(len(prompts))
            for i in range(n)
        ]

    def request_id(self, index: int) -> str:
        return f"{self.id}-{index}"

    # ---- non-stream

    def add(self, index: int, delta: Delta) -> None:
        self.choices[index].add(delta)

    def response(self) -> dict[str, Any]:
        return {
            **self._header(self.object_name),
            "choices": [self._final_choice(c) for c in self.choices],
            "usage": make_usage(self.prompts, self.choices),
        }

    # ---- stream

    def start_chunks(self) -> list[dict[str, Any]]:
        """Chunks sent before any delta (chat: the role of every choice)."""
        return []

    def delta_chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        """The chunk one delta turns into; None when it carries nothing to show yet."""
        choice = self.choices[index]
        first = not choice.started
        choice.started = True
        choice.add(delta)
        if not self._has_news(delta, first):
            return None
        body = self._delta_choice(choice, delta, first)
        if delta.finished:
            body["finish_reason"] = delta.finish_reason
            body["stop_reason"] = delta.stop_reason
        return self.chunk([body])

    def _has_news(self, delta: Delta, first: bool) -> bool:
        """False for a delta whose text is held back (a possible stop string) and that
        carries no logprobs, finish or echo to send."""
        if delta.text or delta.finished or (first and self.options.echo):
            return True
        return bool(self.options.want_logprobs and delta.logprobs)

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self._header(self.chunk_object_name), "choices": choices}
        if self.options.continuous_usage:
            body["usage"] = make_usage(self.prompts, self.choices)
        elif self.options.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any] | None:
        if not self.options.include_usage:
            return None
        return {
            **self._header(self.chunk_object_name),
            "choices": [],
            "usage": make_usage(self.prompts, self.choices),
        }

    # ---- per-endpoint shape

    def _prompt_logprobs(self, choice: ChoiceState) -> list[dict[str, Any] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else the token's
        and the top alternatives' {"token id": {logprob, rank, decoded_token}}."""
        out: list[dict[str, Any] | None] = []
        for entry in choice.prompt_logprobs or ():
            if entry is None:
                out.append(None)
                continue
            ranked = {t: (lp, r) for r, (t, lp) in enumerate(entry.top, start=1)}
            ranked[entry.token_id] = (entry.logprob, entry.rank)
            out.append({
                str(t): {"logprob": clamped(lp), "rank": r, "decoded_token": self.tokens.text(t)}
                for t, (lp, r) in ranked.items()
            })  # fmt: skip
        return out

    def _token_text(self, token_id: int) -> str:
        if self.options.tokens_as_ids:
            return f"token_id:{token_id}"
        return self.tokens.text(token_id)

    def _header(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
        }

    @abc.abstractmethod
    def _final_choice(self, choice: ChoiceState) -> dict[str, Any]:
        """A choice of the non-stream response."""

    @abc.abstractmethod
    def _delta_choice(self, choice: ChoiceState, delta: Delta, first: bool) -> dict[str, Any]:
        """A choice of a stream chunk (``first``: the choice's first delta)."""


class CompletionBuilder(ResponseBuilder):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def add(self, index: int, delta: Delta) -> None:
        super().add(index, self._shown(delta))

    def delta_chunk(self, index: int, delta: Delta) -> dict[str, Any] | None:
        return super().delta_chunk(index, self._shown(delta))

    def _shown(self, delta: Delta) -> Delta:
        """The delta as the response shows it: with ``prompt_only`` (echo, max_tokens 0, as
        vLLM and OpenAI's legacy completions take it) the one token the engine had to make is
        dropped, and the choice ends on ``length``."""
        if not self.options.prompt_only:
            return delta
        reason = "length" if delta.finished else None
        return replace(delta, token_ids=[], text="", logprobs=None, finish_reason=reason,
                       stop_reason=None)  # fmt: skip

    def _final_choice(self, choice: ChoiceState) -> dict[str, Any]:
        prompt = self.prompts[choice.prompt_index]
        text = "".join(choice.text)
        logprobs = None
        if self.options.want_logprobs:
            choice.text_offset = 0
            echo = prompt if self.options.echo else None
            logprobs = self._logprobs(choice, echo, choice.logprobs, choice.prompt_logprobs)
        body = {
            "index": choice.index,
            "text": prompt.text + text if self.options.echo else text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }
        if self.options.prompt_logprobs:
            body["prompt_logprobs"] = self._prompt_logprobs(choice)
        return body

    def _delta_choice(self, choice: ChoiceState, delta: Delta, first: bool) -> dict[str, Any]:
        echo = self.prompts[choice.prompt_index] if self.options.echo and first else None
        logprobs = None
        if self.options.want_logprobs:
            logprobs = self._logprobs(choice, echo, delta.logprobs or (), delta.prompt_logprobs)
        text = echo.text + delta.text if echo else delta.text
        return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": None}

    def _logprobs(
        self,
        choice: ChoiceState,
        echo: PromptInfo | None,
        entries: Iterable[TokenLogprobs],
        prompt_entries: Sequence[TokenLogprobs | None] | None = None,
    ) -> dict[str, Any]:
        """OpenAI's legacy logprobs; with ``echo`` the prompt's tokens first, each with its
        logprob and top alternatives from ``prompt_entries`` (the first token has none)."""
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for i, token_id in enumerate(echo.token_ids if echo else ()):
            entry = prompt_entries[i] if prompt_entries and i < len(prompt_entries) else None
            if entry is None:
                self._append(out, choice, token_id, None, None)
            else:
                top = self._top(entry._replace(top=entry.top[: self.options.num_logprobs]))
                self._append(out, choice, token_id, clamped(entry.logprob), top)
        for entry in entries:
            self._append(out, choice, entry.token_id, clamped(entry.logprob), self._top(entry))
        return out

    def _top(self, entry: TokenLogprobs) -> dict[str, float]:
        top = {self._token_text(i): clamped(lp) for i, lp in entry.top}
        top[self._token_text(entry.token_id)] = clamped(entry.logprob)
        return top

    def _append(
        self,
        out: dict[str, list[Any]],
        choice: ChoiceState,
        token_id: int,
        logprob: float | None,
        top: dict[str, float] | None,
    ) -> None:
        out["tokens"].append(self._token_text(token_id))
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(top)
        out["text_offset"].append(choice.text_offset)
        choice.text_offset += len(self.tokens.text(token_id))
