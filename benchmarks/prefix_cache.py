"""Prefix cache: multi-turn chat with a shared system prompt, tiers off vs L1 vs L1+L2.

Workload (deterministic): a system prompt of about ``--system-tokens`` tokens (measured with
the model's tokenizer) shared by ``--users`` users, each holding a chat of ``--turns`` turns.
Every turn sends the user's whole history (the system prompt, the earlier questions and the
replies the server gave) plus a new question, and asks for ``--output-tokens`` tokens (greedy,
eos ignored), so TTFT dominates. Requests go one at a time (concurrency 1) in a fixed
interleaved order: turn 1 of users 1..U, then turn 2 of users 1..U, and so on.

Configurations, each on a freshly started cluster (router, 1 prefill and 1 decode worker):

- ``off``: ``--no-prefix-caching --host-pool off`` on every worker: every prompt token is
  computed;
- ``L1``: prefix caching on (device blocks) and the L1 host shared-memory pool (the default);
- ``L1+L2``: a Redis L2 as well, read from a cold instance. The workload runs once on prefill
  A (unmeasured: it fills A's device cache, host A's L1 and Redis); once Redis's write-behind
  queue is empty, prefill B joins with an L1 pool of its own (another host: cold device cache,
  cold L1), A is drained, and the same workload runs again, measured, all on B.

Each measured pass follows one untimed warm-up request (no system message: it shares no block
with the workload). ``--repeats`` passes per configuration, each on its own cluster, are
pooled. TTFT is client-side: from sending the request to the first streamed chunk that carries
text. Prefill tokens computed = prompt tokens - cached tokens, summed over the requests.

    python benchmarks/prefix_cache.py                 # small model; writes BENCHMARKS.md
    python benchmarks/prefix_cache.py --size tiny --users 2 --turns 2 --system-tokens 200 \\
        --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from common import (
    REPO_ROOT,
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    text_table,
    update_benchmarks_md,
    wait_for_quiet_cpu,
    write_json,
)

from kvrelay.bench import percentile
from kvrelay.cluster.launcher import ClusterSpec, Launcher

if TYPE_CHECKING:
    from kvrelay.engine.tokenizer import Tokenizer

SECTION_TITLE = "Prefix cache: multi-turn chat with a shared system prompt"
SERVED_NAME = "bench"
CONFIGS = ("off", "L1", "L1+L2")
GOAL_SPEEDUP = 5.0  # TTFT p50 with the shared prefix cached vs tiers off
REQUEST_TIMEOUT_S = 600.0
WARM_UP = "Hi"
logger = logging.getLogger("prefix_cache_bench")


class BenchError(RuntimeError):
    """A request failed or the cluster did not reach the state a configuration needs."""


# ---------------------------------------------------------------------------- workload

_PREAMBLE = "You are the support assistant of a software company. Follow these rules."
_RULES = (
    "Answer the question that was asked, and say so plainly when you do not know.",
    "Keep every reply short: two or three sentences are usually enough.",
    "When the user shares code, read all of it before you suggest a change.",
    "Prefer the standard library over a new dependency unless the user asks otherwise.",
    "Explain the reason for a change before you show the change itself.",
    "Never invent the output of a command that you did not run.",
    "Quote numbers with their units and say where they were measured.",
    "If a request is ambiguous, state the reading you chose and continue.",
    "Point out a risk to the user's data before any step that could lose it.",
    "Use the user's own names for files, functions and variables.",
    "Write dates as year, month and day, and times with their time zone.",
    "Summarise long answers in one sentence at the end.",
)
_TOPICS = (
    "How do I read a large file line by line without loading it into memory?",
    "Why does my program get slower when I add more threads?",
    "What is the difference between a process and a thread?",
    "How should I name the columns of a table that stores orders?",
    "Can you explain what a cache hit rate tells me about my service?",
    "Which is faster for lookups, a list or a dictionary, and why?",
    "How do I measure the latency of a web request from the client?",
    "What does it mean when a test passes alone but fails in the suite?",
    "How do I keep two services from using the same port on one machine?",
    "Why would a query use an index on one day and not on the next?",
)


@dataclass(frozen=True, slots=True)
class Workload:
    system_prompt: str
    num_system_tokens: int  # of the system prompt's text alone, with the model's tokenizer
    questions: tuple[tuple[str, ...], ...]  # [user][turn]
    mean_question_tokens: float  # of a question's text alone
    num_output_tokens: int

    @property
    def num_users(self) -> int:
        return len(self.questions)

    @property
    def num_turns(self) -> int:
        return len(self.questions[0])


def system_words() -> Iterator[str]:
    """An endless, deterministic stream of the system prompt's words (numbered rules)."""
    yield from _PREAMBLE.split()
    number = 0
    while True:
        for rule in _RULES:
            number += 1
            yield from f"Rule {number}: {rule}".split()


