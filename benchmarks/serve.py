"""Online serving on CPU: 1P+1D against one colocated worker, under Poisson load.

DistServe's claim: a colocated engine batches new prompts' prefill with running requests'
decode steps, so every arrival stretches the decode steps in flight (prefill-decode
interference, seen in TPOT); a separate decode worker never waits for a prefill. This script
checks whether that holds on this machine's cores.

Systems, each started fresh (router + workers as ``kvrelay serve`` processes) for every run:

- colocated: one worker that prefills and decodes, ``2 x --threads`` torch threads;
- 1P+1D: a prefill and a decode worker, ``--threads`` each, KV handed off over shm;
- colocated-half (a control, with ``--systems``): one worker with ``--threads`` threads.

So colocated and 1P+1D use the same cores (2 by default); the router and this load
generator run beside them on those cores in every system. Each run: start, two warm-up
requests, wait (up to ``--quiet-wait`` s) for other processes to go quiet, ``--num-requests``
Poisson arrivals at the rate (``kvrelay.bench``; the same seeded prompts, lengths and arrival
times in every system), stop. Systems alternate inside each rate and repeat, so slow drift
hits all alike; reported numbers are medians over ``--repeats``. With ``--json``, the results
are written after every run, so an interrupted run keeps what it measured.

    python benchmarks/serve.py                           # small model, writes BENCHMARKS.md
    python benchmarks/serve.py --size tiny --num-requests 8 --no-write
    python benchmarks/serve.py --render out.json          # report a saved --json again
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from common import (
    command_line,
    cpu_times,
    machine_info,
    machine_markdown,
    markdown_table,
    median,
    text_table,
    update_benchmarks_md,
    wait_for_quiet_cpu,
    write_json,
)

from kvrelay.bench import LoadConfig, Slo, Summary, check_server, run_bench, warm_up
from kvrelay.cluster.launcher import ClusterSpec, Launcher

SECTION_TITLE = "Serving: 1P+1D vs colocated (Poisson load)"
SERVED_NAME = "bench"
DEAD_AFTER_S = 120.0  # router heartbeat timeout: a worker reports only between steps
DEFAULT_SYSTEMS = ("colocated", "1P+1D")
Groups = dict[tuple[float, str], dict[str, float]]  # (rate, system) -> medians


@dataclass(frozen=True, slots=True)
class System:
    name: str
    num_prefill: int
    num_decode: int
    num_colocated: int
    threads: int  # torch threads per worker


@dataclass(frozen=True, slots=True)
class Run:
    system: str
    rate: float
    repeat: int
    summary: Summary
    cpu_busy: dict[str, float]  # cluster process -> share of one core it used, 0..1+
    outside_cpu: float  # share of all CPUs used by processes outside this run, 0..1


def create_systems(threads: int, names: Sequence[str] = DEFAULT_SYSTEMS) -> list[System]:
    """The systems named, in order: ``colocated`` gets the cores of both disaggregated workers;
    ``colocated-half`` (a control) gets only one worker's."""
    known = {
        "colocated": System("colocated", 0, 0, 1, 2 * threads),
        "1P+1D": System("1P+1D", 1, 1, 0, threads),
        "colocated-half": System("colocated-half", 0, 0, 1, threads),
    }
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown system(s) {unknown}; choose from {', '.join(known)}")
    return [known[n] for n in names]


# ---------------------------------------------------------------------------- one run


