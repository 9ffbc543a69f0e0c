"""Where a streamed token's time goes between the decode engine's step and the client's socket.

Starts ``kvrelay up`` colocated (one worker, all threads) and 1P+1D (a thread each), streams
completions through the official ``openai`` client (random token prompts, outputs forced to a
length) at one and at a few streams at once, and splits the client's mean gap between two
tokens of a request with the cluster's own metrics, read before and after each run:

- router to client (detokenize, SSE, HTTP, the client's parsing): the client's mean gap less
  the router's mean ``kvrelay_inter_token_latency_seconds`` (taken as token events arrive);
- engine: the mean of the decode (or colocated) worker's decode-only steps,
  ``kvrelay_engine_step_seconds{kind="decode"}``;
- the rest: the router's gap less that step: the worker loop, ZMQ and the router's loop, and
  what else a token waits for between two decode steps: a mixed step that also computes a new
  request's prompt chunk (colocated; their share and mean are shown) or the decode worker's
  KV intake (1P+1D). With one stream there is neither, so the rest is the serving path alone.

Means over every gap of every request; no timing is asserted anywhere.

    python benchmarks/token_path.py --model DIR [--dtype float32] [--write]
    python benchmarks/token_path.py --like DIR --device cuda --dtype bfloat16 --json t.json
    python benchmarks/token_path.py --render t.json   # BENCHMARKS.md from a run elsewhere

``--like DIR`` serves DIR's config and tokenizer with random weights (a GPU machine that cannot
hold the real checkpoint); on a GPU the table goes to its own section.
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

import torch
from common import command_line, cpu_model, markdown_table, update_benchmarks_md
from peers_serve import Server

SECTION = "Token path: engine step to the client's socket"
SECTION_GPU = "Token path on a GPU: engine step to the client's socket"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model", help="a checkpoint directory")
    model.add_argument("--like", type=Path, help="DIR's config and tokenizer, random weights")
    model.add_argument("--render", type=Path, help="only write BENCHMARKS.md from this --json")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", help="the workers' --device (cpu, cuda)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=12, help="per concurrency level")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--port", type=int, default=18400)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    return parser.parse_args()


def scrape(url: str, name: str, label: str = "") -> dict[str, float]:
    """Sums of the series of metric ``name`` at ``url``, by the value of ``label`` ("" when
    not given or absent)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or line.split("{", 1)[0].split(" ", 1)[0] != name:
            continue
        key = ""
        if label and f'{label}="' in line:
            key = line.split(f'{label}="', 1)[1].split('"', 1)[0]
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


STEP = "kvrelay_engine_step_seconds"
ITL = "kvrelay_inter_token_latency_seconds"


def steps(url: str) -> dict[str, tuple[float, float]]:
    """kind -> (seconds, count) of the worker's engine steps so far."""
    sums, counts = scrape(url, STEP + "_sum", "kind"), scrape(url, STEP + "_count", "kind")
    return {kind: (sums[kind], counts.get(kind, 0.0)) for kind in sums}


def router_itl(url: str) -> tuple[float, float]:
    return scrape(url, ITL + "_sum").get("", 0.0), scrape(url, ITL + "_count").get("", 0.0)


