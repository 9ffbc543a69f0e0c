"""Online serving load: Poisson arrivals against an OpenAI-compatible server (``kvrelay bench``).

The workload is ``num_requests`` random-token prompts (ids uniform in ``[4, vocab_size)``,
lengths uniform in ``prompt_lens``) asking for a length uniform in ``output_lens``, greedy
with eos ignored, so every request produces exactly its output length. Arrivals are a Poisson
process: exponential gaps of mean ``1 / rate`` drawn from ``random.Random(seed)``; the same
seed gives the same prompts, lengths and arrival times.

Per request, measured from the moment it is sent::

    sent ──TTFT──> first chunk with text ──────(n - 1) more tokens──────> [DONE]
    |<────────────────────────────── e2e ──────────────────────────────>|
    TPOT = (e2e - TTFT) / (n - 1), n = completion_tokens from the usage chunk

A request that answers an error status, an error event, or ends without usage or ``[DONE]``
is failed: it counts in ``num_failed`` and against SLO attainment, never in a percentile.
Goodput is the completed requests meeting both SLOs (TTFT and TPOT) per second of the run.

``--trace FILE`` replays a trace instead (``kvrelay.sim.trace``: the Splitwise CSVs, aiperf's
mooncake JSONL): each request at its arrival time times ``--time-scale``, a prompt of exactly
its length and its output length forced. Prompts are token ids sent to ``/v1/completions``
(the OpenAI API accepts a list of ids as the prompt), so the server sees exactly that many
prompt tokens without a tokenizer round trip; a server that only takes text is not supported.
Ids are uniform in ``[4, vocab_size)`` seeded per request; a mooncake ``hash_ids`` entry names
one 512-token block whose ids are seeded by the hash id, so equal ids are equal prompt blocks
and the trace's prefix sharing reaches the server.

Only the standard library, httpx and tqdm are used: no torch (``--plot`` imports matplotlib).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvrelay.sim.trace import MOONCAKE_BLOCK_TOKENS, TraceRequest

if TYPE_CHECKING:
    import httpx
    from tqdm import tqdm

logger = logging.getLogger(__name__)

MIN_TOKEN_ID = 4  # below: bos / eos / chat specials in make_tiny checkpoints
PERCENTILES = (50, 90, 99)


class BenchError(RuntimeError):
    """The server cannot be benchmarked: unreachable, model not served, lengths too long."""


@dataclass(frozen=True, slots=True)
class LoadConfig:
    url: str  # server root, e.g. http://127.0.0.1:8000
    model: str  # served model name
    rate: float = 1.0  # mean arrivals per second; inf = every request at once
    num_requests: int = 48  # requests in the run
    prompt_lens: tuple[int, int] = (32, 1024)  # inclusive range of prompt lengths (tokens)
    output_lens: tuple[int, int] = (32, 256)  # inclusive range of output lengths (tokens)
    seed: int = 0  # seeds prompts, lengths and arrival times
    vocab_size: int = 2000  # prompt ids are drawn from [4, vocab_size)
    concurrency_limit: int | None = None  # requests in flight at most; None = no limit
    request_timeout_s: float = 600.0  # longest wait for a connection or the next chunk
    trace: str | None = None  # the replayed trace file (then rate is not used)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate must be > 0 (inf for all at once), got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        for name, (low, high) in (("prompt", self.prompt_lens), ("output", self.output_lens)):
            if not 1 <= low <= high:
                raise ValueError(f"{name} lengths need 1 <= low <= high, got {low}:{high}")
        if self.vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size must be > {MIN_TOKEN_ID}, got {self.vocab_size}")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"concurrency_limit must be >= 1, got {self.concurrency_limit}")


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_ms: float  # a good request's first token arrives within this
    tpot_ms: float  # and its later tokens take at most this each, on average

    def is_met(self, ttft_s: float, tpot_s: float) -> bool:
        return ttft_s * 1e3 <= self.ttft_ms and tpot_s * 1e3 <= self.tpot_ms


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_ids: list[int]
    output_len: int
    arrival_s: float  # seconds after the start of the run


@dataclass(slots=True)
class RequestRecord:
    index: int  # position in the workload
    prompt_len: int
    output_len: int  # tokens asked for
    sent_s: float = 0.0  # seconds after the start of the run
    output_tokens: int = 0  # completion_tokens of the usage chunk
    ttft_s: float | None = None
    e2e_s: float | None = None
    error: str | None = None  # set when the request failed

    @property
    def is_ok(self) -> bool:
        return self.error is None and self.ttft_s is not None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float:
        """Mean seconds per token after the first (0 for a one-token answer)."""
        assert self.ttft_s is not None and self.e2e_s is not None
        if self.output_tokens <= 1:
            return 0.0
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class Stats:
    """Milliseconds over the completed requests."""

    mean: float
    p50: float
    p90: float
    p99: float


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_completed: int
    num_failed: int
    duration_s: float  # start of the run to the last answer
    total_input_tokens: int  # of completed requests
    total_output_tokens: int  # of completed requests
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    goodput: float  # completed requests meeting both SLOs / s
    slo_attainment: float  # share of all requests (failed included) meeting both SLOs, 0..1
    slo_ttft_ms: float
    slo_tpot_ms: float
    ttft_ms: Stats | None  # None when nothing completed
    tpot_ms: Stats | None
    e2e_ms: Stats | None
    errors: dict[str, int]  # failure message -> count


# ---------------------------------------------------------------------------- workload


def trace_requests(
    trace: Sequence[TraceRequest], seed: int = 0, vocab_size: int = 2000
) -> list[RequestSpec]:
    """A replay of ``trace`` (already capped and time-scaled): token-id prompts of the exact
    lengths; the blocks named by mooncake ``hash_ids`` get the same ids wherever they recur."""
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(f"{seed}/block/{hash_id}")
            ids = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(MOONCAKE_BLOCK_TOKENS)]
            blocks[hash_id] = ids
        return blocks[hash_id]

    out = []
    for i, r in enumerate(trace):
        prompt = [t for h in r.hash_ids for t in block(h)][: r.prompt_len]
        rng = random.Random(f"{seed}/request/{i}")
        prompt += [
            rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(r.prompt_len - len(prompt))
        ]
        out.append(RequestSpec(prompt, r.output_len, r.arrival_s))
    return out


def make_requests(config: LoadConfig) -> list[RequestSpec]:
    """The seeded workload: prompts, output lengths and Poisson arrival times."""
    rng = random.Random(config.seed)
    requests = []
    arrival_s = 0.0
    for _ in range(config.num_requests):
        prompt_len = rng.randint(*config.prompt_lens)
        prompt = [rng.randrange(MIN_TOKEN_ID, config.vocab_size) for _ in range(prompt_len)]
        requests.append(RequestSpec(prompt, rng.randint(*config.output_lens), arrival_s))
        if not math.isinf(config.rate):
            arrival_s += rng.expovariate(config.rate)
    return requests


# ---------------------------------------------------------------------------- client


def _completion_body(model: str, spec: RequestSpec) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": spec.prompt_ids,
        "max_tokens": spec.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(
    client: httpx.AsyncClient, model: str, index: int, spec: RequestSpec, run_start: float
) -> RequestRecord:
    """Streams one completion and times it; a failure is recorded, never raised."""
    import httpx

    record = RequestRecord(index, len(spec.prompt_ids), spec.output_len)
    start = time.perf_counter()
    record.sent_s = start - run_start
    try:
        async with client.stream(
            "POST", "/v1/completions", json=_completion_body(model, spec)
        ) as resp:
            if resp.status_code != 200:
                await resp.aread()
                record.error = f"HTTP {resp.status_code}: {_error_message(resp.text)}"
                return record
            is_done = await _read_events(resp, record, start)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
        return record
    if record.error is None:
        record.error = _missing_part(record, is_done)
    return record


async def _read_events(resp: httpx.Response, record: RequestRecord, start: float) -> bool:
    """Reads SSE events into ``record``; returns whether ``[DONE]`` arrived."""
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            record.e2e_s = time.perf_counter() - start
            return True
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            record.error = f"bad SSE event: {data[:200]!r}"
            return False
        if "error" in event:
            record.error = f"error event: {_error_message(data)}"
            return False
        if event.get("choices") and record.ttft_s is None:
            record.ttft_s = time.perf_counter() - start
        usage = event.get("usage")
        if isinstance(usage, dict):
            record.output_tokens = int(usage.get("completion_tokens") or 0)
    return False


def _missing_part(record: RequestRecord, is_done: bool) -> str | None:
    if not is_done:
        return "stream ended without [DONE]"
    if record.ttft_s is None:
        return "no token chunk"
    if record.output_tokens == 0:
        return "no usage chunk"
    return None


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return text[:200]


async def run_load(
    config: LoadConfig, requests: Sequence[RequestSpec], show_progress: bool = True
) -> tuple[list[RequestRecord], float]:
    """Sends every request at its arrival time; returns the records and the run's seconds."""
    import httpx
    from tqdm import tqdm

    timeout = httpx.Timeout(config.request_timeout_s, pool=None)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    limit = asyncio.Semaphore(config.concurrency_limit) if config.concurrency_limit else None
    async with httpx.AsyncClient(base_url=config.url, timeout=timeout, limits=limits) as client:
        bar = tqdm(
            total=len(requests),
            desc=f"trace {Path(config.trace).name}" if config.trace else f"rate {config.rate:g}/s",
            unit="req",
            file=sys.stderr,
            disable=not show_progress,
        )
        with bar:
            start = time.perf_counter()
            tasks = [
                _arrive(client, config.model, i, spec, start, limit, bar)
                for i, spec in enumerate(requests)
            ]
            records = await asyncio.gather(*tasks)
            duration_s = time.perf_counter() - start
    return list(records), duration_s


