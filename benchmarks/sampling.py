"""The sampler's time for one step's rows, by sampling mode; optionally against another commit.

``Sampler`` on [rows, vocab] float32 logits (SmolLM2's 49,152 by default), each mode's
median over ``--iters`` calls after warm-up, for two spreads of logits: ``flat`` (standard
normal: most of the vocabulary carries mass, so top-p 0.9 keeps thousands of tokens) and
``peaked`` (normal x 6: a few dozen tokens hold the mass, as a trained model's next-token
distribution mostly does); each row's request has a 300-token prompt and 60 output tokens
(what the penalties read). With ``--base REV`` the sampler of that commit (a git worktree,
no build needed: the sampler is Python and torch) is timed in a process of its own, in turns
with this tree's (base, head, head, base...), and the table gives both and their ratio.

    python benchmarks/sampling.py [--rows 1 32 64] [--base REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "seeded, temperature 1": {"temperature": 1.0, "seed": 7},
    "top-k 50": {"top_k": 50},
    "top-p 0.9, temperature 0.7": {"temperature": 0.7, "top_p": 0.9},
    "min-p 0.05": {"min_p": 0.05},
    "presence 0.5": {"presence_penalty": 0.5},
    "repetition 1.1": {"repetition_penalty": 1.1},
    "greedy, logit_bias 20 ids": {"temperature": 0.0, "logit_bias": {i: -5.0 for i in range(20)}},
    "temperature 1, logit_bias 20 ids": {"logit_bias": {i * 97: 2.0 for i in range(20)}},
    "temperature 1, allowed_token_ids 50": {"allowed_token_ids": list(range(1000, 1050))},
}
SPREADS = {"flat": 1.0, "peaked": 6.0}
PROMPT, OUTPUT = tuple(range(3, 303)), tuple(range(500, 560))  # what the penalties look at


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64])
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2, help="turns of each tree (with --base)")
    parser.add_argument("--base", default=None, help="a commit whose sampler is timed beside")
    parser.add_argument("--worktree", default="/tmp/kvrelay-sampling-base")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # measure here
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """'spread/mode/rows' -> median ms of this interpreter's kvrelay sampler."""
    import torch

    from kvrelay.engine.sampling import Sampler, SampleRequest, create_generator
    from kvrelay.protocol.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    sampler = Sampler([2], seed=0)
    out = {}
    for spread, scale in SPREADS.items():
        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(max(args.rows), args.vocab, generator=gen) * scale
        for mode, fields in MODES.items():
            try:
                params = SamplingParams(**fields)
            except TypeError:  # a --base tree without the field
                continue
            for rows in args.rows:
                requests = [
                    SampleRequest(params, PROMPT, OUTPUT, create_generator(params))
                    for _ in range(rows)
                ]
                part = logits[:rows]
                for _ in range(3):
                    sampler(part, requests)
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    sampler(part, requests)
                    times.append(time.perf_counter() - start)
                out[f"{spread}/{mode}/{rows}"] = statistics.median(times) * 1000
    return out


def run_tree(root: Path, args: argparse.Namespace) -> dict[str, float]:
    argv = [sys.executable, str(Path(__file__).resolve()), "--one", "--vocab", str(args.vocab)]
    argv += ["--threads", str(args.threads), "--iters", str(args.iters), "--rows"]
    argv += [str(r) for r in args.rows]
    env = dict(os.environ, PYTHONPATH=str(root))
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, cwd=root)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(args)))
        return 0
    trees: dict[str, Path] = {"head": ROOT}
    if args.base is not None:
        worktree = Path(args.worktree)
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-f", str(worktree), args.base],
                       check=True, capture_output=True)  # fmt: skip
        trees = {"base": worktree, "head": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        names = list(trees)
        for i in range(args.rounds if args.base else 1):
            for name in names if i % 2 == 0 else names[::-1]:
                runs[name].append(run_tree(trees[name], args))
    finally:
        if args.base is not None:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", args.worktree],
                           check=False, capture_output=True)  # fmt: skip
    medians: dict[str, dict[str, Any]] = {
        name: {key: statistics.median(r[key] for r in rs) for key in rs[0]}
        for name, rs in runs.items()
    }
    head = medians["head"]
    columns = ["spread", "mode", "rows", "head ms"]
    if "base" in medians:
        columns += [f"base ({args.base}) ms", "head / base"]
    print(f"{args.vocab}-token vocabulary, {args.threads} threads, medians of {args.iters} calls")
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for key, ms in head.items():
        spread, mode, rows = key.split("/")
        cells = [spread, mode, rows, f"{ms:.2f}"]
        base = medians.get("base", {}).get(key)
        if "base" in medians:
            cells += ["-", "-"] if base is None else [f"{base:.2f}", f"{ms / base:.2f}x"]
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
