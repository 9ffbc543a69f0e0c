"""CPU time the router and the worker spend per output token, a commit against the tree.

Starts ``kvrelay up`` colocated from each tree in turns (base, tree, tree, base, ...), drives
it with ``kvrelay bench`` (all requests at once, a concurrency limit), and reads each process's
CPU time (``/proc/PID/stat``: user + system) before and after the run: milliseconds of CPU per
1,000 output tokens, the serving path's cost independent of how busy the machine is, next to
the bench's output tok/s and TPOT p50 (which do depend on it). A small model (``kvrelay model
make-tiny``) keeps the engine step short, as on a GPU, so the path's share shows.

    python benchmarks/serving_cpu.py --base REV --model TINY_DIR [--rounds 2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from engine_ab import base_tree

ROOT = Path(__file__).resolve().parent.parent
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def serving_processes(up_pid: int) -> dict[str, int]:
    ps = ["ps", "-o", "pid=,args=", "--ppid", str(up_pid)]
    lines = subprocess.run(ps, capture_output=True, text=True, check=True).stdout.splitlines()
    return {
        ("router" if "--role router" in line else "worker"): int(line.split()[0])
        for line in lines
        if "kvrelay serve" in line
    }


def measure(tree: Path, port: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    up_argv = [sys.executable, "-m", "kvrelay", "up", "--model", args.model, "--colocated", "1"]
    log = (out.parent / f"up-{port}.log").open("w")
    up = subprocess.Popen(
        [*up_argv, "--port", str(port)], env=env, cwd=tree, stdout=log,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(url + "/ready", timeout=2).close()
                break
            except OSError:
                if up.poll() is not None or time.monotonic() > deadline:
                    tail = Path(log.name).read_text()[-2000:]
                    raise RuntimeError(
                        f"kvrelay up from {tree} did not get ready:\n{tail}"
                    ) from None
                time.sleep(0.1)
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            model_id = json.load(resp)["data"][0]["id"]
        procs = serving_processes(up.pid)
        before = {name: cpu_seconds(pid) for name, pid in procs.items()}
        bench = [sys.executable, "-m", "kvrelay", "bench", "--url", url, "--model", model_id,
                 "--rate", "inf", "--num-requests", str(args.requests), "--concurrency-limit",
                 str(args.concurrency), "--prompt-len", str(args.prompt_len), "--output-len",
                 str(args.output_len), "--no-progress", "--num-warmup", str(args.num_warmup),
                 "--json", str(out)]  # fmt: skip
        subprocess.run(bench, env=env, check=True, capture_output=True)
        after = {name: cpu_seconds(pid) for name, pid in procs.items()}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGINT)
        up.wait(60)
        log.close()
    result = json.loads(out.read_text())
    tokens = args.requests * args.output_len
    return {
        "router_ms": 1e6 * (after["router"] - before["router"]) / tokens,
        "worker_ms": 1e6 * (after["worker"] - before["worker"]) / tokens,
        "out_tok_s": float(result["output_throughput"]),
        "tpot_p50": float(result["tpot_ms"]["p50"]),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base", required=True, help="the commit measured beside the tree")
    p.add_argument("--model", required=True, help="a small checkpoint (make-tiny)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-warmup", type=int, default=2, help="untimed requests before each run")
    p.add_argument("--port", type=int, default=18760)
    p.add_argument("--worktree", default="/tmp/kvrelay-serving-base")
    p.add_argument("--build-cache", type=Path, help="keeps the base's native libraries by their "
                   "sources (engine_ab.base_tree); default: always compiled")  # fmt: skip
    args = p.parse_args()
    trees = {"base": base_tree(args.base, Path(args.worktree), args.build_cache), "tree": ROOT}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for n in range(args.rounds):
                order = list(trees) if n % 2 == 0 else list(reversed(trees))
                for i, name in enumerate(order):
                    port = args.port + 2 * n + i
                    runs[name].append(measure(trees[name], port, args, Path(tmp) / "b.json"))
                    print(name, n, json.dumps(runs[name][-1]), file=sys.stderr, flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", args.worktree])
    print("| tree | router CPU ms / 1k tokens | worker CPU ms / 1k tokens | output tok/s "
          "| TPOT p50 ms |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, rs in runs.items():
        cells = [
            statistics.median(r[k] for r in rs)
            for k in ("router_ms", "worker_ms", "out_tok_s", "tpot_p50")
        ]
        label = f"{name} ({args.base})" if name == "base" else name
        print(f"| {label} | {cells[0]:.0f} | {cells[1]:.0f} | {cells[2]:.0f} | {cells[3]:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
