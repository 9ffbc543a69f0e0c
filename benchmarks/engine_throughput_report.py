"""Engine throughput benchmark, report: the results table, the verdicts on both goals, the
decode step against its memory bound, and the BENCHMARKS.md section."""

from __future__ import annotations

import argparse
from typing import Any

from common import fmt, machine_markdown, markdown_table, median, model_label, text_table
from engine_throughput_systems import (
    CB_NAME,
    DECODE_OUTPUT_LEN,
    DECODE_PROMPT_LEN,
    DECODE_RUNS,
    STATIC_NAME,
)
from engine_throughput_workload import DecodeBound, SystemResult, Workload

GOAL_VS_STATIC = 2.0

# ---------------------------------------------------------------------------- report

RESULT_HEADERS = (
    "system",
    "output tok/s",
    "time (s)",
    "useful / generated tokens",
    "kvrelay ÷ system",
    "note",
)
DECODE_HEADERS = (
    "decode step (ms)",
    "weights read (MB)",
    "copy bandwidth (GB/s)",
    "bound (ms)",
    "step ÷ bound",
)


def result_rows(results: list[SystemResult], max_others_cpu: float) -> list[list[str]]:
    ours = results[0].tokens_per_s
    rows = []
    for r in results:
        rate = r.tokens_per_s
        if rate is None:
            rows.append([r.name, "-", "-", "-", "-", r.error or ""])
            continue
        note = r.note
        if max(r.others_cpu, default=0.0) > max_others_cpu:
            note += f"; other processes took {max(r.others_cpu):.0%} of the CPUs"
        ratio = f"{ours / rate:.2f}x" if ours else "-"
        tokens = f"{r.useful_tokens:,} / {r.computed_tokens:,}"
        rows.append([r.name, fmt(rate), f"{median(r.seconds):.1f}", tokens, ratio, note])
    return rows


def goal_lines(results: list[SystemResult]) -> list[str]:
    ours = results[0].tokens_per_s
    static = [r.tokens_per_s for r in results if r.name.startswith(STATIC_NAME) and r.tokens_per_s]
    cb = next((r for r in results if r.name == CB_NAME), None)
    lines = []
    if ours and static:
        ratio = ours / max(static)
        verdict = "met" if ratio >= GOAL_VS_STATIC else "NOT met"
        lines.append(
            f"Goal 1, at least {GOAL_VS_STATIC:.0f}x the best static batch: {ratio:.2f}x "
            f"({fmt(ours)} vs {fmt(max(static))} tok/s) - {verdict}."
        )
    if ours and cb is not None:
        if cb.tokens_per_s:
            ratio = ours / cb.tokens_per_s
            verdict = "met" if ratio > 1 else "NOT met"
            lines.append(
                f"Goal 2, ahead of transformers continuous batching: {ratio:.2f}x "
                f"({fmt(ours)} vs {fmt(cb.tokens_per_s)} tok/s) - {verdict}."
            )
        else:
            lines.append(f"Goal 2, ahead of transformers continuous batching: {cb.error}.")
    return lines


def decode_rows(bound: DecodeBound, max_others_cpu: float) -> list[list[str]]:
    row = [
        f"{bound.step_s * 1e3:.2f}",
        f"{bound.weight_bytes / 1e6:.1f}",
        f"{bound.bandwidth / 1e9:.2f}",
        f"{bound.bound_s * 1e3:.2f}",
        f"{bound.step_s / bound.bound_s:.2f}x",
    ]
    if bound.others_cpu > max_others_cpu:
        row[-1] += f" (other processes took {bound.others_cpu:.0%} of the CPUs)"
    return [row]


def describe(args: argparse.Namespace, workload: Workload, params: int) -> str:
    model = model_label(args.model_dir, args.size)
    return (
        f"Model: {model} ({params / 1e6:.1f}M parameters), {args.dtype}, {args.threads} "
        "threads. "
        f"{workload.num_requests} requests, prompt lengths {workload.prompt_lens[0]}-"
        f"{workload.prompt_lens[1]}, output lengths {workload.output_lens[0]}-"
        f"{workload.output_lens[1]} (uniform, seed {workload.seed}); greedy with eos ignored, so "
        "each request gets exactly its output length in every system, and only those tokens "
        "count (a static batch runs to its longest output; the rest is computed, not counted). "
        f"Median of {args.repeats} timed run(s) per system after a warm-up, each on a quiet "
        "machine (a run is repeated while other processes take over "
        f"{args.max_others_cpu:.0%} of the CPUs)."
    )


def decode_text(bound: DecodeBound) -> str:
    return (
        f"Decode step at batch 1 (kvrelay; prompt {DECODE_PROMPT_LEN} tokens, "
        f"{DECODE_OUTPUT_LEN} output tokens, time per token after the first, median of "
        f"{DECODE_RUNS}) against its memory bound: weight bytes read per step (all weights but "
        "an untied embedding table) / copy bandwidth (`dst.copy_(src)` of 512 MB float32, "
        "bytes read + written, median of 7)."
    )


def markdown_body(
    args: argparse.Namespace,
    workload: Workload,
    params: int,
    results: list[SystemResult],
    bound: DecodeBound | None,
    info: dict[str, Any],
) -> str:
    rows = result_rows(results, args.max_others_cpu)
    parts = [describe(args, workload, params), markdown_table(RESULT_HEADERS, rows)]
    parts.append("\n".join(f"- {line}" for line in goal_lines(results)))
    if bound is not None:
        parts += [
            decode_text(bound),
            markdown_table(DECODE_HEADERS, decode_rows(bound, args.max_others_cpu)),
        ]
    parts.append(machine_markdown(info))
    return "\n\n".join(p for p in parts if p)


def print_report(
    results: list[SystemResult], bound: DecodeBound | None, max_others_cpu: float
) -> None:
    print()
    print(text_table(RESULT_HEADERS, result_rows(results, max_others_cpu)))
    print()
    for line in goal_lines(results):
        print(line)
    if bound is not None:
        print()
        print(text_table(DECODE_HEADERS, decode_rows(bound, max_others_cpu)))
