"""``kvrelay sim run`` (simulate a trace on a fleet) and ``kvrelay sim profile`` (measure)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def add_sim_parser(sub: Any) -> None:
    sim = sub.add_parser("sim", help="simulate a cluster on a trace (run) or measure a profile")
    cmds = sim.add_subparsers(dest="sim_command", required=True)
    prof = cmds.add_parser("profile", help="measure this machine's instance profile (JSON)")
    prof.add_argument("--model", required=True, help="checkpoint directory")
    prof.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    prof.add_argument("--threads", type=int, default=1, help="torch threads of one instance")
    prof.add_argument("--repeats", type=int, default=3)
    prof.add_argument("--quick", action="store_true", help="fewer, shorter points (tests)")
    prof.add_argument(
        "--statistic",
        choices=("min", "median"),
        default="min",
        help="per point over repeats: min (uncontended cost) or median (as the machine is now)",
    )
    run = cmds.add_parser("run", help="simulate a trace on a fleet")
    add_run_args(run)


def add_run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, required=True, help="from `kvrelay sim profile`")
    p.add_argument("--trace", type=Path, required=True, help="Splitwise CSV or mooncake JSONL")
    p.add_argument("--trace-format", choices=("splitwise", "mooncake"), default=None)
    p.add_argument("--rate", type=float, default=1.0, help="times the trace's rate")
    p.add_argument("--duration", type=float, default=None, help="seconds of the trace")
    p.add_argument("--start", type=float, default=0.0, help="from this second of the trace")
    p.add_argument("--max-requests", type=int, default=None, help="only the first N arrivals")
    p.add_argument("--burst-rate", type=float, default=1.0, help="times --rate in the burst")
    p.add_argument("--burst-start", type=float, default=0.0, help="seconds after --start")
    p.add_argument("--burst-len", type=float, default=0.0, help="seconds (0: no burst)")
    p.add_argument("--max-prompt-tokens", type=int, default=None)
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--prefill", type=int, default=1, help="prefill instances (at the start)")
    p.add_argument("--decode", type=int, default=1, help="decode instances (at the start)")
    p.add_argument("--colocated", type=int, default=0, help="colocated instances")
    p.add_argument("--autoscale", action="store_true", help="the real policy moves P and D")
    p.add_argument("--min-prefill", type=int, default=1)
    p.add_argument("--max-prefill", type=int, default=64)
    p.add_argument("--min-decode", type=int, default=1)
    p.add_argument("--max-decode", type=int, default=64)
    p.add_argument("--start-mode", choices=("disk", "pool", "peer"), default="pool")
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV pool per instance")
    p.add_argument("--host-pool-gib", type=float, default=4.0, help="L1 per host")
    p.add_argument("--redis-gib", type=float, default=0.0, help="L2, global (0: off)")
    p.add_argument("--instances-per-host", type=int, default=8)
    p.add_argument("--placement", choices=("cache-aware", "load-only"), default="cache-aware")
    p.add_argument(
        "--prefill-queue-limit",
        type=float,
        default=math.inf,
        help="the router's: queued prompt tokens from which a decode instance may compute a "
        "prompt itself (inf: never)",
    )
    p.add_argument("--tenants", type=int, default=100, help="prefix model: system prompts")
    p.add_argument("--zipf", type=float, default=1.1, help="prefix model: tenant popularity")
    p.add_argument("--system-prompt-len", type=int, default=512, help="prefix model: tokens")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--plot", type=Path, default=None, help="PNG plots (needs kvrelay[plot])")


def cmd_sim(args: argparse.Namespace) -> int:
    if args.sim_command == "profile":
        import statistics

        from kvrelay.sim.measure import measure_profile

        stat = min if args.statistic == "min" else statistics.median
        profile = measure_profile(str(args.model), args.threads, args.repeats, args.quick, stat)
        profile.save(args.out)
        print(f"wrote {args.out}: prefill {profile.prefill}, decode {profile.decode}")
        return 0
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    from kvrelay.autoscale.policy import PolicyConfig
    from kvrelay.sim.profile import Profile
    from kvrelay.sim.report import format_summary, summarize
    from kvrelay.sim.simulator import FleetConfig, Simulator
    from kvrelay.sim.trace import load_trace
    from kvrelay.sim.workload import WorkloadConfig, build_requests

    profile = Profile.load(args.profile)
    workload = WorkloadConfig(
        rate=args.rate,
        duration_s=args.duration,
        start_s=args.start,
        burst_rate=args.burst_rate,
        burst_start_s=args.burst_start,
        burst_len_s=args.burst_len,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        tenants=args.tenants,
        zipf_s=args.zipf,
        system_prompt_len=args.system_prompt_len,
        seed=args.seed,
    )
    policy = PolicyConfig().with_target(
        "prefill", slo_ms=args.slo_ttft_ms, min_instances=args.min_prefill,
        max_instances=args.max_prefill,
    ).with_target(
        "decode", slo_ms=args.slo_tpot_ms, min_instances=args.min_decode,
        max_instances=args.max_decode,
    )  # fmt: skip
    fleet = FleetConfig(
        prefill=args.prefill,
        decode=args.decode,
        colocated=args.colocated,
        autoscale=args.autoscale,
        policy=policy,
        start_mode=args.start_mode,
        kv_gib=args.kv_gib,
        host_pool_gib=args.host_pool_gib,
        redis_gib=args.redis_gib,
        instances_per_host=args.instances_per_host,
        placement=args.placement,
        prefill_queue_limit=args.prefill_queue_limit,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
    )
    started = time.perf_counter()
    requests = build_requests(
        load_trace(args.trace, args.trace_format), workload, profile.block_size
    )
    requests = requests[: args.max_requests]
    sim = Simulator(profile, fleet, requests)
    sim.run()
    wall_s = time.perf_counter() - started
    burst = (args.burst_start, args.burst_len) if args.burst_len > 0 else None
    summary = summarize(sim, burst)
    summary["wall_s"] = wall_s
    print(format_summary(summary))
    print(f"simulated in {wall_s:.1f} s wall")
    if args.json is not None:
        data = {
            "workload": dataclasses.asdict(workload),
            "fleet": dataclasses.asdict(fleet),
            "profile": str(args.profile),
            "trace": str(args.trace),
            **summary,
        }
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    if args.plot is not None:
        from kvrelay.sim.plots import plot_latencies

        done = [r for r in requests if r.finish_s == r.finish_s]
        series = {
            role: [(t, counts[i]) for t, *counts in sim.timeline]
            for i, role in enumerate(("prefill", "decode", "colocated"))
            if any(c[i + 1] for c in sim.timeline)
        }
        plot_latencies(
            [r.arrival_s for r in done],
            [r.ttft_s * 1e3 for r in done],
            [r.tpot_s * 1e3 for r in done],
            args.slo_ttft_ms,
            args.slo_tpot_ms,
            args.plot,
            series,
        )
    return 0
