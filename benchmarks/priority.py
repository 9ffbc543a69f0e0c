"""Priority scheduling: what an urgent request waits behind a backlog, fcfs against priority.

One colocated worker (``--max-num-seqs`` seats) gets a backlog of ``--backlog`` requests at
once (random ``--prompt-tokens``-token prompts, ``--output-tokens`` out), then, while it works
through them, ``--urgent`` short requests one every ``--gap`` seconds. Under
``--scheduling-policy fcfs`` every request has priority 0; under ``priority`` the urgent ones
have -1, so they jump the queue and preempt a backlog request for a seat. Per run: the
urgent requests' TTFT and end-to-end latency (medians), the backlog's end-to-end p50 and the
run's wall time. Policies alternate; medians over ``--rounds``.

    python benchmarks/priority.py --model /work/cache/models/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    update_benchmarks_md,
)

from kvrelay.cli.launcher import ClusterSpec, Launcher

SECTION = "Priority scheduling: an urgent request behind a backlog"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/work/cache/models/smollm2-hf")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--backlog", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--urgent", type=int, default=4)
    p.add_argument("--urgent-output-tokens", type=int, default=16)
    p.add_argument("--gap", type=float, default=0.5, help="seconds between urgent requests")
    p.add_argument("--urgent-after", type=float, default=1.0,
                   help="seconds from the backlog to the first urgent request")  # fmt: skip
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-write", action="store_true")
    return p.parse_args(argv)


def one_run(args: argparse.Namespace, policy: str) -> dict[str, float]:
    import openai

    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(7)
    backlog = [
        [rng.randrange(vocab // 100, vocab) for _ in range(args.prompt_tokens)]
        for _ in range(args.backlog)
    ]
    worker_args = (
        "--threads", str(args.threads), "--dtype", args.dtype, "--num-blocks", "2048",
        "--max-num-seqs", str(args.max_num_seqs), "--scheduling-policy", policy,
    )  # fmt: skip
    log_dir = tempfile.mkdtemp(prefix="priority-bench-")
    spec = ClusterSpec(
        model=args.model, num_prefill=0, num_decode=0, num_colocated=1, worker_args=worker_args,
        router_args=("--served-model-name", "m"), log_dir=log_dir,
    )  # fmt: skip
    launcher = Launcher(spec)
    launcher.start(timeout=300)
    done = False
    try:
        client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="x", max_retries=0)
        client.completions.create(model="m", prompt="Warm up", max_tokens=2)
        times: dict[str, list[tuple[float, float]]] = {"backlog": [], "urgent": []}
        lock = threading.Lock()

        def send(kind: str, prompt: Any, max_tokens: int, priority: int) -> None:
            start = time.perf_counter()
            stream = client.completions.create(
                model="m", prompt=prompt, max_tokens=max_tokens, stream=True, temperature=0,
                extra_body={"ignore_eos": True, "priority": priority},
            )  # fmt: skip
            chunks = iter(stream)
            next(chunks)
            first = time.perf_counter() - start
            for _ in chunks:
                pass
            with lock:
                times[kind].append((first, time.perf_counter() - start))

        urgent_priority = -1 if policy == "priority" else 0
        start = time.perf_counter()
        threads = [
            threading.Thread(target=send, args=("backlog", p, args.output_tokens, 0))
            for p in backlog
        ]
        for t in threads:
            t.start()
        time.sleep(args.urgent_after)
        for i in range(args.urgent):
            prompt = f"Urgent question {i}: what is the capital of France?"
            t = threading.Thread(
                target=send, args=("urgent", prompt, args.urgent_output_tokens, urgent_priority)
            )
            t.start()
            threads.append(t)
            time.sleep(args.gap)
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
        done = True
    finally:
        launcher.stop()
        if done:  # the cluster's logs are kept only when the run failed
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            print(f"priority: the cluster's logs are in {log_dir}", file=sys.stderr)
    return {
        "urgent_ttft": statistics.median(f for f, _ in times["urgent"]),
        "urgent_e2e": statistics.median(e for _, e in times["urgent"]),
        "backlog_e2e": statistics.median(e for _, e in times["backlog"]),
        "wall": wall,
    }


def main() -> None:
    args = parse_args()
    results: dict[str, list[dict[str, float]]] = {"fcfs": [], "priority": []}
    for r in range(args.rounds):
        for policy in ("fcfs", "priority") if r % 2 == 0 else ("priority", "fcfs"):
            result = one_run(args, policy)
            results[policy].append(result)
            print(policy, {k: round(v, 3) for k, v in result.items()}, flush=True)
    rows = []
    for policy, runs in results.items():
        med = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
        rows.append([
            policy, f"{med['urgent_ttft']:.2f}", f"{med['urgent_e2e']:.2f}",
            f"{med['backlog_e2e']:.2f}", f"{med['wall']:.2f}",
        ])  # fmt: skip
    headers = ["policy", "urgent TTFT p50 s", "urgent end-to-end p50 s", "backlog end-to-end p50 s",
               "run wall s"]  # fmt: skip
    table = markdown_table(headers, rows)
    print(table)
    if not args.no_write:
        workload = (
            f"{args.model}, {args.dtype}; one colocated worker, `--threads {args.threads}`,"
            f" `--max-num-seqs {args.max_num_seqs}`; a backlog of {args.backlog} requests of"
            f" {args.prompt_tokens} random token ids and {args.output_tokens} tokens out, sent"
            f" at once; {args.urgent_after:g} s later {args.urgent} short chat-like prompts with"
            f" {args.urgent_output_tokens} tokens out, one every {args.gap} s, at priority -1"
            f" under the priority policy (0 under fcfs); medians of {args.rounds} runs a"
            " policy, in turns."
        )
        body = f"{machine_markdown(machine_info(args.threads))}\n\n{workload}\n\n{table}\n"
        update_benchmarks_md(SECTION, body, command_line(__file__))


if __name__ == "__main__":
    main()
