"""The simulator against the real cluster: one trace window, the same fleets, side by side.

For each fleet (1P+1D, colocated, 2P+1D) a real cluster of the model is started on this
machine (``Launcher``, as ``kvrelay up``), ``kvrelay bench --trace`` replays the window
against it, and ``kvrelay sim`` replays the same requests on the same fleet with this
machine's profile (the one measured with the fleet's threads per instance). TTFT and TPOT
p50 / p99 are compared; the goal is within 15%.

Usage: python benchmarks/sim_validate.py --model DIR --profile-1t P1.json --profile-2t P2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table, update_benchmarks_md, write_json
from sim_fleet import rerun_command

from kvrelay.bench import LoadConfig, Slo, run_bench, trace_requests, warm_up
from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.sim.profile import Profile
from kvrelay.sim.report import summarize
from kvrelay.sim.simulator import FleetConfig, Simulator
from kvrelay.sim.trace import cap_requests, load_trace
from kvrelay.sim.workload import WorkloadConfig, build_requests

TITLE = "Simulator validation: kvrelay sim vs a real cluster on one trace window"
FLEETS = {  # name -> (prefill, decode, colocated, threads per worker)
    "1P+1D": (1, 1, 0, 1),
    "colocated": (0, 0, 1, 2),
    "2P+1D": (2, 1, 0, 1),
}


def real_run(
    args: argparse.Namespace, fleet: tuple[int, int, int, int], trace: Any
) -> dict[str, Any]:
    p, d, c, threads = fleet
    logs = tempfile.mkdtemp(prefix="simval-")
    spec = ClusterSpec(
        model=str(args.model), num_prefill=p, num_decode=d, num_colocated=c,
        worker_args=("--threads", str(threads)), router_args=("--served-model-name", "m"),
        log_dir=logs,
    )  # fmt: skip
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=300)
        config = LoadConfig(launcher.url, "m", trace=str(args.trace), request_timeout_s=600)
        warm_up(config, 2)
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        summary, _ = run_bench(config, slo, False, trace_requests(trace, args.seed))
    finally:
        launcher.stop()
    return dataclasses.asdict(summary)


def sim_run(
    args: argparse.Namespace, fleet: tuple[int, int, int, int], trace: Any
) -> dict[str, Any]:
    p, d, c, threads = fleet
    profile = Profile.load(args.profile_1t if threads == 1 else args.profile_2t)
    requests = build_requests(trace, WorkloadConfig(system_prompt_len=0), profile.block_size)
    sim = Simulator(
        profile,
        FleetConfig(prefill=p, decode=d, colocated=c, slo_ttft_ms=args.slo_ttft_ms,
                    slo_tpot_ms=args.slo_tpot_ms),
        requests,
    )  # fmt: skip
    sim.run()
    return summarize(sim)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--profile-1t", type=Path, required=True, help="profile at 1 thread")
    p.add_argument("--profile-2t", type=Path, required=True, help="profile at 2 threads")
    p.add_argument(
        "--trace", type=Path, default=Path("/work/shared/traces/azure-llm-2023-conv.csv")
    )
    p.add_argument("--max-requests", type=int, default=36)
    p.add_argument("--time-scale", type=float, default=8.0)
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fleets", nargs="+", default=list(FLEETS), choices=list(FLEETS))
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None, help="render a saved run's results")
    p.add_argument("--note", default="", help="a paragraph appended to the section")
    p.add_argument(
        "--resim", action="store_true", help="with --from-json: simulate again, keep the real runs"
    )
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    trace = cap_requests(
        load_trace(args.trace), args.max_requests, args.max_prompt_tokens,
        args.max_output_tokens, args.time_scale,
    )  # fmt: skip
    results: dict[str, Any] = {}
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
        if args.resim:
            for name, r in results.items():
                r["sim"] = sim_run(args, FLEETS[name], trace)
    for name in [f for f in args.fleets if f not in results]:
        started = time.time()
        real = real_run(args, FLEETS[name], trace)
        sim = sim_run(args, FLEETS[name], trace)
        results[name] = {"real": real, "sim": sim, "real_wall_s": time.time() - started}
        print(name, {k: (real[k], sim[k]) for k in ("ttft_ms", "tpot_ms")}, flush=True)
    if args.json is not None:
        write_json(args.json, results)
    body = markdown(args, results) + (f"\n\n{args.note}" if args.note else "")
    print(body)
    if not args.no_write:
        update_benchmarks_md(TITLE, body, rerun_command(__file__))
    return 0


def markdown(args: argparse.Namespace, results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.items():
        for metric in ("ttft_ms", "tpot_ms"):
            for q in ("p50", "p99"):
                real, sim = r["real"][metric][q], r["sim"][metric][q]
                err = (sim - real) / real
                rows.append([name, f"{metric[:4].upper()} {q}", f"{real:,.0f}", f"{sim:,.0f}",
                             f"{err:+.0%}", "yes" if abs(err) <= 0.15 else "no"])  # fmt: skip
    met = sum(1 for r in rows if r[-1] == "yes")
    return "\n".join([
        f"Model `{args.model.name}`, float32. The first {args.max_requests} requests of "
        f"`{args.trace.name}`, arrival gaps x{args.time_scale:g}, prompts capped at "
        f"{args.max_prompt_tokens} tokens and outputs at {args.max_output_tokens} (forced, eos "
        "ignored), random token-id prompts (no prefix sharing; the sim's prefix model off). "
        "Real: `Launcher` (as `kvrelay up`) with P/D workers at `--threads 1`, colocated at "
        "`--threads 2`, KV over shm, then `kvrelay bench --trace` (streamed completions, "
        "client-side TTFT, TPOT = (e2e - TTFT) / (n - 1)). Sim: `kvrelay sim` with the profile "
        "measured at the same threads, the same requests and fleet.",
        "",
        markdown_table(["fleet", "metric", "real ms", "sim ms", "sim vs real", "within 15%"], rows),
        "",
        f"Within 15%: {met} of {len(rows)}.",
    ])  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
