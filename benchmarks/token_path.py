"""Where a streamed token's time goes between the decode engine's step and the client's socket.

Starts ``kvrelay up`` colocated (one worker, all threads) and 1P+1D (a thread each), streams
completions through the official ``openai`` client (random token prompts, outputs forced to a
length) at one and at a few requests at once, and splits the client's inter-token gap with the
cluster's own metrics, read before and after each run:

- engine step: the decode (or colocated) worker's mean ``kvrelay_engine_step_seconds``;
- worker loop + ZMQ to the router: the router's mean ``kvrelay_inter_token_latency_seconds``
  (taken as each token event arrives) less the steps a token waited for;
- router to client (detokenize, SSE, HTTP, the client's parsing): the client's mean gap less
  the router's.

Steps per token are the worker's steps over the tokens it streamed: above 1 when a token waits
for steps that were not its own (another request's prefill, colocated). Means over every gap
of every request; no timing is asserted anywhere.

    python benchmarks/token_path.py --model DIR [--dtype float32] [--write]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from common import command_line, cpu_model, markdown_table, update_benchmarks_md
from peers_serve import Server

SECTION = "Token path: engine step to the client's socket"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=12, help="per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    return parser.parse_args()


def scrape(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the named series (``_sum`` and ``_count`` of histograms) at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    totals = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals


STEP = ("kvrelay_engine_step_seconds_sum", "kvrelay_engine_step_seconds_count")
ITL = ("kvrelay_inter_token_latency_seconds_sum", "kvrelay_inter_token_latency_seconds_count")


def decode_status_url(server: Server) -> str:
    with urllib.request.urlopen(f"{server.url}/admin/instances", timeout=10) as resp:
        instances = json.load(resp)["data"]
    for inst in instances:
        if inst["role"] in ("decode", "colocated"):
            return str(inst["status_url"]).rstrip("/") + "/metrics"
    raise RuntimeError(f"{server.name}: no decode instance in {instances}")


def stream_one(client: Any, model: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each streamed chunk that carried text."""
    times = []
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    return times


def run_level(
    server: Server, args: argparse.Namespace, concurrency: int, seed: int
) -> dict[str, float]:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1000, 40000) for _ in range(args.prompt_len)] for _ in range(args.requests)
    ]
    worker_url = decode_status_url(server)
    step0, itl0 = scrape(worker_url, STEP), scrape(f"{server.url}/metrics", ITL)
    gaps: list[float] = []
    lock = threading.Lock()
    queue = list(prompts)

    def client_loop() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            times = stream_one(client, server.model_id, prompt, args.max_tokens)
            with lock:
                gaps.extend(b - a for a, b in itertools.pairwise(times))

    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    step1, itl1 = scrape(worker_url, STEP), scrape(f"{server.url}/metrics", ITL)
    steps = step1[STEP[1]] - step0[STEP[1]]
    step_mean = (step1[STEP[0]] - step0[STEP[0]]) / steps
    router_itl = (itl1[ITL[0]] - itl0[ITL[0]]) / (itl1[ITL[1]] - itl0[ITL[1]])
    client_itl = statistics.fmean(gaps)
    tokens = args.requests * args.max_tokens
    steps_per_token = steps / (tokens / concurrency)  # steps one request's token waits through
    return {
        "client_itl_ms": client_itl * 1e3,
        "client_itl_p50_ms": statistics.median(gaps) * 1e3,
        "router_itl_ms": router_itl * 1e3,
        "step_ms": step_mean * 1e3,
        "steps_per_token": steps_per_token,
        "engine_ms": step_mean * steps_per_token * 1e3,
        "worker_to_router_ms": (router_itl - step_mean * steps_per_token) * 1e3,
        "router_to_client_ms": (client_itl - router_itl) * 1e3,
    }


def main() -> int:
    args = parse_args()
    systems = {
        "kvrelay colocated": ["--colocated", "1", "--threads", str(args.threads)],
        "kvrelay 1P+1D": ["--threads", str(max(1, args.threads // 2))],
    }
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, extra) in enumerate(systems.items()):
            argv = [
                sys.executable,
                "-m",
                "kvrelay",
                "up",
                "--model",
                args.model,
                "--dtype",
                args.dtype,
            ]
            argv += ["--port", str(args.port + i), "--seed", "0", *extra]
            server = Server(name, argv, dict(os.environ), args.port + i, Path(tmp) / f"{i}.log")
            try:
                server.wait_ready()
                run_level(server, argparse.Namespace(**{**vars(args), "requests": 2}), 1, seed=99)
                results[name] = {}
                for c in args.concurrency:
                    results[name][c] = run_level(server, args, c, seed=c)
                    print(
                        name,
                        c,
                        json.dumps({k: round(v, 2) for k, v in results[name][c].items()}),
                        file=sys.stderr,
                    )
            finally:
                server.stop()
    headers = ["system", "streams", "client gap ms (mean / p50)", "router gap ms",
               "engine step ms", "steps per token", "engine ms / token",
               "worker loop + ZMQ ms", "router to client ms"]  # fmt: skip
    rows = [
        [name, c, f"{r['client_itl_ms']:.1f} / {r['client_itl_p50_ms']:.1f}",
         f"{r['router_itl_ms']:.1f}", f"{r['step_ms']:.1f}", f"{r['steps_per_token']:.2f}",
         f"{r['engine_ms']:.1f}", f"{r['worker_to_router_ms']:.1f}",
         f"{r['router_to_client_ms']:.1f}"]
        for name, by_c in results.items()
        for c, r in by_c.items()
    ]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        body = (
            f"{args.model} ({args.dtype}), {args.requests} requests per row of {args.prompt_len} "
            f"random prompt tokens and {args.max_tokens} forced output tokens, streamed through "
            f"the `openai` client over /v1/completions; CPU: {cpu_model()}; colocated: one "
            f"worker with {args.threads} threads; 1P+1D: {max(1, args.threads // 2)} thread(s) "
            f"each. See the script's docstring for how each column is taken.\n\n{table}"
        )
        update_benchmarks_md(SECTION, body, command_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
