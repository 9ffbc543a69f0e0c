"""One request in flight on the router: where it runs, what it has streamed, and how the
workers' token events become the client's deltas.

Token events carry their offset in the output, so events from the prefill and the decode
instance may arrive in any order: one ahead of the stream waits in ``early`` until the tokens
before it came; tokens already streamed (a re-run re-sends them) are skipped. Stop strings are
applied here, where the text is made; workers never see them. Which events are let in at all
(the current attempt, the assigned instances, their own connections) is the dispatcher's
decision, made before ``accept``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any, NamedTuple

from kvrelay.protocol.messages import TokenEvent
from kvrelay.protocol.sampling_params import TokenLogprobs
from kvrelay.router.backend import Delta, GenerateInput
from kvrelay.router.instance import Placement
from kvrelay.router.metrics import RouterMetrics
from kvrelay.text.stop import StopChecker


class LatencySample(NamedTuple):
    """One finished request's latencies (the autoscaler's SLO windows)."""

    finished_at: float  # time.monotonic() at the last token
    ttft_s: float  # admission to the first token
    tpot_s: float | None  # mean time per output token after the first; None with one token


@dataclasses.dataclass(slots=True)
class Tracked:
    request: GenerateInput
    stop: StopChecker
    queue: asyncio.Queue[Delta | Exception]
    placement: Placement
    watch: set[str]  # the instances it depends on now (placed on, not handed off from)
    tokens: list[int] = dataclasses.field(default_factory=list)
    early: dict[int, TokenEvent] = dataclasses.field(default_factory=dict)
    done: bool = False
    stopped_by_string: bool = False  # ended here by a stop string: the worker still runs it
    num_retries: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    started: float = dataclasses.field(default_factory=time.monotonic)
    attempt: int = 0  # GenerateRequest.attempt of the current placement
    first_token: float = 0.0
    last_token: float = 0.0

    def accept(self, event: TokenEvent, metrics: RouterMetrics) -> list[Delta]:
        """The deltas an admitted event makes, in stream order (none while it waits for an
        earlier offset, or when it brings nothing new); ``done`` once one finishes."""
        if event.handed_off_to is not None:
            self.watch.discard(event.instance_id)
            self.watch.add(event.handed_off_to)
        if event.offset > len(self.tokens):
            self.early[event.offset] = event
            return []
        deltas = [self._apply(event, metrics)]
        while not self.done and len(self.tokens) in self.early:
            deltas.append(self._apply(self.early.pop(len(self.tokens)), metrics))
        return [d for d in deltas if d is not None]

    def _apply(self, event: TokenEvent, metrics: RouterMetrics) -> Delta | None:
        skip = len(self.tokens) - event.offset  # already streamed (a retry re-sends them)
        new = event.token_ids[skip:]
        if not new and not event.finished:
            return None
        is_first = not self.tokens and (bool(new) or event.embedding is not None)
        now = time.monotonic()
        if is_first:
            self.num_cached_tokens = event.num_cached_tokens
            self.cached_tokens_by_tier = dict(event.cached_tokens_by_tier)
        if is_first and new:  # an embedding has no first token
            self.first_token = now
            metrics.ttft.observe(now - self.started)
        elif new:
            metrics.itl.observe(now - self.last_token)
        self.last_token = now
        text, stop_str, num_used = self._detokenize(new, event.finished)
        new = new[:num_used]
        self.tokens.extend(new)
        finished = event.finished or stop_str is not None
        reason = "stop" if stop_str is not None else event.finish_reason
        if finished:
            self.done = True
            self.stopped_by_string = stop_str is not None
        return Delta(
            token_ids=new,
            text=text,
            logprobs=_logprobs(event.logprobs, skip, len(new)),
            finished=finished,
            finish_reason=reason if finished else None,
            stop_reason=stop_str if stop_str is not None else event.stop_reason,
            num_prompt_tokens=len(self.request.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens if is_first else 0,
            cached_tokens_by_tier=self.cached_tokens_by_tier if is_first else {},
            prompt_logprobs=_prompt_logprobs(event.prompt_logprobs) if is_first else None,
            embedding=event.embedding,
        )

    def _detokenize(self, new: list[int], finished: bool) -> tuple[str, str | None, int]:
        """Text of the new tokens; a stop string ends the request at the token that made it."""
        parts = []
        for i, token_id in enumerate(new):
            last = finished and i == len(new) - 1
            text, stop_str = self.stop.append(token_id, finished=last)
            parts.append(text)
            if stop_str is not None:
                return "".join(parts), stop_str, i + 1
        return "".join(parts), None, len(new)

    def latency(self) -> LatencySample | None:
        """The finished request's latencies; None when it streamed no token."""
        if not self.tokens:
            return None
        num_after_first = len(self.tokens) - 1
        tpot = (self.last_token - self.first_token) / num_after_first if num_after_first else None
        return LatencySample(self.last_token, self.first_token - self.started, tpot)


def _logprobs(wire: list[Any] | None, skip: int, count: int) -> list[TokenLogprobs] | None:
    if wire is None:
        return None
    return [_from_wire(item) for item in wire[skip : skip + count]]


def _prompt_logprobs(wire: list[Any] | None) -> list[TokenLogprobs | None] | None:
    if wire is None:
        return None
    return [None if item is None else _from_wire(item) for item in wire]


def _from_wire(item: list[Any]) -> TokenLogprobs:
    token_id, logprob, rank, top = item
    return TokenLogprobs(token_id, logprob, rank, tuple((t[0], t[1]) for t in top))
