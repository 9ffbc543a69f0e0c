"""Serving benchmark, runs: the systems compared (colocated, 1P+1D, colocated-half) and one
run of one system at one rate on a fresh cluster, with the CPU the run and others used."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from common import cpu_times, wait_for_quiet_cpu

from kvrelay.bench import LoadConfig, Slo, Summary, check_server, run_bench, warm_up
from kvrelay.cli.launcher import ClusterSpec, Launcher

SERVED_NAME = "bench"
DEAD_AFTER_S = 120.0  # router heartbeat timeout: a worker reports only between steps
DEFAULT_SYSTEMS = ("colocated", "1P+1D")


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
        "--dtype", args.dtype,
        "--num-blocks", str(args.num_blocks),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--dead-after", str(DEAD_AFTER_S),  # the router's too: a busy router is not gone
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