def decode_status_url(server: Server, timeout: float = 300.0) -> str:
    """The /metrics URL of the cluster's decode (or colocated) worker, once it registered."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{server.url}/admin/instances", timeout=10) as resp:
            instances = json.load(resp)["data"]
        for inst in instances:
            if inst["role"] in ("decode", "colocated"):
                return str(inst["status_url"]).rstrip("/") + "/metrics"
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.name}: no decode instance in {instances}")
        time.sleep(1)


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
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    prompts = [
        [rng.randrange(vocab // 50, vocab) for _ in range(args.prompt_len)]
        for _ in range(args.requests)
    ]
    worker_url = decode_status_url(server)
    steps0, itl0 = steps(worker_url), router_itl(f"{server.url}/metrics")
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
    steps1, itl1 = steps(worker_url), router_itl(f"{server.url}/metrics")

    def delta(kind: str) -> tuple[float, float]:
        (s1, n1), (s0, n0) = steps1.get(kind, (0.0, 0.0)), steps0.get(kind, (0.0, 0.0))
        return s1 - s0, n1 - n0

    (dec_s, dec_n), (mix_s, mix_n) = delta("decode"), delta("mixed")
    router = (itl1[0] - itl0[0]) / (itl1[1] - itl0[1])
    client = statistics.fmean(gaps)
    engine = dec_s / dec_n
    return {
        "client_ms": client * 1e3,
        "client_p50_ms": statistics.median(gaps) * 1e3,
        "router_ms": router * 1e3,
        "mixed_step_ms": mix_s / mix_n * 1e3 if mix_n else 0.0,
        "mixed_share": mix_n / (dec_n + mix_n),
        "engine_ms": engine * 1e3,
        "worker_to_router_ms": (router - engine) * 1e3,
        "router_to_client_ms": (client - router) * 1e3,
    }


def main() -> int:
    args = parse_args()
    if args.render:
        write_section(json.loads(args.render.read_text()))
        return 0
    systems = {
        "kvrelay colocated": ["--colocated", "1", "--threads", str(args.threads)],
        "kvrelay 1P+1D": ["--threads", str(max(1, args.threads // 2))],
    }
    results: dict[str, dict[int, dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if args.like:
            from gpu_decode import random_checkpoint

            dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(
                args.dtype, torch.float32
            )
            (Path(tmp) / "model").mkdir()
            args.model = str(random_checkpoint(args.like, Path(tmp) / "model", dtype))
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
                "--device",
                args.device,
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
    if args.device.startswith("cuda"):
        machine = f"GPU: {torch.cuda.get_device_name(args.device)} (torch {torch.__version__})"
    else:
        machine = f"CPU: {cpu_model()}"
    what = f"{args.like.name} shapes, random weights" if args.like else args.model
    run = {
        "results": results,
        "intro": (
            f"{what} ({args.dtype}), {args.requests} requests per row of {args.prompt_len} "
            f"random prompt tokens and {args.max_tokens} forced output tokens, streamed through "
            f"the `openai` client over /v1/completions; {machine}; colocated: one worker with "
            f"{args.threads} threads; 1P+1D: {max(1, args.threads // 2)} thread(s) each. See "
            "the script's docstring for how each column is taken."
        ),
        "section": SECTION_GPU if args.device.startswith("cuda") else SECTION,
        "command": command_line(),
    }
    if args.json:
        args.json.write_text(json.dumps(run, indent=1))
    print(table_of(results))
    if args.write:
        write_section(run)
    return 0


def table_of(results: dict[str, Any]) -> str:
    headers = ["system", "streams", "client gap ms (mean / p50)", "router to client ms",
               "router gap ms", "decode step ms", "steps with a prompt chunk (mean ms)",
               "rest: loop, ZMQ, router, other work ms"]  # fmt: skip
    rows = [
        [name, c, f"{r['client_ms']:.1f} / {r['client_p50_ms']:.1f}",
         f"{r['router_to_client_ms']:.2f}", f"{r['router_ms']:.1f}", f"{r['engine_ms']:.2f}",
         f"{r['mixed_share']:.0%} ({r['mixed_step_ms']:.0f})", f"{r['worker_to_router_ms']:.2f}"]
        for name, by_c in results.items()
        for c, r in by_c.items()
    ]  # fmt: skip
    return markdown_table(headers, rows)


def write_section(run: dict[str, Any]) -> None:
    body = f"{run['intro']}\n\n{table_of(run['results'])}"
    update_benchmarks_md(run["section"], body, run["command"])


if __name__ == "__main__":
    raise SystemExit(main())
