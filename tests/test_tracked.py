"""One request's stream on the router (``router.tracked``): token events from the prefill and
the decode instance in any order, a re-run's repeated tokens, stop strings cut where the text
is made, latencies."""

from __future__ import annotations

import asyncio

from kvrelay.protocol.messages import TokenEvent
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.router.backend import GenerateInput
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.tracked import Tracked
from kvrelay.text.stop import StopChecker
from kvrelay.text.tokenizer import Tokenizer


def _tracked(tokenizer: Tokenizer | None, params: SamplingParams) -> Tracked:
    request = GenerateInput("r1", [1, 2, 3], params)
    stop = StopChecker(tokenizer, request.prompt_token_ids, params)
    return Tracked(request, stop, asyncio.Queue(), None, {"p"})  # type: ignore[arg-type]


def _event(offset: int, ids: list[int], sender: str = "d", **kw: object) -> TokenEvent:
    return TokenEvent("r1", sender, ids, offset, **kw)  # type: ignore[arg-type]


def test_events_stream_in_offset_order_whoever_sends_them() -> None:
    tr, metrics = _tracked(None, SamplingParams(max_tokens=8)), RouterMetrics()
    # the prefill's first token hands the request to the decode instance
    assert [d.token_ids for d in tr.accept(_event(0, [7], "p", handed_off_to="d"), metrics)] == [
        [7]
    ]
    assert tr.watch == {"d"}  # the prefill may now die freely
    assert tr.accept(_event(3, [10, 11]), metrics) == []  # ahead of the stream: it waits
    assert tr.accept(_event(2, [9]), metrics) == []
    deltas = tr.accept(_event(1, [8]), metrics)  # fills the gap: all three, in order
    assert [d.token_ids for d in deltas] == [[8], [9], [10, 11]]
    assert tr.tokens == [7, 8, 9, 10, 11] and not tr.early
    # a re-run re-sends what was streamed: only the new tokens go out
    deltas = tr.accept(_event(3, [10, 11, 12], finished=True, finish_reason="length"), metrics)
    assert [(d.token_ids, d.finished, d.finish_reason) for d in deltas] == [([12], True, "length")]
    assert tr.done and not tr.stopped_by_string
    latency = tr.latency()
    assert latency is not None and latency.tpot_s is not None and latency.tpot_s >= 0
    assert latency.ttft_s == tr.first_token - tr.started


def test_a_stop_string_ends_the_stream_at_the_token_that_made_it(tiny_model_dir) -> None:
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    stop = " three"
    tr = _tracked(tokenizer, SamplingParams(max_tokens=32, stop=[stop]))
    deltas = tr.accept(_event(0, ids), RouterMetrics())
    text = "".join(d.text for d in deltas)
    assert deltas[-1].finished and deltas[-1].finish_reason == "stop"
    assert deltas[-1].stop_reason == stop
    assert text == "one two" and tr.done and tr.stopped_by_string  # the worker still runs
    used = sum(len(d.token_ids) for d in deltas)
    assert used < len(ids) and tokenizer.decode(ids[:used]).endswith("three")


def test_nothing_new_makes_no_delta_and_no_latency_without_tokens() -> None:
    tr = _tracked(None, SamplingParams(max_tokens=4))
    assert tr.accept(_event(0, []), RouterMetrics()) == []
    assert tr.latency() is None