def process_cpu_s(pid: int) -> float:
    """CPU-seconds (user + system, all threads) process ``pid`` has used; 0 once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_cluster(
    system: System, model_dir: Path, args: argparse.Namespace, log_dir: Path
) -> Launcher:
    worker_args = [
        "--threads", str(system.threads),
        "--num-blocks", str(args.num_blocks),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    spec = ClusterSpec(
        model=str(model_dir),
        num_prefill=system.num_prefill,
        num_decode=system.num_decode,
        num_colocated=system.num_colocated,
        transport="auto",
        worker_args=tuple(worker_args),
        router_args=("--served-model-name", SERVED_NAME, "--dead-after", str(DEAD_AFTER_S)),
        log_dir=str(log_dir),
    )
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=300)
    except BaseException:
        launcher.stop()
        raise
    return launcher


def measure(
    system: System, config: LoadConfig, slo: Slo, model_dir: Path, args: argparse.Namespace
) -> tuple[Summary, dict[str, float], float]:
    """Runs ``config``'s load on a fresh cluster of ``system``.

    Returns the summary, each cluster process's CPU busy share (of one core) and the share of
    all CPUs that processes outside the run used meanwhile.
    """
    log_dir = Path(args.log_dir) / f"{system.name}-rate{config.rate:g}-seed{config.seed}"
    launcher = start_cluster(system, model_dir, args, log_dir)
    try:
        config = replace(config, url=launcher.url)
        check_server(config)
        warm_up(config, num_requests=2)
        wait_for_quiet_cpu(args.quiet_wait, threshold=0.1)
        pids = {name: p.popen.pid for name, p in launcher.procs.items()}
        before = {name: process_cpu_s(pid) for name, pid in pids.items()}
        start = cpu_times()
        summary, _ = run_bench(config, slo, show_progress=not args.no_progress)
        end = cpu_times()
        used = {name: process_cpu_s(pid) - before[name] for name, pid in pids.items()}
    finally:
        launcher.stop()
    wall = end.wall - start.wall
    busy = {name: s / wall for name, s in used.items()}
    outside = (end.busy - start.busy) - (end.own - start.own) - sum(used.values())
    return summary, busy, min(1.0, max(0.0, outside / (wall * (os.cpu_count() or 1))))


def least_disturbed(
    system: System,
    config: LoadConfig,
    slo: Slo,
    model_dir: Path,
    args: argparse.Namespace,
    repeat: int,
) -> Run:
    """Measures up to ``--attempts`` times while outside processes took more than
    ``--max-outside-cpu`` of the CPUs; returns the run they disturbed least."""
    best: Run | None = None
    for _ in range(args.attempts):
        if best is not None:
            shown = f"{system.name} @ {config.rate:g} req/s"
            print(f"{shown}: outside CPU {best.outside_cpu:.0%}; measuring again", flush=True)
        summary, busy, outside = measure(system, config, slo, model_dir, args)
        run = Run(system.name, config.rate, repeat, summary, busy, outside)
        if best is None or run.outside_cpu < best.outside_cpu:
            best = run
        if best.outside_cpu <= args.max_outside_cpu:
            break
    assert best is not None
    return best


def calibrate(model_dir: Path, base: LoadConfig, slo: Slo, args: argparse.Namespace) -> float:
    """Requests/s the colocated system completes when ``--calibrate-requests`` arrive at once."""
    config = replace(base, rate=math.inf, num_requests=args.calibrate_requests)
    [colocated] = create_systems(args.threads, ["colocated"])
    summary, _, _ = measure(colocated, config, slo, model_dir, args)
    print(f"calibration: colocated completes {summary.request_throughput:.3f} req/s in a burst")
    return summary.request_throughput


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
        f"Model: {setup['model']}, float32. Workload: {setup['num_requests']} requests per run, "
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
        path = update_benchmarks_md(SECTION_TITLE, markdown_body(data), data["command"])
        print(f"\nwrote section {SECTION_TITLE!r} of {path}")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kvrelay.bench import length_range

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, help="checkpoint; default: make one (make_tiny)")
    p.add_argument("--size", default="small", help="make_tiny size when no --model-dir")
    p.add_argument("--rates", default=None, help="req/s, comma-separated; default: calibrate")
    p.add_argument("--calibrate-requests", type=int, default=8, help="burst size to calibrate")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=length_range, default=(32, 1024), help="LOW:HIGH")
    p.add_argument("--output-len", type=length_range, default=(32, 256), help="LOW:HIGH")
    p.add_argument("--repeats", type=int, default=1, help="runs per cell (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="per disaggregated worker")
    p.add_argument(
        "--systems",
        type=lambda text: [n.strip() for n in text.split(",") if n.strip()],
        default=list(DEFAULT_SYSTEMS),
        help="comma-separated: colocated, 1P+1D, colocated-half (control: 1 worker's threads)",
    )
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="prefill chunk")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--quiet-wait", type=float, default=60.0, help="max s to wait for idle CPUs")
    p.add_argument(
        "--max-outside-cpu",
        type=float,
        default=0.2,
        help="measure a run again while other processes took more than this share of the CPUs",
    )
    p.add_argument("--attempts", type=int, default=2, help="measurements at most per run")
    p.add_argument("--log-dir", default=None, help="cluster logs (default: a temporary dir)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument(
        "--render", type=Path, help="measure nothing: report the results of a saved --json"
    )
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    try:
        create_systems(args.threads, args.systems)
    except ValueError as exc:
        p.error(str(exc))
    counts = (args.repeats, args.threads, args.num_requests, args.calibrate_requests, args.attempts)
    if min(counts) < 1:
        p.error("--repeats, --threads, --num-requests, --calibrate-requests and --attempts "
                "must be >= 1")  # fmt: skip
    return args


def result_data(
    args: argparse.Namespace, model: str, rates: list[float], slo: Slo, runs: list[Run]
) -> dict[str, Any]:
    groups = {key: medians(group) for key, group in grouped(runs).items()}
    return {
        "command": command_line(),
        "setup": setup_of(args, model),
        "rates": rates,
        "slo": asdict(slo),
        "machine": machine_info(2 * args.threads),
        "systems": [asdict(s) for s in create_systems(args.threads, args.systems)],
        "runs": [asdict(r) for r in runs],
        "medians": [{"rate": rate, "system": system, **m} for (rate, system), m in groups.items()],
    }


def setup_of(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """What the report needs to describe a run, besides its results."""
    names = (
        "num_requests", "prompt_len", "output_len", "seed", "repeats", "threads", "systems",
        "num_blocks", "max_num_batched_tokens", "attempts", "max_outside_cpu",
    )  # fmt: skip
    return {"model": model, **{name: getattr(args, name) for name in names}}


def parse_rates(text: str) -> list[float]:
    rates = [float(r) for r in text.split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates needs positive numbers, got {text!r}")
    return sorted(rates)


def run_all(args: argparse.Namespace, model_dir: Path, model: str) -> int:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    base = LoadConfig(
        url="",
        model=SERVED_NAME,
        num_requests=args.num_requests,
        prompt_lens=args.prompt_len,
        output_lens=args.output_len,
        vocab_size=vocab,
    )
    if args.rates:
        rates = parse_rates(args.rates)
    else:
        capacity = calibrate(model_dir, base, slo, args)
        rates = [round(0.25 * capacity, 3), round(0.8 * capacity, 3)]
    print(f"rates: {', '.join(f'{r:g}' for r in rates)} req/s; {args.repeats} repeat(s)")
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for rate in rates:
            config = replace(base, rate=rate, seed=args.seed + repeat)
            for system in create_systems(args.threads, args.systems):
                runs.append(least_disturbed(system, config, slo, model_dir, args, repeat))
                summary = runs[-1].summary
                tpot = metrics(summary)["tpot_p50"]
                print(
                    f"{system.name} @ {rate:g} req/s: {summary.num_completed} done, "
                    f"{summary.num_failed} failed, TPOT p50 {tpot:.0f} ms",
                    flush=True,
                )
                if args.json:  # after every run, so an interrupted one keeps what it has
                    write_json(args.json, result_data(args, model, rates, slo, runs))
    report(result_data(args, model, rates, slo, runs), write_md=not args.no_write)
    failed = sum(r.summary.num_failed for r in runs)
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. under nohup) unwinds like Ctrl-C, so every started cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.render is not None:
        report(json.loads(args.render.read_text()), write_md=not args.no_write)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvrelay-serve-bench-") as tmp:
        if args.log_dir is None:
            args.log_dir = str(Path(tmp) / "logs")
        if args.model_dir is not None:
            return run_all(args, args.model_dir, f"`{args.model_dir.name}`")
        from kvrelay.engine.make_tiny import make_tiny

        model_dir = make_tiny(Path(tmp) / args.size, arch="llama", size=args.size)
        return run_all(args, model_dir, f"make_tiny `{args.size}` llama")


if __name__ == "__main__":
    sys.exit(main())
