"""Start to first token of ``kvrelay up`` (1 prefill + 1 decode), one tree against others.

From launching ``kvrelay up --model M`` (defaults otherwise: the host's parameter pool, each
worker's share of the CPUs) to an answered 1-token completion, for the code of each tree
given, in turns (tree A, tree B, ..., then again), medians. One unmeasured start of each tree
first: it builds that tree's parameter pool and fills the page cache. A tree of another
commit needs its native library built in place (``python setup.py build_ext --inplace``):

    git worktree add /tmp/before REV
    python benchmarks/start_time.py --model DIR --trees . /tmp/before --labels HEAD before

``--bench-requests N`` then serves N requests (200-300-token random prompts, 32 tokens out,
Poisson at 1/s, a seed per repeat shared by the trees) through ``kvrelay bench`` on the
freshly started cluster: what its first users see, for a start that skips a warm-up.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    median,
    up_first_token_s,
    update_benchmarks_md,
)

SECTION = "Start to first token: kvrelay up (1P+1D)"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--trees", type=Path, nargs="+", required=True, help="source trees to start")
    p.add_argument("--labels", nargs="+", help="a name per tree (default: the paths)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--bench-requests",
        type=int,
        default=0,
        help="then serve this many requests at 1/s on the fresh cluster (0: none)",
    )
    p.add_argument(
        "--bench-rate",
        type=float,
        default=1.0,
        help="--bench-requests' Poisson arrivals a second (inf: all at once)",
    )
    p.add_argument(
        "--warm-up-starts",
        type=int,
        default=1,
        help="unmeasured starts of each tree first (parameter pool, page cache)",
    )
    p.add_argument("--note", default="", help="a paragraph under the table (what the trees are)")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    labels = args.labels or [str(t) for t in args.trees]
    if len(labels) != len(args.trees):
        sys.exit("--labels needs one name per tree")
    trees = [t.resolve() for t in args.trees]
    runs: dict[str, list[float]] = {label: [] for label in labels}
    served: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as work:
        for tree, label in zip(trees, labels, strict=True):
            for n in range(args.warm_up_starts):
                up_first_token_s(tree, args.model, Path(work) / f"{label}-first-{n}")
        for i in range(args.repeats):
            for tree, label in zip(trees, labels, strict=True):
                log_dir = Path(work) / f"{label}-{i}"
                then = None
                if args.bench_requests:
                    out = Path(work) / f"{label}-{i}.json"
                    then = _bench(args.model.name, args.bench_requests, args.bench_rate,
                                  100 + i, out)  # fmt: skip
                seconds = up_first_token_s(tree, args.model, log_dir, then=then)
                runs[label].append(seconds)
                line = f"{label}: {seconds:.2f} s"
                if args.bench_requests:
                    served[label].append(json.loads(out.read_text()))
                    line += f", then {_served_line(served[label][-1])}"
                print(line, flush=True)
    base = median(runs[labels[0]])
    rows = [
        [label, f"{median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}", f"{median(v) / base:.2f}x"]
        for label, v in runs.items()
    ]
    head = ["tree", "median s", "min s", "max s", f"vs {labels[0]}"]
    if args.bench_requests:
        head += ["then: first TTFT ms", "TTFT p50 ms", "TPOT p50 ms"]
        for row, label in zip(rows, labels, strict=True):
            results = served[label]
            first = [r["requests"][0]["ttft_s"] * 1000 for r in results]
            row += [
                f"{median(first):.0f}",
                f"{median([r['ttft_ms']['p50'] for r in results]):.0f}",
                f"{median([r['tpot_ms']['p50'] for r in results]):.1f}",
            ]
    table = markdown_table(head, rows)
    body = (
        f"{machine_markdown(machine_info((os.cpu_count() or 2) // 2))} (threads: each "
        "worker's).\n\n"
        f"Launch of `kvrelay up --model {args.model.name}` (router, 1 prefill and 1 decode "
        "worker, default options) to an answered 1-token completion; the trees in turns, "
        f"{args.repeats} starts each after {_unmeasured(args.warm_up_starts)}.\n\n{table}\n"
    )
    if args.bench_requests:
        body += (
            f"\nThen, on each fresh cluster: `kvrelay bench` of {args.bench_requests} requests "
            f"(random 200-300-token prompts, 32 tokens out, {_arrivals(args.bench_rate)}, the "
            "seed shared by the trees within a repeat); medians over the starts of the first "
            "request's TTFT and of each run's p50s.\n"
        )
    if args.note:
        body += f"\n{args.note}\n"
    print(body)
    if args.write:
        update_benchmarks_md(SECTION, body, command_line())
    return 0


def _unmeasured(starts: int) -> str:
    if starts == 0:
        return "no unmeasured start"
    return f"{'one' if starts == 1 else starts} unmeasured start{'s' * (starts > 1)} per tree"


def _arrivals(rate: float) -> str:
    return "all at once" if math.isinf(rate) else f"Poisson {rate:g}/s"


def _bench(model: str, requests: int, rate: float, seed: int, out: Path) -> Any:
    """A ``then`` for ``up_first_token_s``: ``kvrelay bench`` against the cluster's URL."""

    def run(url: str) -> None:
        subprocess.run(
            [sys.executable, "-m", "kvrelay", "bench", "--url", url, "--model", model,
             "--rate", f"{rate:g}", "--num-requests", str(requests), "--prompt-len", "200:300",
             "--output-len", "32:32", "--seed", str(seed), "--num-warmup", "0",
             "--json", str(out), "--no-progress"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip

    return run


def _served_line(result: dict[str, Any]) -> str:
    first = result["requests"][0]["ttft_s"] * 1000
    return (
        f"first TTFT {first:.0f} ms, TTFT p50 {result['ttft_ms']['p50']:.0f} ms, "
        f"TPOT p50 {result['tpot_ms']['p50']:.1f} ms"
    )


if __name__ == "__main__":
    sys.exit(main())