def build_system_prompt(tokenizer: Tokenizer, num_tokens: int) -> str:
    """The shortest prefix of ``system_words`` with at least ``num_tokens`` tokens."""

    def length(words: Sequence[str]) -> int:
        return len(tokenizer.encode(" ".join(words), add_special_tokens=False))

    words: list[str] = []
    stream = system_words()
    while length(words) < num_tokens:
        words.extend(next(stream) for _ in range(16))
    low, high = 1, len(words)  # binary search: the fewest words reaching num_tokens
    while low < high:
        mid = (low + high) // 2
        if length(words[:mid]) >= num_tokens:
            high = mid
        else:
            low = mid + 1
    return " ".join(words[:low])


def question(user: int, turn: int) -> str:
    rng = random.Random(f"user{user}-turn{turn}")
    first, second = rng.sample(_TOPICS, 2)
    return f"I am user {user + 1}, turn {turn + 1}. {first} Also: {second}"


def create_workload(model_dir: Path, args: argparse.Namespace) -> Workload:
    from kvrelay.engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model_dir)
    text = build_system_prompt(tokenizer, args.system_tokens)
    questions = tuple(tuple(question(u, t) for t in range(args.turns)) for u in range(args.users))
    lengths = [len(tokenizer.encode(q, add_special_tokens=False)) for qs in questions for q in qs]
    return Workload(
        text,
        len(tokenizer.encode(text, add_special_tokens=False)),
        questions,
        sum(lengths) / len(lengths),
        args.output_tokens,
    )


# ---------------------------------------------------------------------------- client


@dataclass(frozen=True, slots=True)
class TurnResult:
    user: int
    turn: int
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    ttft_s: float
    e2e_s: float
    reply: str

    @property
    def num_computed_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_tokens


def chat_body(messages: Sequence[dict[str, str]], num_output_tokens: int) -> dict[str, Any]:
    return {
        "model": SERVED_NAME,
        "messages": list(messages),
        "max_tokens": num_output_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def stream_chat(
    client: httpx.Client, messages: Sequence[dict[str, str]], num_output_tokens: int
) -> tuple[str, float, float, dict[str, Any]]:
    """Streams one chat completion; returns the reply, TTFT and e2e seconds, and the usage.

    Raises:
        BenchError: an error status or event, or a stream without text, usage or ``[DONE]``.
    """
    start = time.perf_counter()
    ttft_s: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    body = chat_body(messages, num_output_tokens)
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise BenchError(f"HTTP {resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data == "[DONE]":
                if ttft_s is None or usage is None:
                    raise BenchError(f"stream ended without text or usage: {usage}")
                return "".join(parts), ttft_s, time.perf_counter() - start, usage
            if not data:
                continue
            event = json.loads(data)
            if "error" in event:
                raise BenchError(f"error event: {data[:500]}")
            for choice in event.get("choices") or ():
                text = (choice.get("delta") or {}).get("content") or ""
                if ttft_s is None and (text or choice.get("finish_reason")):
                    ttft_s = time.perf_counter() - start
                parts.append(text)
            usage = event.get("usage") or usage
    raise BenchError("stream ended without [DONE]")


def run_workload(url: str, workload: Workload) -> list[TurnResult]:
    """Every turn of every user, one request at a time, turn-major (see the module doc)."""
    histories = [
        [{"role": "system", "content": workload.system_prompt}] for _ in workload.questions
    ]
    results = []
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S)
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for turn in range(workload.num_turns):
            for user, history in enumerate(histories):
                history.append({"role": "user", "content": workload.questions[user][turn]})
                reply, ttft_s, e2e_s, usage = stream_chat(
                    client, history, workload.num_output_tokens
                )
                history.append({"role": "assistant", "content": reply})
                results.append(
                    TurnResult(
                        user,
                        turn,
                        int(usage["prompt_tokens"]),
                        int(usage["prompt_tokens_details"]["cached_tokens"]),
                        dict(usage.get("kvrelay_cached_tokens_by_tier") or {}),
                        ttft_s,
                        e2e_s,
                        reply,
                    )
                )
    return results


# ---------------------------------------------------------------------------- clusters


@contextlib.contextmanager
def running_cluster(
    model_dir: Path,
    args: argparse.Namespace,
    log_dir: Path,
    worker_args: Sequence[str] = (),
    cluster_id: str = "",
) -> Iterator[Launcher]:
    common = ("--threads", str(args.threads), "--num-blocks", str(args.num_blocks))
    spec = ClusterSpec(
        model=str(model_dir),
        num_prefill=1,
        num_decode=1,
        cluster_id=cluster_id,
        worker_args=(*common, *worker_args),
        router_args=("--served-model-name", SERVED_NAME),
        log_dir=str(log_dir),
    )
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=300)
        yield launcher
    finally:
        launcher.stop()


