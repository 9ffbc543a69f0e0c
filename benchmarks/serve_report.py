"""Serving benchmark, report: medians over repeats, the comparison table, the verdicts and
the conclusion, and the BENCHMARKS.md section (from a run or a saved ``--json``)."""

from __future__ import annotations

import math
from typing import Any

from common import machine_markdown, markdown_table, median, text_table, update_benchmarks_md
from serve_runs import DEAD_AFTER_S, Run

from kvrelay.bench import Slo, Summary

SECTION_TITLE = "Serving: 1P+1D vs colocated (Poisson load)"
Groups = dict[tuple[float, str], dict[str, float]]  # (rate, system) -> medians


# ---------------------------------------------------------------------------- report

METRICS = (
    "ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99",
    "request_throughput", "output_throughput", "goodput", "slo_attainment",
)  # fmt: skip


def metrics(summary: Summary) -> dict[str, float]:
    out = {
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "goodput": summary.goodput,
        "slo_attainment": summary.slo_attainment,
    }
    for name, stats in (("ttft", summary.ttft_ms), ("tpot", summary.tpot_ms)):
        for q in ("p50", "p90", "p99"):
            out[f"{name}_{q}"] = getattr(stats, q) if stats is not None else math.nan
    return out


def medians(runs: list[Run]) -> dict[str, float]:
    """Median over repeats of every metric, plus failures summed and CPU shares' medians."""
    out = {m: median([metrics(r.summary)[m] for r in runs]) for m in METRICS}
    out["num_completed"] = sum(r.summary.num_completed for r in runs)
    out["num_failed"] = sum(r.summary.num_failed for r in runs)
    out["outside_cpu"] = max(r.outside_cpu for r in runs)
    for name in runs[0].cpu_busy:
        out[f"cpu_{name}"] = median([r.cpu_busy[name] for r in runs])
    return out


def grouped(runs: list[Run]) -> dict[tuple[float, str], list[Run]]:
    groups: dict[tuple[float, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.rate, run.system), []).append(run)
    return groups


HEADERS = (
    "rate (req/s)", "system", "done / failed", "TTFT p50 / p90 / p99 (ms)",
    "TPOT p50 / p90 / p99 (ms)", "req/s", "output tok/s", "goodput (req/s)", "SLO met",
    "CPU busy (% of a core)", "outside CPU",
)  # fmt: skip


def _triple(m: dict[str, float], name: str) -> str:
    return " / ".join(f"{m[f'{name}_{q}']:,.0f}" for q in ("p50", "p90", "p99"))


def _cpu_cell(m: dict[str, float]) -> str:
    shares = {k[4:]: v for k, v in m.items() if k.startswith("cpu_")}
    return ", ".join(f"{name} {100 * v:.0f}" for name, v in shares.items())


def table_rows(groups: Groups) -> list[list[str]]:
    rows = []
    for (rate, system), m in groups.items():
        rows.append(
            [
                f"{rate:g}",
                system,
                f"{m['num_completed']:.0f} / {m['num_failed']:.0f}",
                _triple(m, "ttft"),
                _triple(m, "tpot"),
                f"{m['request_throughput']:.3f}",
                f"{m['output_throughput']:.1f}",
                f"{m['goodput']:.3f}",
                f"{100 * m['slo_attainment']:.0f}%",
                _cpu_cell(m),
                f"{100 * m['outside_cpu']:.0f}%",
            ]
        )
    return rows


def _change(new: float, old: float) -> str:
    if not old or math.isnan(new) or math.isnan(old):
        return "n/a"
    return f"{100 * (new - old) / old:+.0f}%"


