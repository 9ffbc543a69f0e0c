"""Start to first token of ``kvrelay up`` (1 prefill + 1 decode), one tree against others.

From launching ``kvrelay up --model M`` (defaults otherwise: the host's parameter pool, each
worker's share of the CPUs) to an answered 1-token completion, for the code of each tree
given, in turns (tree A, tree B, ..., then again), medians. One unmeasured start of each tree
first: it builds that tree's parameter pool and fills the page cache. A tree of another
commit needs its native library built in place (``python setup.py build_ext --inplace``):

    git worktree add /tmp/before REV
    python benchmarks/start_time.py --model DIR --trees . /tmp/before --labels HEAD before
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

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
    p.add_argument("--note", default="", help="a paragraph under the table (what the trees are)")
    p.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = p.parse_args()
    labels = args.labels or [str(t) for t in args.trees]
    if len(labels) != len(args.trees):
        sys.exit("--labels needs one name per tree")
    trees = [t.resolve() for t in args.trees]
    runs: dict[str, list[float]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as work:
        for tree, label in zip(trees, labels, strict=True):
            up_first_token_s(tree, args.model, Path(work) / f"{label}-first")
        for i in range(args.repeats):
            for tree, label in zip(trees, labels, strict=True):
                seconds = up_first_token_s(tree, args.model, Path(work) / f"{label}-{i}")
                runs[label].append(seconds)
                print(f"{label}: {seconds:.2f} s", flush=True)
    base = median(runs[labels[0]])
    rows = [
        [label, f"{median(v):.2f}", f"{min(v):.2f}", f"{max(v):.2f}", f"{median(v) / base:.2f}x"]
        for label, v in runs.items()
    ]
    table = markdown_table(["tree", "median s", "min s", "max s", f"vs {labels[0]}"], rows)
    body = (
        f"{machine_markdown(machine_info((os.cpu_count() or 2) // 2))} (threads: each "
        "worker's).\n\n"
        f"Launch of `kvrelay up --model {args.model.name}` (router, 1 prefill and 1 decode "
        "worker, default options) to an answered 1-token completion; the trees in turns, "
        f"{args.repeats} starts each after one unmeasured start per tree.\n\n{table}\n"
    )
    if args.note:
        body += f"\n{args.note}\n"
    print(body)
    if args.write:
        update_benchmarks_md(SECTION, body, command_line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