def measure(url: str, workload: Workload, args: argparse.Namespace) -> list[TurnResult]:
    """One measured pass, after a warm-up request and a wait for idle CPUs."""
    warm_up(url)
    wait_for_quiet_cpu(args.quiet_wait, threshold=0.1)
    return run_workload(url, workload)


def warm_up(url: str) -> None:
    """One short request (untimed), so that no measured request pays for a worker's first
    forward pass; without a system message, it shares no KV block with the workload."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        stream_chat(client, [{"role": "user", "content": WARM_UP}], 4)


def run_off(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    off = ("--no-prefix-caching", "--host-pool", "off")
    with running_cluster(model_dir, args, log_dir, off) as launcher:
        return measure(launcher.url, workload, args)


def run_l1(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    with running_cluster(model_dir, args, log_dir) as launcher:
        return measure(launcher.url, workload, args)


def run_l1_l2(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    """Warms A (and Redis), then measures on a cold B while A is drained."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.redis_server import RedisServer

    log_dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(log_dir, maxmemory=args.redis_memory)
    server.start()
    cluster_id = f"pc{os.getpid()}-{uuid.uuid4().hex[:6]}"  # both pools swept at stop
    host_a = ("--redis-url", server.url, "--host-pool", f"kvrelay-{cluster_id}-hostA")
    try:
        with running_cluster(model_dir, args, log_dir, host_a, cluster_id) as launcher:
            [warm] = [n for n, p in launcher.procs.items() if p.role == "prefill"]
            run_workload(launcher.url, workload)
            wait_for_write_behind(launcher.url, server)
            cold = launcher.add_worker("prefill", ["--host-pool", f"kvrelay-{cluster_id}-hostB"])
            launcher.wait_ready(timeout=300, names=[cold])
            drain(launcher.url, warm)
            before = device_queries(launcher.url)
            results = measure(launcher.url, workload, args)
            check_served_by(cold, warm, before, device_queries(launcher.url))
            return results
    finally:
        server.stop()


def redis_queue_depths(url: str) -> list[int]:
    resp = httpx.get(url + "/admin/cache/stats", timeout=10.0)
    resp.raise_for_status()
    return [
        int(inst["tiers"]["redis"].get("queue_depth", 0))
        for inst in resp.json()["instances"].values()
        if "redis" in inst["tiers"]
    ]