def verdict_lines(groups: Groups, rates: list[float]) -> list[str]:
    """Per rate: 1P+1D's TPOT, TTFT and goodput relative to colocated, in numbers."""
    lines = []
    for rate in rates:
        co, pd = groups.get((rate, "colocated")), groups.get((rate, "1P+1D"))
        if co is None or pd is None:
            continue
        lines.append(
            f"At {rate:g} req/s, 1P+1D's TPOT is p50 {pd['tpot_p50']:,.0f} ms vs "
            f"{co['tpot_p50']:,.0f} ms colocated ({_change(pd['tpot_p50'], co['tpot_p50'])}), "
            f"p99 {pd['tpot_p99']:,.0f} vs {co['tpot_p99']:,.0f} ms "
            f"({_change(pd['tpot_p99'], co['tpot_p99'])}); TTFT p50 "
            f"{_change(pd['ttft_p50'], co['ttft_p50'])}, p99 "
            f"{_change(pd['ttft_p99'], co['ttft_p99'])}; goodput {pd['goodput']:.3f} vs "
            f"{co['goodput']:.3f} req/s."
        )
        half = groups.get((rate, "colocated-half"))
        if half is not None:
            lines.append(
                f"At {rate:g} req/s, the control colocated-half has TPOT p50 "
                f"{half['tpot_p50']:,.0f} ms, p99 {half['tpot_p99']:,.0f} ms; TTFT p50 "
                f"{half['ttft_p50']:,.0f} ms; goodput {half['goodput']:.3f} req/s."
            )
    return lines


def describe(setup: dict[str, Any], rates: list[float], slo: Slo) -> str:
    threads = setup["threads"]
    control = (
        f"; colocated-half (a control) = 1 worker with {threads} thread(s)"
        if "colocated-half" in setup["systems"]
        else ""
    )
    prompt, output = setup["prompt_len"], setup["output_len"]
    retry = ""
    if setup.get("attempts", 1) > 1:
        retry = (
            f" A run during which they took more than {100 * setup['max_outside_cpu']:.0f}% "
            f"was measured again (at most {setup['attempts']} times); the least disturbed counts."
        )
    return (
        f"Model: {setup['model']}, {setup.get('dtype', 'float32')}. Workload: "
        f"{setup['num_requests']} requests per run, "
        f"Poisson arrivals at {' and '.join(f'{r:g}' for r in rates)} req/s, random-token "
        f"prompts of {prompt[0]}-{prompt[1]} tokens, outputs of {output[0]}-{output[1]} tokens "
        f"(uniform; greedy, eos ignored; seed {setup['seed']} + repeat, the same requests for "
        f"every system). Median of {setup['repeats']} run(s) per cell, each on a freshly "
        "started cluster after 2 warm-up requests. Systems: colocated = 1 worker with "
        f"{2 * threads} torch threads, the cores of both disaggregated workers (the fair pair); "
        f"1P+1D = 1 prefill + 1 decode worker with {threads} thread(s) each, KV over shm"
        f"{control}; all with `--max-num-batched-tokens {setup['max_num_batched_tokens']}` "
        f"(chunked prefill) and `--num-blocks {setup['num_blocks']}`, the router's "
        f"`--dead-after {DEAD_AFTER_S:g}`. The router and the load generator share the same "
        "cores in every system. Goodput counts the requests with TTFT <= "
        f"{slo.ttft_ms:g} ms and TPOT <= {slo.tpot_ms:g} ms per second; SLO met is their share "
        "of all requests. TPOT = (e2e - TTFT) / (output tokens - 1). CPU busy: CPU-seconds "
        "each process used over the run's wall time; outside CPU: the largest share of all "
        "CPUs that processes outside the run took during one." + retry
    )


