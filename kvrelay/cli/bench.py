"""``kvrelay bench``: its flags, the run, and the report it prints (``kvrelay.bench`` is
the load generator and its summary)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrelay.bench import (
    BenchError,
    LoadConfig,
    RequestRecord,
    Slo,
    Summary,
    check_server,
    run_bench,
    trace_requests,
    warm_up,
)
from kvrelay.sim.trace import cap_requests, load_trace

logger = logging.getLogger(__name__)


def length_range(text: str) -> tuple[int, int]:
    """``"32:1024"`` -> ``(32, 1024)``; ``"64"`` -> ``(64, 64)``."""
    low, _, high = text.partition(":")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH token counts, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1]:
        raise argparse.ArgumentTypeError(f"need 1 <= LOW <= HIGH, got {text!r}")
    return bounds


def add_bench_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``kvrelay bench``."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root URL")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals/s (inf: all at once)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--prompt-len", type=length_range, default=(32, 1024), help="LOW:HIGH tokens")
    p.add_argument("--output-len", type=length_range, default=(32, 256), help="LOW:HIGH tokens")
    p.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")
    p.add_argument("--vocab-size", type=int, default=2000, help="prompt ids in [4, this)")
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput: TTFT at most")
    p.add_argument("--slo-tpot-ms", type=float, default=200.0, help="goodput: TPOT at most")
    p.add_argument("--concurrency-limit", type=int, default=None, help="requests in flight")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds per chunk")
    p.add_argument("--num-warmup", type=int, default=1, help="untimed requests first")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--trace", type=Path, default=None, help="replay this trace (CSV or JSONL)")
    p.add_argument("--trace-format", choices=("splitwise", "mooncake"), default=None)
    p.add_argument("--time-scale", type=float, default=1.0, help="trace gaps x this (2: half rate)")
    p.add_argument("--max-requests", type=int, default=None, help="trace: the first N requests")
    p.add_argument("--max-prompt-tokens", type=int, default=None, help="trace: cap prompts")
    p.add_argument("--max-output-tokens", type=int, default=None, help="trace: cap outputs")
    p.add_argument("--plot", type=Path, default=None, help="TTFT/TPOT plots (PNG; needs [plot])")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_cli(args: argparse.Namespace) -> int:
    """``kvrelay bench``: exit status 0 when every request completed, 1 otherwise."""
    config = LoadConfig(
        url=args.url.rstrip("/"),
        model=args.model,
        rate=args.rate,
        num_requests=args.num_requests,
        prompt_lens=args.prompt_len,
        output_lens=args.output_len,
        seed=args.seed,
        vocab_size=args.vocab_size,
        concurrency_limit=args.concurrency_limit,
        request_timeout_s=args.request_timeout,
    )
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    requests = None
    if args.trace is not None:
        trace = cap_requests(
            load_trace(args.trace, args.trace_format),
            args.max_requests,
            args.max_prompt_tokens,
            args.max_output_tokens,
            args.time_scale,
        )
        requests = trace_requests(trace, args.seed, args.vocab_size)
        config = dataclasses.replace(
            config,
            num_requests=len(requests),
            trace=str(args.trace),
            prompt_lens=(1, max(len(r.prompt_ids) for r in requests)),
            output_lens=(1, max(r.output_len for r in requests)),
        )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    try:
        check_server(config)
        warm_up(config, args.num_warmup)
    except BenchError as exc:
        logger.error("%s", exc)
        return 1
    summary, records = run_bench(config, slo, not args.no_progress, requests)
    print(report(config, summary))
    if args.plot is not None:
        from kvrelay.sim.plots import plot_bench

        plot_bench(records, slo, args.plot)
    if args.json is not None:
        data = result_json(config, summary, records)
        args.json.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return 0 if summary.num_failed == 0 else 1


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A fixed-width text table; the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *([str(c) for c in row] for row in rows)]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        padded = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        return "  ".join(padded)

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(row) for row in cells[1:])])


def report(config: LoadConfig, summary: Summary) -> str:
    """The terminal report of one run."""
    s = summary
    rows = [
        [name, *(f"{v:.1f}" for v in (st.mean, st.p50, st.p90, st.p99))]
        for name, st in (("TTFT (ms)", s.ttft_ms), ("TPOT (ms)", s.tpot_ms), ("E2E (ms)", s.e2e_ms))
        if st is not None
    ]
    lines = [
        f"{s.num_completed}/{s.num_requests} completed, {s.num_failed} failed "
        f"in {s.duration_s:.1f} s ("
        + (f"trace {config.trace}" if config.trace else f"rate {config.rate:g} req/s")
        + f", seed {config.seed})",
        format_table(("metric", "mean", "p50", "p90", "p99"), rows),
        f"request throughput  {s.request_throughput:.3f} req/s",
        f"output throughput   {s.output_throughput:.1f} tok/s",
        f"goodput             {s.goodput:.3f} req/s  "
        f"(TTFT <= {s.slo_ttft_ms:g} ms and TPOT <= {s.slo_tpot_ms:g} ms)",
        f"SLO attainment      {100 * s.slo_attainment:.1f} %",
    ]
    lines += [f"failed x{n}: {message}" for message, n in s.errors.items()]
    return "\n".join(lines)


def result_json(
    config: LoadConfig, summary: Summary, records: Sequence[RequestRecord]
) -> dict[str, Any]:
    """Everything of one run as JSON-ready data: config, summary fields, per-request records."""
    per_request = [asdict(r) | {"tpot_s": r.tpot_s if r.is_ok else None} for r in records]
    return {"config": asdict(config), **asdict(summary), "requests": per_request}