async def _arrive(
    client: httpx.AsyncClient,
    model: str,
    index: int,
    spec: RequestSpec,
    run_start: float,
    limit: asyncio.Semaphore | None,
    bar: tqdm,
) -> RequestRecord:
    await asyncio.sleep(max(0.0, run_start + spec.arrival_s - time.perf_counter()))
    async with limit or contextlib.nullcontext():
        record = await send_request(client, model, index, spec, run_start)
    bar.update(1)
    return record


def check_server(config: LoadConfig, timeout_s: float = 10.0) -> None:
    """Checks that the server answers, serves ``config.model`` and fits the longest request.

    Raises:
        BenchError: it does not.
    """
    import httpx

    try:
        resp = httpx.get(config.url + "/v1/models", timeout=timeout_s)
        resp.raise_for_status()
        models = {m["id"]: m for m in resp.json()["data"]}
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise BenchError(f"cannot list models at {config.url}: {exc}") from exc
    if config.model not in models:
        raise BenchError(f"model {config.model!r} is not served; served: {sorted(models)}")
    longest = config.prompt_lens[1] + config.output_lens[1]
    max_model_len = models[config.model].get("max_model_len")
    if max_model_len is not None and longest > max_model_len:
        raise BenchError(f"prompt + output up to {longest} tokens > max_model_len {max_model_len}")


