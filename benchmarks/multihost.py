"""KV hand-off and serving latency across hosts: network namespaces with tbf-shaped links.

Three hosts on a private bridge (tests/netns_harness.py): the router on host 0, a prefill on
host 1, a decode on host 2, each with its own /dev/shm, so the KV hand-off goes over TCP.

1. **Hand-off vs link rate**: host 1's egress (the KV flows prefill -> decode) shaped with tbf
   to each rate; long random prompts (no prefix hits), 2 output tokens; the decode's own
   transfer counters (``kvrelay_kv_transfer_{bytes_total,seconds}``) give the achieved rate.
2. **1P+1D across hosts vs on one host**: the same streamed requests (TTFT, TPOT) with prefill
   and decode on two hosts (tcp, unshaped veth) and on one host (shm).

Run as root on Linux (namespaces); results go to BENCHMARKS.md:

    python benchmarks/multihost.py --model models/smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import command_line, markdown_table, update_benchmarks_md

from kvrelay.cli.launcher import free_port
from kvrelay.protocol.credential import ClusterCredential
from tests.cluster_harness import metric_value
from tests.netns_harness import Host, Hosts, netns_unavailable, wait_for

SECTION = "KV hand-off across hosts (network namespaces, tbf)"
RATES = ("1gbit", "10gbit", "25gbit")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = resp.read()
    return json.loads(body) if url.endswith(("instances", "stats")) else body.decode()


def _post(url: str, body: dict[str, Any], timeout: float = 300) -> dict[str, Any]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


class Cluster:
    def __init__(self, hosts: Hosts, model: str, logs: Path, threads: int) -> None:
        self.hosts, self.model, self.logs, self.threads = hosts, model, logs, threads
        self.router_host = hosts[0]
        self.port, self.control = free_port(), free_port()
        self.url = f"http://{self.router_host.addr}:{self.port}"
        self.procs: list[Any] = []
        secret = ClusterCredential.generate().hex()  # every process holds it (not in argv)
        self.env = {**os.environ, "KVRELAY_CLUSTER_SECRET": secret}

    def start(self, prefill: Host, decode: Host) -> None:
        h = self.router_host
        self.procs.append(h.kvrelay(
            ["serve", "--role", "router", "--model", self.model, "--host", h.addr,
             "--port", str(self.port), "--control-addr", f"tcp://{h.addr}:{self.control}",
             "--served-model-name", "m"], self.logs / "router.log", self.env,
        ))  # fmt: skip
        for role, host in (("prefill", prefill), ("decode", decode)):
            self.procs.append(host.kvrelay(
                ["serve", "--role", role, "--model", self.model, "--host", host.addr,
                 "--advertise-host", host.addr, "--host-id", f"host{host.index}",
                 "--instance-id", role, "--control-addr", f"tcp://{h.addr}:{self.control}",
                 "--threads", str(self.threads), "--kv-cache-memory", "1.5",
                 "--no-prefix-caching", "--host-pool", "off"], self.logs / f"{role}.log",
                self.env,
            ))  # fmt: skip
        wait_for(lambda: self._joined() >= {"prefill", "decode"}, 180, "workers joined")

    def _joined(self) -> set[str]:
        try:
            return {d["instance_id"] for d in _get(self.url + "/admin/instances")["data"]}
        except OSError:
            return set()

    def stop(self) -> None:
        for popen in self.procs:
            self.hosts.stop_process(popen)
        self.procs.clear()

    def decode_metrics(self) -> str:
        data = _get(self.url + "/admin/instances")["data"]
        (decode,) = [d for d in data if d["instance_id"] == "decode"]
        return _get(decode["status_url"] + "/metrics")

    def complete(self, prompt_ids: list[int], max_tokens: int) -> dict[str, Any]:
        body = {"model": "m", "prompt": prompt_ids, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        return _post(self.url + "/v1/completions", body)

    def stream(self, prompt_ids: list[int], max_tokens: int) -> tuple[float, float]:
        """(TTFT, mean time per output token after the first), seconds."""
        body = {"model": "m", "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        req = urllib.request.Request(
            self.url + "/v1/completions", json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )  # fmt: skip
        start = time.perf_counter()
        stamps = []
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                if line.startswith(b"data: {"):
                    stamps.append(time.perf_counter())
        ttft = stamps[0] - start
        tpot = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1)
        return ttft, tpot


def _transfer_totals(metrics: str) -> tuple[float, float, float]:
    num_bytes = metric_value(metrics, "kvrelay_kv_transfer_bytes_total", transport="tcp")
    seconds = metric_value(metrics, "kvrelay_kv_transfer_seconds_sum", transport="tcp")
    count = metric_value(metrics, "kvrelay_kv_transfer_seconds_count", transport="tcp")
    return num_bytes, seconds, count


def _random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def handoff_vs_rate(args: argparse.Namespace, logs: Path) -> list[list[Any]]:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    with Hosts(3) as hosts:
        cluster = Cluster(hosts, args.model, logs, args.threads)
        cluster.start(hosts[1], hosts[2])
        try:
            cluster.complete(_random_prompts(1, 64, vocab, 0)[0], 2)  # warm-up
            for i, rate in enumerate((*RATES, "unshaped")):
                if rate != "unshaped":
                    burst = "4mb" if rate != "1gbit" else "512kb"
                    hosts[1].shape(rate, burst=burst, latency="200ms")
                else:
                    hosts[1].shape("100gbit", burst="64mb", latency="200ms")
                before = _transfer_totals(cluster.decode_metrics())
                for prompt in _random_prompts(args.requests, args.prompt_tokens, vocab, i + 1):
                    cluster.complete(prompt, 2)
                after = _transfer_totals(cluster.decode_metrics())
                num_bytes, seconds, count = (a - b for a, b in zip(after, before))
                gbit = num_bytes * 8 / seconds / 1e9 if seconds else 0.0
                link = "none (veth)" if rate == "unshaped" else rate.replace("gbit", " Gbit/s")
                share = "" if rate == "unshaped" else f"{100 * gbit / float(rate[:-4]):.0f}%"
                rows.append([
                    link, int(count), f"{num_bytes / max(count, 1) / 2**20:.1f}",
                    f"{1000 * seconds / max(count, 1):.1f}", f"{gbit:.2f}", share,
                ])  # fmt: skip
                print(rows[-1], flush=True)
        finally:
            cluster.stop()
    return rows


def across_vs_one(args: argparse.Namespace, logs: Path) -> list[list[Any]]:
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rows = []
    for label, placement in (("one host (shm)", (1, 1)), ("two hosts (tcp)", (1, 2))):
        with Hosts(3) as hosts:
            cluster = Cluster(hosts, args.model, logs, args.threads)
            cluster.start(hosts[placement[0]], hosts[placement[1]])
            try:
                cluster.complete(_random_prompts(1, 64, vocab, 99)[0], 2)  # warm-up
                samples = [
                    cluster.stream(p, args.output_tokens)
                    for p in _random_prompts(args.requests, args.serve_prompt_tokens, vocab, 7)
                ]
            finally:
                cluster.stop()
        ttfts = sorted(1000 * s[0] for s in samples)
        tpots = sorted(1000 * s[1] for s in samples)
        rows.append([
            label, len(samples), f"{statistics.median(ttfts):.0f}", f"{ttfts[-1]:.0f}",
            f"{statistics.median(tpots):.1f}", f"{tpots[-1]:.1f}",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    parser.add_argument("--requests", type=int, default=6, help="requests per measurement")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="hand-off prompts")
    parser.add_argument("--serve-prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--logs", default="/tmp/kvrelay-multihost-bench")
    parser.add_argument("--no-write", action="store_true", help="do not touch BENCHMARKS.md")
    args = parser.parse_args()
    reason = netns_unavailable()
    if reason:
        print(f"multihost: {reason}", file=sys.stderr)
        return 2
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    handoff = handoff_vs_rate(args, logs)
    serving = across_vs_one(args, logs)
    model = Path(args.model).resolve().name
    load = Path("/proc/loadavg").read_text().split()[:3]
    body = (
        f"Model: `{model}` (float32), {args.prompt_tokens}-token random prompts (no prefix "
        f"hits), 2 output tokens, {args.requests} requests per row, {args.threads} torch "
        f"thread(s) per worker; router, prefill and decode each in a network namespace with "
        f"its own /dev/shm on one 2-core VM; the prefill host's egress shaped with `tc tbf`. "
        f"Achieved = KV bytes / the decode's pull time (its `kvrelay_kv_transfer_*` counters: "
        f"request, copy, XXH64 verify). Load average at the end: {' / '.join(load)}.\n\n"
        + markdown_table(
            ["link (tbf)", "pulls", "MiB / pull", "ms / pull", "achieved Gbit/s", "of link"],
            handoff,
        )
        + f"\n\n1P+1D serving, {args.serve_prompt_tokens}-token prompts, "
        f"{args.output_tokens} output tokens, requests one at a time (ms):\n\n"
        + markdown_table(
            ["prefill / decode", "requests", "TTFT p50", "TTFT max", "TPOT p50", "TPOT max"],
            serving,
        )
    )
    if not args.no_write:
        update_benchmarks_md(SECTION, body, command_line())
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
