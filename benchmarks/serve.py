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
import signal
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from common import (
    add_model_args,
    command_line,
    machine_info,
    model_label,
    section_title,
    write_json,
)
from serve_report import SECTION_TITLE, grouped, medians, metrics, report
from serve_runs import DEFAULT_SYSTEMS, SERVED_NAME, Run, calibrate, create_systems, least_disturbed

from kvrelay.bench import LoadConfig, Slo

# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from kvrelay.cli.bench import length_range

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
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
    title = section_title(SECTION_TITLE, args.model_dir, args.size, args.dtype)
    setup = {name: getattr(args, name) for name in names}
    return {"model": model, "dtype": args.dtype, "title": title, **setup}


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
            return run_all(args, args.model_dir, model_label(args.model_dir))
        from kvrelay.engine.make_tiny import make_tiny

        model_dir = make_tiny(Path(tmp) / args.size, arch="llama", size=args.size)
        return run_all(args, model_dir, model_label(None, args.size))


if __name__ == "__main__":
    sys.exit(main())