def warm_up_config(config: LoadConfig, num_requests: int) -> LoadConfig:
    """The warm-up's load: short requests, one by one, each sent when the last has finished
    (not at the timed load's rate)."""
    return LoadConfig(
        config.url,
        config.model,
        num_requests=num_requests,
        prompt_lens=(16, 64),
        output_lens=(4, 8),
        seed=config.seed + 10_007,
        vocab_size=config.vocab_size,
        rate=math.inf,
        concurrency_limit=1,
    )


def warm_up(config: LoadConfig, num_requests: int = 2) -> None:
    """Sends a few short requests one by one (not timed); raises BenchError if one fails."""
    if num_requests < 1:
        return
    short = warm_up_config(config, num_requests)
    records, _ = asyncio.run(run_load(short, make_requests(short), show_progress=False))
    failed = [r.error for r in records if not r.is_ok]
    if failed:
        raise BenchError(f"warm-up request failed: {failed[0]}")


# ---------------------------------------------------------------------------- report


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def stats_ms(values_s: Sequence[float]) -> Stats | None:
    if not values_s:
        return None
    ms = [v * 1e3 for v in values_s]
    return Stats(sum(ms) / len(ms), *(percentile(ms, q) for q in PERCENTILES))


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo) -> Summary:
    done = [r for r in records if r.is_ok]
    good = [r for r in done if slo.is_met(r.ttft_s or 0.0, r.tpot_s)]
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    output_tokens = sum(r.output_tokens for r in done)
    return Summary(
        num_requests=len(records),
        num_completed=len(done),
        num_failed=len(records) - len(done),
        duration_s=duration_s,
        total_input_tokens=sum(r.prompt_len for r in done),
        total_output_tokens=output_tokens,
        request_throughput=len(done) * per_s,
        output_throughput=output_tokens * per_s,
        goodput=len(good) * per_s,
        slo_attainment=len(good) / len(records) if records else 0.0,
        slo_ttft_ms=slo.ttft_ms,
        slo_tpot_ms=slo.tpot_ms,
        ttft_ms=stats_ms([r.ttft_s for r in done if r.ttft_s is not None]),
        tpot_ms=stats_ms([r.tpot_s for r in done]),
        e2e_ms=stats_ms([r.e2e_s for r in done if r.e2e_s is not None]),
        errors=dict(Counter(r.error or "incomplete" for r in records if not r.is_ok)),
    )


def run_bench(
    config: LoadConfig,
    slo: Slo,
    show_progress: bool = True,
    requests: Sequence[RequestSpec] | None = None,
) -> tuple[Summary, list[RequestRecord]]:
    """One timed run of ``requests`` (default: ``config``'s workload); no check, no warm-up."""
    requests = make_requests(config) if requests is None else requests
    records, duration_s = asyncio.run(run_load(config, requests, show_progress))
    return summarize(records, duration_s, slo), records