def wait_for_write_behind(url: str, server: Any, timeout_s: float = 120.0) -> int:
    """Waits until every worker's Redis queue is empty and the key count stops changing."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        depths = redis_queue_depths(url)
        with server.client() as client:
            num_keys = int(client.dbsize())
        if depths and not any(depths) and num_keys == last and num_keys > 0:
            return num_keys
        last = num_keys
        time.sleep(0.5)
    raise BenchError(f"Redis write-behind did not finish in {timeout_s:.0f}s")


def drain(url: str, instance_id: str) -> None:
    resp = httpx.post(f"{url}/admin/instances/{instance_id}/drain", timeout=10.0)
    if resp.status_code != 200:
        raise BenchError(f"drain {instance_id}: HTTP {resp.status_code}: {resp.text[:300]}")


def device_queries(url: str) -> dict[str, int]:
    """Prompt tokens each instance has looked up in its device cache so far."""
    resp = httpx.get(url + "/admin/cache/stats", timeout=10.0)
    resp.raise_for_status()
    instances = resp.json()["instances"].items()
    return {i: int(s["tiers"].get("device", {}).get("query_tokens", 0)) for i, s in instances}


def check_served_by(cold: str, warm: str, before: dict[str, int], after: dict[str, int]) -> None:
    """Raises unless the measured pass was prefilled by the cold instance alone."""
    if after.get(warm) != before.get(warm) or not after.get(cold, 0) > before.get(cold, 0):
        raise BenchError(f"the pass was not served by {cold} alone: {before} -> {after}")


RUNNERS = {"off": run_off, "L1": run_l1, "L1+L2": run_l1_l2}


# ---------------------------------------------------------------------------- summary


@dataclass(frozen=True, slots=True)
class Summary:
    config: str
    num_requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_p50_after_first_ms: float  # the first request of each pass left out
    first_ttft_ms: float  # median over passes of the first request's TTFT
    num_prompt_tokens: int
    num_computed_tokens: int
    cached_tokens_by_tier: dict[str, int]


def summarize(config: str, passes: Sequence[list[TurnResult]]) -> Summary:
    ttfts = [r.ttft_s * 1e3 for p in passes for r in p]
    later = [r.ttft_s * 1e3 for p in passes for r in p[1:]] or ttfts
    by_tier: dict[str, int] = {}
    for result in (r for p in passes for r in p):
        for tier, count in result.cached_tokens_by_tier.items():
            by_tier[tier] = by_tier.get(tier, 0) + count
    return Summary(
        config,
        len(ttfts),
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(later, 50),
        percentile([p[0].ttft_s * 1e3 for p in passes], 50),
        sum(r.num_prompt_tokens for p in passes for r in p),
        sum(r.num_computed_tokens for p in passes for r in p),
        {tier: count for tier, count in by_tier.items() if count},
    )


def speedup(base: Summary | None, summary: Summary, field: str) -> float | None:
    if base is None:
        return None
    return float(getattr(base, field)) / max(1e-9, float(getattr(summary, field)))


HEADERS = (
    "config", "requests", "TTFT p50 (ms)", "p50 after first (ms)", "TTFT p99 (ms)",
    "first request (ms)", "prompt tokens", "prefill tokens computed", "cached tokens by tier",
    "p50 vs off", "p50 after first vs off", f">= {GOAL_SPEEDUP:g}x",
)  # fmt: skip


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}x"


def table_rows(summaries: Sequence[Summary]) -> list[list[Any]]:
    base = next((s for s in summaries if s.config == "off"), None)
    rows = []
    for s in summaries:
        ratio = speedup(base, s, "ttft_p50_ms")
        later = speedup(base, s, "ttft_p50_after_first_ms")
        tiers = ", ".join(f"{t} {n:,}" for t, n in sorted(s.cached_tokens_by_tier.items()))
        goal = (
            "-"
            if s.config == "off" or ratio is None
            else ("met" if ratio >= GOAL_SPEEDUP else "MISSED")
        )
        rows.append(
            [
                s.config, s.num_requests, f"{s.ttft_p50_ms:,.0f}",
                f"{s.ttft_p50_after_first_ms:,.0f}", f"{s.ttft_p99_ms:,.0f}",
                f"{s.first_ttft_ms:,.0f}", f"{s.num_prompt_tokens:,}",
                f"{s.num_computed_tokens:,}", tiers or "none",
                _times(ratio), _times(later), goal,
            ]
        )  # fmt: skip
    return rows


def verdict_lines(summaries: Sequence[Summary]) -> list[str]:
    base = next((s for s in summaries if s.config == "off"), None)
    if base is None:
        return []
    lines = []
    for s in summaries:
        ratio = base.ttft_p50_ms / max(1e-9, s.ttft_p50_ms)
        if s is base:
            continue
        cached = s.num_prompt_tokens - s.num_computed_tokens
        lines.append(
            f"{s.config}: TTFT p50 {s.ttft_p50_ms:,.0f} ms vs {base.ttft_p50_ms:,.0f} ms with "
            f"tiers off, {ratio:.1f}x lower (goal {GOAL_SPEEDUP:g}x: "
            f"{'met' if ratio >= GOAL_SPEEDUP else 'MISSED'}); after the first request "
            f"{_times(speedup(base, s, 'ttft_p50_after_first_ms'))}. "
            f"{cached:,} of {s.num_prompt_tokens:,} prompt tokens "
            f"({100 * cached / max(1, s.num_prompt_tokens):.0f}%) came from a cache."
        )
    return lines


def tier_notes(summaries: Sequence[Summary]) -> list[str]:
    """Where the hits came from, in numbers (the part a per-config p50 hides)."""
    by_name = {s.config: s for s in summaries}
    notes = []
    l1 = by_name.get("L1")
    if l1 is not None:
        notes.append(l1_note(l1.cached_tokens_by_tier))
    l2 = by_name.get("L1+L2")
    if l2 is not None:
        tiers = l2.cached_tokens_by_tier
        compare = (
            "" if l1 is None else f" (the L1 row's, which computes it: {l1.first_ttft_ms:,.0f} ms)"
        )
        notes.append(
            f"L1+L2 (cold instance B): {tiers.get('redis', 0):,} cached tokens came from Redis, "
            f"{tiers.get('host', 0):,} from B's host pool and {tiers.get('device', 0):,} from "
            "B's device cache. Every measured prompt had been served by A before (greedy "
            "replies repeat), so each request finds its new blocks (the previous reply and its "
            "question) in Redis and its older blocks in B's device cache: this row beats L1 "
            "because nothing but each prompt's last partial block is left to compute, not "
            "because Redis is faster than the device cache. What isolates L2 is B's first "
            f"request, which reads the shared system prompt from Redis: {l2.first_ttft_ms:,.0f} "
            f"ms{compare}."
        )
    return notes


def l1_note(tiers: dict[str, int]) -> str:
    text = (
        f"L1: {tiers.get('device', 0):,} cached tokens came from the prefill worker's own "
        f"device cache and {tiers.get('host', 0):,} from the host pool. With one prefill "
        "instance whose device pool holds the whole workload, every prefix it computed is "
        "still on its device, so this row measures device-level prefix caching"
    )
    if not tiers.get("host"):
        return text + "; the host pool is written (write-through) but never needed here."
    return text + (
        "; the host pool adds blocks the decode worker wrote to it (where a prompt ends and "
        "its reply begins: tokens the prefill worker never computed)."
    )


INTERPRETATION = (
    "What a hit leaves: the router still applies the chat template to the whole history and "
    "tokenizes it, and the prefill worker still computes every token after the last full "
    "16-token block it found (with L1, the previous reply and the new question; at least the "
    "prompt's last token) before it samples the first token, so a cached TTFT is that tail "
    "plus a fixed per-request cost, not zero. Tiers off pays for every prompt token on every "
    "turn, and the prompt grows with each turn, so the ratio grows with the shared prefix and "
    "the history. Each configuration ran on a fresh cluster, on CPU, on a machine shared with "
    "other jobs (load below), which inflates both sides of a ratio and makes single requests "
    "noisy: read the p99 column (near the slowest request at this sample size) with that in "
    "mind."
)


def describe(args: argparse.Namespace, workload: Workload, model: str) -> str:
    return (
        f"Model: {model}, float32; 1 prefill + 1 decode worker, `--threads {args.threads}` "
        f"and `--num-blocks {args.num_blocks}` each; KV handed off over shm. Workload: one "
        f"system prompt of {workload.num_system_tokens:,} tokens (the model's tokenizer, text "
        f"alone) shared by {workload.num_users} users x {workload.num_turns} turns; each turn "
        "sends the user's whole history (system prompt, earlier questions, the replies the "
        f"server gave) plus a new question ({workload.mean_question_tokens:.0f} tokens on "
        f"average) and asks for {workload.num_output_tokens} "
        "tokens (greedy, eos ignored). Requests go one at a time (concurrency 1), turn-major: "
        "turn 1 of every user, then turn 2 of every user, and so on. TTFT: client-side, from "
        "sending the streaming request to the first chunk with text; p50 and p99 over every "
        f"request of {args.repeats} pass(es) (linear interpolation), 'after first' leaves out "
        "each pass's first request (the one that computes the shared prefix everywhere but in "
        "L1+L2). 'p50 vs off' = the off row's p50 / this row's p50; the goal (>= "
        f"{GOAL_SPEEDUP:g}x) is judged on the p50 over all requests, the first included. "
        "Prefill tokens computed = prompt tokens - cached tokens (usage "
        "`prompt_tokens_details.cached_tokens`), summed; cached tokens by tier: "
        "`kvrelay_cached_tokens_by_tier`, summed. Configurations, each on a fresh cluster: "
        "**off** = `--no-prefix-caching --host-pool off`; **L1** = prefix caching and the L1 "
        "host shared-memory pool (the defaults); **L1+L2** = also `--redis-url` (a local "
        "`redis-server`): the workload runs once, unmeasured, on prefill A (device cache, host "
        "A's L1 and Redis filled), then, once Redis's write-behind queue is empty, prefill B "
        "joins with another `--host-pool` (another host: cold device cache, cold L1), A is "
        "drained, and the same workload runs again, measured, all of it on B."
    )


def markdown_body(
    args: argparse.Namespace,
    workload: Workload,
    model: str,
    summaries: Sequence[Summary],
    info: dict[str, Any],
    load: tuple[float, float],
) -> str:
    parts = [
        describe(args, workload, model),
        markdown_table(HEADERS, table_rows(summaries)),
        "\n".join(f"- {line}" for line in verdict_lines(summaries)),
        "\n".join(f"- {line}" for line in tier_notes(summaries)),
        INTERPRETATION,
        f"1-min load average at start / end: {load[0]:.1f} / {load[1]:.1f} "
        f"({os.cpu_count()} CPUs; other jobs shared the machine when this is above ~2).",
        machine_markdown(info),
    ]
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="checkpoint; default: make one (make_tiny)")
    p.add_argument("--size", default="small", help="make_tiny size when no --model-dir")
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1500, help="shared system prompt")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="passes per configuration, pooled")
    p.add_argument(
        "--configs",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=list(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)}",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--redis-memory", default="1gb", help="redis-server --maxmemory")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="max s to wait for idle CPUs")
    p.add_argument("--log-dir", default=None, help="cluster logs (default: a temporary dir)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    counts = (args.users, args.turns, args.system_tokens, args.output_tokens, args.repeats)
    if min(counts) < 1 or args.threads < 1:
        p.error("--users, --turns, --system-tokens, --output-tokens, --repeats, --threads >= 1")
    return args


def run_all(args: argparse.Namespace, model_dir: Path, model: str) -> int:
    workload = create_workload(model_dir, args)
    print(
        f"system prompt: {workload.num_system_tokens} tokens; {workload.num_users} users x "
        f"{workload.num_turns} turns; {args.repeats} pass(es) per configuration",
        flush=True,
    )
    load_start = os.getloadavg()[0]
    passes: dict[str, list[list[TurnResult]]] = {c: [] for c in args.configs}
    for repeat in range(args.repeats):
        for config in args.configs:
            log_dir = Path(args.log_dir) / f"{config.replace('+', '-')}-{repeat}"
            results = RUNNERS[config](model_dir, workload, args, log_dir)
            passes[config].append(results)
            ttft = percentile([r.ttft_s * 1e3 for r in results], 50)
            print(f"{config} pass {repeat + 1}: TTFT p50 {ttft:,.0f} ms", flush=True)
    load = (load_start, os.getloadavg()[0])
    summaries = [summarize(c, passes[c]) for c in args.configs]
    print()
    print(text_table(HEADERS, table_rows(summaries)))
    print()
    for line in [*verdict_lines(summaries), *tier_notes(summaries)]:
        print(line)
    info = machine_info(args.threads)
    if args.json:
        write_json(
            args.json,
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "workload": asdict(workload),
                "machine": info,
                "load_average": load,
                "summaries": [asdict(s) for s in summaries],
                "passes": {c: [[asdict(r) for r in p] for p in ps] for c, ps in passes.items()},
            },
        )
    if not args.no_write:
        body = markdown_body(args, workload, model, summaries, info, load)
        path = update_benchmarks_md(SECTION_TITLE, body, command_line())
        print(f"\nwrote section {SECTION_TITLE!r} of {path}")
    return 0 if l2_was_read(summaries) else 1


def l2_was_read(summaries: Sequence[Summary]) -> bool:
    """False (and an error logged) when L1+L2 ran but no hit came from Redis."""
    for s in summaries:
        if s.config == "L1+L2" and not s.cached_tokens_by_tier.get("redis"):
            logger.error("L1+L2: the cold instance read nothing from Redis: %s", s)
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. under nohup) unwinds like Ctrl-C, so every started cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvrelay-prefix-bench-") as tmp:
        if args.log_dir is None:
            args.log_dir = str(Path(tmp) / "logs")
        if args.model_dir is not None:
            return run_all(args, args.model_dir, f"`{args.model_dir.name}`")
        from kvrelay.engine.make_tiny import make_tiny

        model_dir = make_tiny(Path(tmp) / args.size, arch="llama", size=args.size)
        return run_all(args, model_dir, f"make_tiny `{args.size}` llama")


if __name__ == "__main__":
    sys.exit(main())
