"""Prefix cache: multi-turn chat with a shared system prompt, tiers off vs L1 vs L1+L2.

Workload (deterministic): a system prompt of about ``--system-tokens`` tokens (measured with
the model's tokenizer) shared by ``--users`` users, each holding a chat of ``--turns`` turns.
Every turn sends the user's whole history (the system prompt, the earlier questions and the
replies the server gave) plus a new question, and asks for ``--output-tokens`` tokens (greedy,
eos ignored), so TTFT dominates. Requests go one at a time (concurrency 1) in a fixed
interleaved order: turn 1 of users 1..U, then turn 2 of users 1..U, and so on.

Configurations, each on a freshly started cluster (router, 1 prefill and 1 decode worker):

- ``off``: ``--no-prefix-caching --host-pool off`` on every worker: every prompt token is
  computed;
- ``L1``: prefix caching on (device blocks) and the L1 host shared-memory pool (the default);
- ``L1+L2``: a Redis L2 as well, read from a cold instance. The workload runs once on prefill
  A (unmeasured: it fills A's device cache, host A's L1 and Redis); prefill B starts with an
  L1 pool of its own (another host: cold device cache, cold L1); once Redis's write-behind
  queue is empty and B has joined, A is drained, and the same workload runs again, measured,
  all on B.

Each measured pass follows one untimed warm-up request (no system message: it shares no block
with the workload). ``--repeats`` passes per configuration, each on its own cluster, are
pooled. TTFT is client-side: from sending the request to the first streamed chunk that carries
text. Prefill tokens computed = prompt tokens - cached tokens, summed over the requests.

    python benchmarks/prefix_cache.py                 # small model; writes BENCHMARKS.md
    python benchmarks/prefix_cache.py --size tiny --users 2 --turns 2 --system-tokens 200 \\
        --no-write
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from common import (
    add_model_args,
    command_line,
    machine_info,
    model_label,
    section_title,
    text_table,
    update_benchmarks_md,
    write_json,
)
from prefix_cache_clusters import RUNNERS
from prefix_cache_report import (
    HEADERS,
    Summary,
    markdown_body,
    summarize,
    table_rows,
    tier_notes,
    verdict_lines,
)
from prefix_cache_workload import TurnResult, create_workload

from kvrelay.bench import percentile

SECTION_TITLE = "Prefix cache: multi-turn chat with a shared system prompt"
CONFIGS = ("off", "L1", "L1+L2")
logger = logging.getLogger("prefix_cache_bench")


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1500, help="shared system prompt")
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="passes per configuration, pooled")
    p.add_argument(
        "--configs",
        type=lambda text: [c.strip() for c in text.split(",") if c.strip()],
        default=list(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)}",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--redis-memory", default="1gb", help="redis-server --maxmemory")
    p.add_argument("--quiet-wait", type=float, default=60.0, help="max s to wait for idle CPUs")
    p.add_argument("--log-dir", default=None, help="cluster logs (default: a temporary dir)")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = p.parse_args(argv)
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {', '.join(CONFIGS)}")
    counts = (args.users, args.turns, args.system_tokens, args.output_tokens, args.repeats)
    if min(counts) < 1 or args.threads < 1:
        p.error("--users, --turns, --system-tokens, --output-tokens, --repeats, --threads >= 1")
    return args


def run_all(args: argparse.Namespace, model_dir: Path, model: str) -> int:
    workload = create_workload(model_dir, args)
    print(
        f"system prompt: {workload.num_system_tokens} tokens; {workload.num_users} users x "
        f"{workload.num_turns} turns; {args.repeats} pass(es) per configuration",
        flush=True,
    )
    load_start = os.getloadavg()[0]
    passes: dict[str, list[list[TurnResult]]] = {c: [] for c in args.configs}
    for repeat in range(args.repeats):
        for config in args.configs:
            log_dir = Path(args.log_dir) / f"{config.replace('+', '-')}-{repeat}"
            results = RUNNERS[config](model_dir, workload, args, log_dir)
            passes[config].append(results)
            ttft = percentile([r.ttft_s * 1e3 for r in results], 50)
            print(f"{config} pass {repeat + 1}: TTFT p50 {ttft:,.0f} ms", flush=True)
    load = (load_start, os.getloadavg()[0])
    summaries = [summarize(c, passes[c]) for c in args.configs]
    print()
    print(text_table(HEADERS, table_rows(summaries)))
    print()
    for line in [*verdict_lines(summaries), *tier_notes(summaries)]:
        print(line)
    info = machine_info(args.threads)
    if args.json:
        write_json(
            args.json,
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "workload": asdict(workload),
                "machine": info,
                "load_average": load,
                "summaries": [asdict(s) for s in summaries],
                "passes": {c: [[asdict(r) for r in p] for p in ps] for c, ps in passes.items()},
            },
        )
    if not args.no_write:
        body = markdown_body(args, workload, model, summaries, info, load)
        title = section_title(SECTION_TITLE, args.model_dir, args.size, args.dtype)
        path = update_benchmarks_md(title, body, command_line())
        print(f"\nwrote section {title!r} of {path}")
    return 0 if l2_was_read(summaries) else 1


def l2_was_read(summaries: Sequence[Summary]) -> bool:
    """False (and an error logged) when L1+L2 ran but no hit came from Redis."""
    for s in summaries:
        if s.config == "L1+L2" and not s.cached_tokens_by_tier.get("redis"):
            logger.error("L1+L2: the cold instance read nothing from Redis: %s", s)
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. under nohup) unwinds like Ctrl-C, so every started cluster is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvrelay-prefix-bench-") as tmp:
        if args.log_dir is None:
            args.log_dir = str(Path(tmp) / "logs")
        if args.model_dir is not None:
            return run_all(args, args.model_dir, model_label(args.model_dir))
        from kvrelay.engine.make_tiny import make_tiny

        model_dir = make_tiny(Path(tmp) / args.size, arch="llama", size=args.size)
        return run_all(args, model_dir, model_label(None, args.size))


if __name__ == "__main__":
    sys.exit(main())
