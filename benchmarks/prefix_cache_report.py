"""Prefix cache benchmark, report: the per-configuration summary of the passes, its table,
the verdicts against the TTFT goal, the notes per tier and the BENCHMARKS.md section."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common import machine_markdown, markdown_table
from prefix_cache_workload import TurnResult, Workload

from kvrelay.bench import percentile

GOAL_SPEEDUP = 5.0  # TTFT p50 with the shared prefix cached vs tiers off


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
        f"Model: {model}, {args.dtype}; 1 prefill + 1 decode worker, `--threads {args.threads}` "
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
