"""A simulation's results: goodput, latency percentiles, fleet over time, cache hit rates."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvrelay.sim.simulator import Simulator
from kvrelay.sim.workload import SimRequest

RECOVERY_BIN_S = 5.0  # burst recovery: arrival bins of this width
RECOVERY_MAX_VIOLATING = 0.1  # a bin with more SLO violations than this is not recovered


def _pcts(values: Sequence[float]) -> dict[str, float] | None:
    import numpy as np

    if not len(values):
        return None
    arr = np.asarray(values) * 1e3
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(sim: Simulator, burst: tuple[float, float] | None = None) -> dict[str, Any]:
    """Everything of one run as JSON-ready data (``burst``: its start and length, seconds)."""
    fleet = sim.fleet
    done = [r for r in sim.requests if not math.isnan(r.finish_s)]
    slo_ttft, slo_tpot = fleet.slo_ttft_ms / 1e3, fleet.slo_tpot_ms / 1e3
    good = [r for r in done if r.ttft_s <= slo_ttft and r.tpot_s <= slo_tpot]
    end = max((r.finish_s for r in done), default=0.0)
    duration = max(end, sim.requests[-1].arrival_s if sim.requests else 0.0)
    inst_s = _instance_seconds(sim.timeline, end)
    is_good = {r.rid for r in good}
    reusable = sum(r.unique_blocks + sum(n for _, n in r.segments) for r in done)
    hits = [sum(r.hit_blocks[i] for r in done) for i in range(3)]
    out: dict[str, Any] = {
        "num_requests": len(sim.requests),
        "num_completed": len(done),
        "num_rejected": len(sim.rejected),
        "duration_s": duration,
        "goodput": len(good) / duration if duration else 0.0,
        "slo_attainment": len(good) / len(sim.requests) if sim.requests else 0.0,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": sum(r.output_len for r in done) / duration if duration else 0.0,
        "slo_ttft_ms": fleet.slo_ttft_ms,
        "slo_tpot_ms": fleet.slo_tpot_ms,
        "ttft_ms": _pcts([r.ttft_s for r in done]),
        "tpot_ms": _pcts([r.tpot_s for r in done if r.output_len > 1]),
        "instance_seconds": inst_s,
        "peak_instances": max(p + d + c for _, p, d, c in sim.timeline),
        "hit_rate": {
            "device": hits[0] / reusable if reusable else 0.0,
            "host": hits[1] / reusable if reusable else 0.0,
            "global": hits[2] / reusable if reusable else 0.0,
        },
        "prefill_tokens_computed": sum(r.computed_tokens for r in done),
        "prompt_tokens": sum(r.prompt_len for r in done),
        "timeline": [list(t) for t in sim.timeline],
        "scale_ups": [list(s) for s in sim.scale_ups],
        "decisions": sim.decisions[-50:],
    }
    out["goodput_per_instance"] = len(good) / inst_s if inst_s else 0.0  # good requests / inst-s
    during = [
        r
        for s, e in sim.scale_ups
        for r in done
        if s <= r.arrival_s <= (e if not math.isnan(e) else end)
    ]
    out["slo_violations_during_scale_ups"] = sum(1 for r in during if r.rid not in is_good)
    out["requests_during_scale_ups"] = len(during)
    if burst is not None:
        out["burst"] = _burst(done, is_good, burst)
    return out


def _instance_seconds(timeline: Sequence[tuple[float, int, int, int]], end: float) -> float:
    total = 0.0
    for (t, p, d, c), nxt in zip(timeline, [*timeline[1:], (end, 0, 0, 0)]):
        total += (p + d + c) * max(0.0, nxt[0] - t)
    return total


def _burst(
    done: Sequence[SimRequest], is_good: set[int], burst: tuple[float, float]
) -> dict[str, Any]:
    """SLO violations from the burst's start on, and the time to recover: from the start to
    the end of the last ``RECOVERY_BIN_S`` arrival bin with more than 10% violating."""
    start, length = burst
    after = [r for r in done if r.arrival_s >= start]
    bins: dict[int, list[bool]] = {}
    for r in after:
        bins.setdefault(int((r.arrival_s - start) // RECOVERY_BIN_S), []).append(r.rid in is_good)
    bad = [b for b, oks in bins.items() if oks.count(False) / len(oks) > RECOVERY_MAX_VIOLATING]
    return {
        "start_s": start,
        "len_s": length,
        "violations": sum(1 for r in after if r.rid not in is_good),
        "requests": len(after),
        "recovery_s": (max(bad) + 1) * RECOVERY_BIN_S if bad else 0.0,
    }


def format_summary(s: dict[str, Any]) -> str:
    lines = [
        f"{s['num_completed']}/{s['num_requests']} completed ({s['num_rejected']} rejected) "
        f"over {s['duration_s']:.1f} simulated s",
    ]
    for name in ("ttft_ms", "tpot_ms"):
        st = s[name]
        if st:
            lines.append(
                f"{name[:4].upper():5} ms  p50 {st['p50']:.1f}  p90 {st['p90']:.1f}"
                f"  p99 {st['p99']:.1f}"
            )
    hr = s["hit_rate"]
    lines += [
        f"goodput {s['goodput']:.3f} req/s  (TTFT <= {s['slo_ttft_ms']:g} ms, TPOT <= "
        f"{s['slo_tpot_ms']:g} ms; attainment {100 * s['slo_attainment']:.1f} %)",
        f"instance-seconds {s['instance_seconds']:.0f}  peak instances {s['peak_instances']}  "
        f"goodput per instance {s['goodput_per_instance']:.4f} req/s",
        f"hit rate device {100 * hr['device']:.1f} %  host {100 * hr['host']:.1f} %  "
        f"global {100 * hr['global']:.1f} %",
        f"SLO violations during scale-ups {s['slo_violations_during_scale_ups']} of "
        f"{s['requests_during_scale_ups']} requests",
    ]
    if "burst" in s:
        b = s["burst"]
        lines.append(
            f"burst: {b['violations']} violations, recovered {b['recovery_s']:.0f} s after"
            " its start"
        )
    return "\n".join(lines)
