"""How long a worker's other threads wait while start-up work runs on a thread of its own.

A thread that ticks every 10 ms (as the heartbeat does every 200 ms) records its longest gap
while one piece of a worker's start-up work runs on another thread, at normal priority and at
``background.NICENESS``, with ``--hogs`` busy processes on the machine's cores (a loaded host):
building the grammar compiler's tokenizer tables (holds the GIL for stretches) and packing
weights for oneDNN (torch ops: the GIL released). A gap past the router's ``--dead-after``
declares the worker dead. Each case runs in a fresh interpreter (the imports are part of the
work), in turns, ``--repeats`` times; printed: the median wall time and longest gap per case.

    python benchmarks/gil_priority.py --model DIR [--hogs 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASE = r"""
import json, os, sys, threading, time
sys.path.insert(0, {repo!r})
import torch
torch.set_num_threads(1)
from kvrelay.engine import background
work, nice, model = {work!r}, {nice!r}, {model!r}
gaps = []
def tick():
    last = time.perf_counter()
    while True:
        time.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
if work == "grammar":
    from kvrelay.engine.structured import GrammarCache
    cfg = json.load(open(model + "/config.json"))
    job = GrammarCache(model, cfg["vocab_size"], [0]).warm_up
else:
    from kvrelay.kernels import cpu_packed
    ws = [torch.randn(576, 1536) for _ in range(60)] + [torch.randn(49152, 576)]
    def job():
        for i, w in enumerate(ws):
            cpu_packed.pack(w, transposed=i < 60)
def run():
    if nice:
        background.lower_priority()
    job()
threading.Thread(target=tick, daemon=True).start()
time.sleep(0.05)
gaps.clear()
started = time.perf_counter()
worker = threading.Thread(target=run)
worker.start()
worker.join()
print(json.dumps({{"wall_s": time.perf_counter() - started, "max_gap_s": max(gaps)}}), flush=True)
os._exit(0)  # measured: no interpreter finalization (torch's, transformers' modules) to wait for
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--hogs", type=int, default=3, help="busy processes beside the run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--work", nargs="+", default=["grammar", "pack"])
    return parser.parse_args(argv)


def run_case(work: str, nice: bool, model: str) -> dict[str, float]:
    code = CASE.format(repo=str(HERE.parent), work=work, nice=nice, model=model)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    hog = [sys.executable, "-c", "while True: pass"]
    hogs = [subprocess.Popen(hog) for _ in range(args.hogs)]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    try:
        for _ in range(args.repeats):
            for work in args.work:
                for nice in (False, True):
                    results.setdefault((work, nice), []).append(run_case(work, nice, args.model))
    finally:
        for p in hogs:
            p.kill()
            p.wait()
    print(f"{args.hogs} busy processes; medians of {args.repeats}")
    for (work, nice), runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        gap = statistics.median(r["max_gap_s"] for r in runs)
        gaps = ", ".join(f"{r['max_gap_s']:.3f}" for r in runs)
        priority = "nice 10" if nice else "normal priority"
        print(f"{work} at {priority}: {wall:.2f} s, longest gap {gap:.3f} s ({gaps})")


if __name__ == "__main__":
    main()