def conclusion(groups: Groups, rates: list[float]) -> str:
    """The answer in numbers at the high rate, what the control and the CPU shares show,
    which rows other processes disturbed, and why."""
    high = max(rates)
    co, pd = groups.get((high, "colocated")), groups.get((high, "1P+1D"))
    if co is None or pd is None:
        return ""
    parts = [
        f"**Does disaggregation lower TPOT here?** At the high rate ({high:g} req/s): "
        f"{_yes_no(pd, co, 'tpot_p99')} at p99, {_yes_no(pd, co, 'tpot_p50')} at p50; "
        f"TTFT p50 {_change(pd['ttft_p50'], co['ttft_p50'])}; goodput {pd['goodput']:.3f} vs "
        f"{co['goodput']:.3f} req/s."
    ]
    half = groups.get((high, "colocated-half"))
    if half is not None:
        parts.append(
            f"The control separates threads from interference: with 1 thread instead of 2 the "
            f"colocated worker's TPOT p50 is {half['tpot_p50']:,.0f} ms instead of "
            f"{co['tpot_p50']:,.0f} ms; 1P+1D against that 1-thread worker (the same threads "
            f"per engine, no interference, one more core): TPOT p50 "
            f"{_change(pd['tpot_p50'], half['tpot_p50'])}, p99 "
            f"{_change(pd['tpot_p99'], half['tpot_p99'])}."
        )
    decode, prefill = pd.get("cpu_decode-0"), pd.get("cpu_prefill-0")
    if decode is not None and prefill is not None:
        busy = (
            f"In 1P+1D the decode worker was busy {100 * decode:.0f}% of a core and the "
            f"prefill worker {100 * prefill:.0f}%"
        )
        if decode > 0.8 and decode > 2 * prefill:
            busy += (
                ": with these lengths decoding is most of the work, so the decode worker is "
                "the bottleneck and a 1:1 split of the cores leaves the prefill core mostly idle"
            )
        parts.append(busy + ".")
    for rate in rates:
        outside = max(m["outside_cpu"] for (r, _), m in groups.items() if r == rate)
        if outside > 0.2:
            parts.append(
                f"At {rate:g} req/s other processes on this shared machine took up to "
                f"{100 * outside:.0f}% of the CPUs during a run (outside CPU column): those "
                "rows measure that contention as much as the systems."
            )
    return " ".join([*parts, INTERPRETATION])


def _yes_no(new: dict[str, float], old: dict[str, float], key: str) -> str:
    return f"{'yes' if new[key] < old[key] else 'no'} ({_change(new[key], old[key])})"


INTERPRETATION = (
    "Why, on 2 cores: the colocated worker runs each prompt chunk (up to the batched-token "
    "budget) in the same step as the running decodes, so a decode step that meets an arriving "
    "prompt lasts as long as that prefill; that is the interference DistServe describes, and "
    "it grows with the rate. The 1P+1D decode worker never waits for a prefill, and the KV "
    "hand-off over shm is small next to a step. What 1P+1D gives up is parallelism: each phase "
    "runs on 1 thread, where the colocated worker can put 2 on whichever phase is running. "
    "That parallelism only pays when 2 cores are really free for it: torch's OpenMP threads "
    "wait for each other at the end of every operator, so when a third busy thread (the "
    "router, the load generator, another process) takes one of the 2 cores, the 2-thread "
    "worker runs at the pace of its descheduled thread, while 1-thread workers just share "
    "the cores."
)


def markdown_body(data: dict[str, Any]) -> str:
    rates, slo, groups = data["rates"], Slo(**data["slo"]), groups_of(data)
    parts = [
        describe(data["setup"], rates, slo),
        markdown_table(HEADERS, table_rows(groups)),
        "\n".join(f"- {line}" for line in verdict_lines(groups, rates)),
        conclusion(groups, rates),
        machine_markdown(data["machine"]),
    ]
    return "\n\n".join(p for p in parts if p)


def groups_of(data: dict[str, Any]) -> Groups:
    return {
        (m["rate"], m["system"]): {k: v for k, v in m.items() if k not in ("rate", "system")}
        for m in data["medians"]
    }


def report(data: dict[str, Any], write_md: bool) -> None:
    """Prints the comparison of a result (from this run or a saved JSON); writes the section."""
    groups = groups_of(data)
    print()
    print(text_table(HEADERS, table_rows(groups)))
    print()
    for line in [*verdict_lines(groups, data["rates"]), conclusion(groups, data["rates"])]:
        print(line)
    if write_md:
        title = data["setup"].get("title", SECTION_TITLE)
        path = update_benchmarks_md(title, markdown_body(data), data["command"])
        print(f"\nwrote section {title!r} of {path}")
