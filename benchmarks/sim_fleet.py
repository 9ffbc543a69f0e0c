"""Fleet-scale questions answered with ``kvrelay sim`` (one BENCHMARKS.md section).

1. P/D vs colocated, both Splitwise traces at 1x, 10x, 100x: the fewest instances whose run
   meets the SLO (``--attainment`` of requests within both TTFT and TPOT SLOs), found by
   doubling then bisecting (to within 5%); P/D sizes prefill with decode generous, then decode.
2. A 5x burst for two minutes under the autoscaler (the real policy): SLO violations and time
   to recover, with new instances started from disk, the host pool or a peer (this machine's
   profile, and the 1B-model start times of the Scale-up section).
3. Cache-aware vs load-only placement on about 100 instances: hit rate per tier and TTFT.
4. The simulator's own speed: one hour of the conversation trace at 10x.

Usage: python benchmarks/sim_fleet.py --profile PROFILE.json [--quick] [--json OUT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, markdown_table, update_benchmarks_md, write_json

from kvrelay.autoscale.policy import PolicyConfig
from kvrelay.sim.profile import Profile
from kvrelay.sim.report import summarize
from kvrelay.sim.simulator import FleetConfig, Simulator
from kvrelay.sim.trace import TraceRequest, load_trace
from kvrelay.sim.workload import WorkloadConfig, build_requests

TRACES = {"conv": "azure-llm-2023-conv.csv", "code": "azure-llm-2023-code.csv"}
WINDOW_S = {1.0: 900.0, 10.0: 120.0, 100.0: 20.0}  # seconds of trace simulated per rate
TITLE = "Simulator: P/D vs colocated at fleet scale, burst autoscaling, cache-aware placement"
START_1B = {"disk": 11.05, "pool": 4.47, "peer": 7.88}  # Scale-up section, 1b model


def rerun_command(script: str) -> str:
    """This run's command, as it reruns the measurement: ``--from-json F`` becomes
    ``--json F`` and ``--note`` is left out."""
    argv, out = sys.argv[1:], []
    i = 0
    while i < len(argv):
        if argv[i] == "--note":
            i += 2
            continue
        out.append("--json" if argv[i] == "--from-json" else argv[i])
        i += 1
    saved = sys.argv
    sys.argv = [saved[0], *out]
    try:
        return command_line(script)
    finally:
        sys.argv = saved


def simulate(
    profile: Profile, trace: list[TraceRequest], workload: WorkloadConfig, fleet: FleetConfig
) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    sim = Simulator(profile, fleet, build_requests(trace, workload, profile.block_size))
    sim.run()
    burst = None
    if workload.burst_len_s:
        burst = (workload.burst_start_s, workload.burst_len_s)
    return summarize(sim, burst), time.perf_counter() - started


def smallest(
    score: Callable[[int], float], target: float, guess: int, limit: int = 8192
) -> int | None:
    """The smallest n >= 1 with score(n) >= target (assumed monotone), to within 5%: from
    ``guess`` halving down or doubling up to a bracket, then bisecting. None when doubling
    stops helping (score up < 0.002) or passes ``limit``: some requests miss the SLO on any
    number of instances."""
    hi = max(1, guess)
    if score(hi) >= target:
        lo = hi // 2
        while lo >= 1 and score(lo) >= target:
            hi, lo = lo, lo // 2
    else:
        lo, last = hi, score(hi)
        hi *= 2
        while (now := score(hi)) < target:
            if now - last < 0.002 or hi * 2 > limit:
                return None
            lo, last, hi = hi, now, hi * 2
    while hi - lo > max(1, hi // 20):
        mid = (lo + hi) // 2
        if score(mid) >= target:
            hi = mid
        else:
            lo = mid
    return hi


def estimates(profile: Profile, trace: list[TraceRequest], rate: float) -> tuple[int, int]:
    """Instances of each role the mean load needs at full batches (a starting point)."""
    span = trace[-1].arrival_s or 1.0
    per_s = len(trace) / span * rate
    prompt = sum(r.prompt_len for r in trace) / len(trace)
    output = sum(r.output_len for r in trace) / len(trace)
    budget = profile.max_num_batched_tokens
    prefill_tok_s = budget / profile.prefill_s(budget, budget * prompt / 2)
    batch = 32
    decode_tok_s = batch / profile.decode_s(batch, int(batch * (prompt + output / 2)))
    return math.ceil(per_s * prompt / prefill_tok_s), math.ceil(per_s * output / decode_tok_s)


def size_fleets(
    profile: Profile, args: argparse.Namespace, traces: dict[str, Any]
) -> list[dict[str, Any]]:
    rows = []
    for name, trace in traces.items():
        found: tuple[float, dict[str, Any]] | None = None  # the previous rate's fleets
        for rate in sorted(args.rates):
            rows += size_one(profile, args, name, trace, rate, found)
            found = (rate, {r["mode"]: r for r in rows[-2:]})
    return rows


def size_one(
    profile: Profile,
    args: argparse.Namespace,
    name: str,
    trace: list[TraceRequest],
    rate: float,
    found: tuple[float, dict[str, Any]] | None,
) -> list[dict[str, Any]]:
    """The smallest P/D and colocated fleets for one trace at one rate (``found``: a lower
    rate's answers, scaled as first guesses)."""
    base = FleetConfig(
        slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, placement=args.sizing_placement
    )
    workload = WorkloadConfig(rate=rate, duration_s=WINDOW_S[rate] * args.window_scale)
    est_p, est_d = estimates(profile, trace, rate)
    cache: dict[tuple[int, int, int], dict[str, Any]] = {}

    def att(p: int, d: int, c: int) -> float:
        if (p, d, c) not in cache:
            fleet = dataclasses.replace(base, prefill=p, decode=d, colocated=c)
            cache[(p, d, c)] = simulate(profile, trace, workload, fleet)[0]
            got = cache[(p, d, c)]["slo_attainment"]
            print(f"  {name} {rate:g}x P{p} D{d} C{c}: attainment {got:.3f}", flush=True)
        return float(cache[(p, d, c)]["slo_attainment"])

    guess_p, guess_d, guess_c = est_p, est_d, est_p + est_d
    if found is not None:
        scale = rate / found[0]
        key = found[1]["P/D"].get("key")
        if key:
            guess_p, guess_d = round(key[0] * scale), round(key[1] * scale)
        key = found[1]["colocated"].get("key")
        if key:
            guess_c = round(key[2] * scale)
    goal, d_wide = args.attainment, 2 * max(est_d, guess_d) + 2
    p = smallest(lambda n: att(n, d_wide, 0), goal, guess_p)
    d = smallest(lambda n: att(p, n, 0), goal, guess_d) if p else None
    c = smallest(lambda n: att(0, 0, n), goal, guess_c)
    rows = []
    for mode, key in (
        ("P/D", (p, d, 0) if p and d else None),
        ("colocated", (0, 0, c) if c else None),
    ):
        s = cache[key] if key else None
        n = sum(key) if key else None
        rows.append({
            "trace": name, "rate": rate, "mode": mode, "window_s": workload.duration_s,
            "fleet": _fleet_name(mode, key), "instances": n, "key": key,
            "requests": s["num_requests"] if s else None,
            "goodput": s["goodput"] if s else None,
            "goodput_per_instance": s["goodput"] / n if s and n else None,
            "attainment": s["slo_attainment"] if s else None,
            "ttft_p99": s["ttft_ms"]["p99"] if s else None,
            "tpot_p99": s["tpot_ms"]["p99"] if s else None,
            "runs": len(cache),
        })  # fmt: skip
    return rows


def burst_runs(
    profile: Profile, args: argparse.Namespace, trace: list[TraceRequest]
) -> list[dict[str, Any]]:
    rows = []
    workload = WorkloadConfig(
        rate=1.0, duration_s=900.0 * args.window_scale, burst_rate=5.0,
        burst_start_s=300.0 * args.window_scale, burst_len_s=120.0,
    )  # fmt: skip
    est_p, est_d = estimates(profile, trace, 1.0)
    # an operator's floor: the mean 1x load's estimate; the policy adds the rest
    policy = (
        PolicyConfig(window_s=30.0)
        .with_target("prefill", slo_ms=args.slo_ttft_ms, min_instances=est_p, max_instances=512)
        .with_target("decode", slo_ms=args.slo_tpot_ms, min_instances=est_d, max_instances=512)
    )
    for label, starts in (
        ("this machine", profile.start_s),
        ("1B model (Scale-up section)", START_1B),
    ):
        prof = dataclasses.replace(profile, start_s=dict(starts))
        for mode in ("disk", "pool", "peer"):
            fleet = FleetConfig(
                prefill=est_p, decode=est_d, autoscale=True, policy=policy,
                start_mode=mode, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
                placement=args.sizing_placement,
            )  # fmt: skip
            s, wall = simulate(prof, trace, workload, fleet)
            b = s["burst"]
            rows.append({
                "starts": label, "mode": mode, "start_s": starts[mode],
                "violations": b["violations"], "requests_after_burst_start": b["requests"],
                "recovery_s": b["recovery_s"], "peak_instances": s["peak_instances"],
                "instance_seconds": s["instance_seconds"], "attainment": s["slo_attainment"],
                "scale_up_violations": s["slo_violations_during_scale_ups"], "wall_s": wall,
            })  # fmt: skip
            print(f"  burst {label} {mode}: {b}", flush=True)
    return rows


def placement_runs(
    profile: Profile, args: argparse.Namespace, trace: list[TraceRequest]
) -> list[dict[str, Any]]:
    rows = []
    one_p, one_d = estimates(profile, trace, 1.0)
    n = args.placement_instances
    p = max(1, round(n * one_p / (one_p + one_d)))
    d = max(1, n - p)
    for headroom in args.placement_headroom:
        # a rate whose mean load needs 1/headroom of the fleet
        rate = round(n / headroom / (one_p + one_d), 1)
        rows += placement_pair(profile, args, trace, rate, (p, d))
    return rows


def placement_pair(
    profile: Profile,
    args: argparse.Namespace,
    trace: list[TraceRequest],
    rate: float,
    fleet_size: tuple[int, int],
) -> list[dict[str, Any]]:
    """Cache-aware and load-only placement on one P/D fleet at one rate."""
    rows = []
    p, d = fleet_size
    one_p, one_d = estimates(profile, trace, 1.0)
    load = rate * (one_p + one_d) / (p + d)  # the mean load's estimate over the fleet
    workload = WorkloadConfig(rate=rate, duration_s=120.0 * args.window_scale, tenants=args.tenants)
    for placement in ("cache-aware", "load-only"):
        fleet = FleetConfig(
            prefill=p, decode=d, placement=placement,  # type: ignore[arg-type]
            slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms,
        )  # fmt: skip
        s, wall = simulate(profile, trace, workload, fleet)
        rows.append({
            "placement": placement, "fleet": f"{p}P+{d}D", "rate": rate, "load": load,
            "requests": s["num_requests"],
            "hit_device": s["hit_rate"]["device"], "hit_host": s["hit_rate"]["host"],
            "computed_share": s["prefill_tokens_computed"] / s["prompt_tokens"],
            "ttft_p50": s["ttft_ms"]["p50"], "ttft_p99": s["ttft_ms"]["p99"],
            "attainment": s["slo_attainment"], "wall_s": wall,
        })  # fmt: skip
        print(f"  placement {placement}: {rows[-1]}", flush=True)
    return rows


def speed_runs(
    profile: Profile, args: argparse.Namespace, trace: list[TraceRequest]
) -> list[dict[str, Any]]:
    """Wall time of the simulator vs requests and instances (conversation trace)."""
    rows = []
    est_p, est_d = estimates(profile, trace, args.speed_rate)
    hour = 3600.0 * args.window_scale
    cases = [(args.speed_rate, hour, 1.0), (args.speed_rate, hour / 6, 1.0)]
    cases += [(args.speed_rate, hour / 3, 1.0), (args.speed_rate, hour / 6, 2.0)]
    cases += [(args.speed_rate, hour / 6, 4.0)]
    for rate, duration, factor in cases:
        p, d = math.ceil(est_p * 1.3 * factor), math.ceil(est_d * 1.3 * factor)
        fleet = FleetConfig(
            prefill=p, decode=d, slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms
        )
        s, wall = simulate(profile, trace, WorkloadConfig(rate=rate, duration_s=duration), fleet)
        rows.append({"rate": rate, "duration_s": duration, "requests": s["num_requests"],
                     "instances": p + d, "wall_s": wall,
                     "attainment": s["slo_attainment"]})  # fmt: skip
        print(f"  speed {rows[-1]}", flush=True)
    return rows


def _fleet_name(mode: str, key: tuple[int, int, int] | None) -> str:
    if key is None:
        return "none"
    return f"{key[0]}P+{key[1]}D" if mode == "P/D" else f"{key[2]}C"


def fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def markdown(profile: Profile, args: argparse.Namespace, res: dict[str, Any]) -> str:
    out = [
        f"All numbers are simulated (`kvrelay sim`) with the profile `{args.profile}`: "
        f"{profile.model} on "
        f"{profile.machine}, {profile.threads} thread(s) per instance (prefill step "
        f"{profile.prefill_s(2048, 2048 * 1024) * 1e3:.0f} ms for 2,048 tokens, decode step "
        f"{profile.decode_s(32, 32 * 1024) * 1e3:.0f} ms for 32 sequences of 1,024 tokens; start "
        + ", ".join(f"{m} {s:.2f} s" for m, s in profile.start_s.items())
        + "). An instance is one CPU engine of this machine, so fleets are large: read them as "
        "relative answers (P/D vs colocated, placement, start mode). SLO: TTFT <= "
        f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms; a fleet meets it when "
        f"{args.attainment:.0%} of requests meet both. Prefix model (Splitwise traces carry no "
        "text): 100 tenants (Zipf 1.1), each with a 512-token system prompt that begins its "
        "prompts; KV 1 GiB per instance, L1 host pool 4 GiB per 8 instances, no L2. Rates above 1x "
        "superpose time-shifted copies of the trace (`kvrelay/sim/workload.py`); only the first "
        "window (column) of each trace is simulated, from an empty fleet with no warm-up.",
        "",
        "**P/D vs colocated**: the fewest instances meeting the SLO.",
        "",
        markdown_table(
            ["trace", "rate", "window s", "mode", "fleet", "instances", "goodput req/s",
             "per instance",
             "attainment", "TTFT p99 ms", "TPOT p99 ms"],
            [[r["trace"], f"{r['rate']:g}x", fmt(r["window_s"], 0), r["mode"], r["fleet"],
              fmt(r["instances"]),
              fmt(r["goodput"], 2), fmt(r["goodput_per_instance"], 3), fmt(r["attainment"], 3),
              fmt(r["ttft_p99"], 0), fmt(r["tpot_p99"], 1)] for r in res["sizing"]],
        ),
        "",
        f"**Burst**: the conversation trace at 1x for {900 * args.window_scale:g} s with 5x from "
        f"{300 * args.window_scale:g} s for 120 s; the "
        "fleet starts at the mean 1x load's estimate per role, which is also the policy's "
        "minimum, and the real policy (window 30 s, defaults otherwise: one instance per "
        "evaluation, 15 s up-cooldown) scales it. Violations: requests arriving from the "
        "burst's start on that miss an SLO; recovered: the end of the last 5 s bin (by "
        "arrival) with > 10% violating.",
        "",
        markdown_table(
            ["start times", "mode", "start s", "violations", "of requests", "recovered after s",
             "peak instances", "instance-s", "attainment"],
            [[r["starts"], r["mode"], fmt(r["start_s"], 2), fmt(r["violations"]),
              fmt(r["requests_after_burst_start"]), fmt(r["recovery_s"], 0),
              fmt(r["peak_instances"]),
              fmt(r["instance_seconds"], 0), fmt(r["attainment"], 3)] for r in res["burst"]],
        ),
        "",
        f"**Placement** on {args.placement_instances} instances: the conversation trace for "
        f"{120 * args.window_scale:g} s at the rates in the table (load: the mean load's "
        f"estimate over the fleet), {args.tenants} tenants; the router's cache_weight 1 (a "
        "cached prompt token is worth one queued prefill token).",
        "",
        markdown_table(
            ["placement", "fleet", "rate", "load", "requests", "device hit rate", "L1 hit rate",
             "prompt tokens computed",
             "TTFT p50 ms", "TTFT p99 ms", "attainment"],
            [[r["placement"], r["fleet"], f"{r['rate']:g}x", fmt(r.get("load"), 2),
              fmt(r["requests"]),
              f"{r['hit_device']:.1%}",
              f"{r['hit_host']:.1%}", f"{r['computed_share']:.1%}", fmt(r["ttft_p50"], 0),
              fmt(r["ttft_p99"], 0), fmt(r["attainment"], 3)] for r in res["placement"]],
        ),
    ]  # fmt: skip
    if not res["speed"]:
        return "\n".join(out)
    out += [
        "",
        "**Simulator speed** (wall time on this 2-CPU machine, one process, `nice`d, the machine "
        "shared), cache-aware placement: the conversation trace, P/D fleets of 1.3x, 2.6x and "
        "5.2x the mean load's estimate.",
        "",
        markdown_table(
            ["rate", "trace s", "requests", "instances", "wall s", "requests / wall s"],
            [[f"{r['rate']:g}x", fmt(r["duration_s"], 0), fmt(r["requests"]), fmt(r["instances"]),
              fmt(r["wall_s"], 1), fmt(r["requests"] / r["wall_s"], 0)] for r in res["speed"]],
        ),
    ]  # fmt: skip
    return "\n".join(out)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--traces", type=Path, default=Path("/work/shared/traces"))
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    p.add_argument("--window-scale", type=float, default=1.0, help="shorten every window")
    p.add_argument("--attainment", type=float, default=0.9)
    p.add_argument("--slo-ttft-ms", type=float, default=10000.0, help="CPU instances: 10 s")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--sizing-placement", choices=("cache-aware", "load-only"), default="load-only")
    p.add_argument("--placement-instances", type=int, default=100)
    p.add_argument(
        "--placement-headroom", type=float, nargs="+", default=[1.3],
        help="placement runs: the fleet over the mean load's estimate (below 1: overloaded)",
    )  # fmt: skip
    p.add_argument("--tenants", type=int, default=100)
    p.add_argument("--speed-rate", type=float, default=10.0)
    p.add_argument(
        "--skip", nargs="*", default=[], choices=("sizing", "burst", "placement", "speed")
    )
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--from-json", type=Path, default=None, help="render a saved run's results")
    p.add_argument("--note", default="", help="a paragraph appended to the section")
    p.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = Profile.load(args.profile)
    traces = {name: load_trace(args.traces / file) for name, file in TRACES.items()}
    res: dict[str, Any] = {}
    steps: dict[str, Callable[[], list[dict[str, Any]]]] = {
        "sizing": lambda: size_fleets(profile, args, traces),
        "burst": lambda: burst_runs(profile, args, traces["conv"]),
        "placement": lambda: placement_runs(profile, args, traces["conv"]),
        "speed": lambda: speed_runs(profile, args, traces["conv"]),
    }
    if args.from_json is not None:
        res = json.loads(args.from_json.read_text())
    for name, step in steps.items():
        if name not in res:
            res[name] = [] if name in args.skip else step()
    if args.json is not None:
        write_json(args.json, res)
    body = markdown(profile, args, res) + (f"\n\n{args.note}" if args.note else "")
    print(body)
    if not args.no_write:
        update_benchmarks_md(TITLE, body, rerun_command(__file__))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
