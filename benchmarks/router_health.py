"""Router responsiveness under a storm of multi-megabyte prompts: /health latency, liveness.

Starts a cluster (router + 1 colocated worker of a tiny model), keeps ``--concurrency``
clients posting ``--prompt-mb`` MB completion prompts (each far over the context window, so
the router tokenizes it and refuses it: the CPU work a hostile or careless client causes)
for ``--seconds``, and meanwhile GETs ``/health`` every 20 ms on one keep-alive connection.
Reports /health latency p50/p99/max, the storm requests answered, and how often the router
declared its worker dead ("gone silent" in its log). Goal: /health p99 < 50 ms, no deaths.

To compare with another checkout (e.g. main before the change), run this script with that
checkout first on PYTHONPATH: the cluster processes inherit it, and ``--label`` names the row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
from common import command_line, markdown_table, text_table, update_benchmarks_md

import kvrelay
from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.engine.make_tiny import make_tiny

SECTION_TITLE = "Router responsiveness under multi-MB prompts"
HEADERS = (
    "code",
    "clients",
    "storm requests",
    "/health samples",
    "p50 (ms)",
    "p99 (ms)",
    "max (ms)",
    "workers declared dead",
)
REPRODUCE = "\n".join(
    (
        "PYTHONPATH=DIR python benchmarks/router_health.py --seconds 20 --label 'main df28fff "
        "(before)' --no-write",
        "python benchmarks/router_health.py --seconds 20 --label 'issue12-router (after)'",
        "python benchmarks/router_health.py --seconds 20 --concurrency 0 --label "
        "'issue12-router, no storm (noise floor)'",
    )
)
RESULTS_JSON = Path(tempfile.gettempdir()) / "kvrelay-router-health.json"


def storm(url: str, body: bytes, stop: threading.Event) -> int:
    """Posts ``body`` until ``stop``; returns the number of answers."""
    num = 0
    headers = {"Content-Type": "application/json"}
    with httpx.Client(timeout=300) as client:
        while not stop.is_set():
            client.post(url + "/v1/completions", content=body, headers=headers)
            num += 1
    return num


def probe_health(url: str, stop: threading.Event) -> list[float]:
    samples = []
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            start = time.perf_counter()
            client.get(url + "/health").raise_for_status()
            samples.append(time.perf_counter() - start)
            time.sleep(0.02)
    return samples


def run(args: argparse.Namespace, model_dir: Path, log_dir: Path) -> dict[str, object]:
    spec = ClusterSpec(
        model=str(model_dir),
        num_prefill=0,
        num_decode=0,
        num_colocated=1,
        worker_args=("--num-blocks", "256", "--threads", "1"),
        router_args=("--dead-after", str(args.dead_after)),
        log_dir=str(log_dir),
    )
    num_chars = int(args.prompt_mb * 1_000_000)
    sentence = "the quick brown fox jumps over the lazy dog. "
    text = (sentence * (num_chars // len(sentence) + 1))[:num_chars]
    body = json.dumps({"prompt": text, "max_tokens": 2}).encode()
    with Launcher(spec) as launcher:
        stop = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency + 1) as pool:
            health = pool.submit(probe_health, launcher.url, stop)
            storms = [pool.submit(storm, launcher.url, body, stop) for _ in range(args.concurrency)]
            time.sleep(args.seconds)
            stop.set()
            samples = sorted(health.result())
            num_storm = sum(f.result() for f in storms)
    router_log = "\n".join(p.read_text() for p in log_dir.glob("router*.log"))
    ms = [s * 1000 for s in samples]
    return {
        "code": args.label,
        "clients": args.concurrency,
        "storm requests": num_storm,
        "/health samples": len(ms),
        "p50 (ms)": round(statistics.median(ms), 1),
        "p99 (ms)": round(ms[min(len(ms) - 1, int(0.99 * len(ms)))], 1),
        "max (ms)": round(ms[-1], 1),
        "workers declared dead": router_log.count("gone silent"),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="this branch", help="the row's name")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-mb", type=float, default=3.9)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--dead-after", type=float, default=2.0)
    parser.add_argument(
        "--report-only", action="store_true", help="rewrite the section from earlier rows"
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print only; leave BENCHMARKS.md as it is"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    rows = json.loads(RESULTS_JSON.read_text()) if RESULTS_JSON.exists() else []
    if not args.report_only:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_tiny(Path(tmp) / "tiny", arch="llama", size="tiny", seed=0)
            log_dir = Path(tmp) / "logs"
            log_dir.mkdir()
            row = run(args, model_dir, log_dir)
        rows = [r for r in rows if r["code"] != row["code"]] + [row]
        RESULTS_JSON.write_text(json.dumps(rows))
    table = [[r[h] for h in HEADERS] for r in rows]
    print(f"kvrelay from {Path(kvrelay.__file__).parent}")
    print(text_table(HEADERS, table))
    if not args.no_write:
        body = (
            f"`clients` post {args.prompt_mb} MB completion prompts back to "
            f"back for {args.seconds:g} s (each over the context window: the router tokenizes "
            "and refuses it) while one client GETs /health every 20 ms on a keep-alive "
            f"connection. Router + 1 colocated tiny worker, `--dead-after {args.dead_after:g}`, "
            f"on {os.cpu_count()} shared CPUs (other jobs ran meanwhile). Rows accumulate "
            f"across runs in {RESULTS_JSON.name} (one per --label). Goal: p99 < 50 ms, no "
            "worker declared dead. A row of other code runs this script with that checkout "
            "first on PYTHONPATH (the before row: main at df28fff, exported with `git archive "
            "df28fff | tar -x -C DIR`, `PYTHONPATH=DIR python benchmarks/router_health.py "
            "--label ...`).\n\n"
            + markdown_table(HEADERS, table)
            + "\n\nBefore, tokenization of each prompt held the event loop (the `tokenizers` "
            "call releases the GIL while it encodes but holds it ~0.3 s per 3.9 MB at its end, "
            "and the id list was built and freed on the loop): /health answered 5 times in "
            "20 s and the router declared its worker dead twice. After, the text is encoded "
            "in a child process that sends back only the count of a prompt over the context "
            "window. What is left on the loop per request is parsing the JSON body "
            "(`json.loads` + validation, 12-35 ms per 3.9 MB here, holding the GIL), which "
            "makes the tail above the no-storm noise floor."
        )
        command = REPRODUCE if args.report_only else command_line(__file__)
        path = update_benchmarks_md(SECTION_TITLE, body, command)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
