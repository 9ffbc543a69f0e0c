"""Prefix cache benchmark, clusters: one measured pass per configuration (off, L1, L1+L2),
each on a fresh cluster; for L1+L2, the Redis warm-up on A and the cold instance B."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from common import REPO_ROOT, wait_for_quiet_cpu
from prefix_cache_workload import (
    REQUEST_TIMEOUT_S,
    SERVED_NAME,
    BenchError,
    TurnResult,
    Workload,
    run_workload,
    stream_chat,
)

from kvrelay.cli.launcher import ClusterSpec, Launcher

WARM_UP = "Hi"


# ---------------------------------------------------------------------------- clusters


@contextlib.contextmanager
def running_cluster(
    model_dir: Path,
    args: argparse.Namespace,
    log_dir: Path,
    worker_args: Sequence[str] = (),
    cluster_id: str = "",
) -> Iterator[Launcher]:
    common = (
        *("--threads", str(args.threads), "--num-blocks", str(args.num_blocks)),
        *("--dtype", args.dtype),
    )
    spec = ClusterSpec(
        model=str(model_dir),
        num_prefill=1,
        num_decode=1,
        cluster_id=cluster_id,
        worker_args=(*common, *worker_args),
        router_args=("--served-model-name", SERVED_NAME),
        log_dir=str(log_dir),
    )
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=300)
        yield launcher
    finally:
        launcher.stop()


def measure(url: str, workload: Workload, args: argparse.Namespace) -> list[TurnResult]:
    """One measured pass, after a warm-up request and a wait for idle CPUs (none with
    ``--quiet-wait 0``)."""
    warm_up(url)
    if args.quiet_wait > 0:
        wait_for_quiet_cpu(args.quiet_wait, threshold=0.1)
    return run_workload(url, workload)


def warm_up(url: str) -> None:
    """One short request (untimed), so that no measured request pays for a worker's first
    forward pass; without a system message, it shares no KV block with the workload."""
    with httpx.Client(base_url=url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:
        stream_chat(client, [{"role": "user", "content": WARM_UP}], 4)


def run_off(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    off = ("--no-prefix-caching", "--host-pool", "off")
    with running_cluster(model_dir, args, log_dir, off) as launcher:
        return measure(launcher.url, workload, args)


def run_l1(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    with running_cluster(model_dir, args, log_dir) as launcher:
        return measure(launcher.url, workload, args)


def run_l1_l2(
    model_dir: Path, workload: Workload, args: argparse.Namespace, log_dir: Path
) -> list[TurnResult]:
    """Warms A (and Redis), then measures on a cold B while A is drained."""
    sys.path.insert(0, str(REPO_ROOT))
    from tests.redis_server import RedisServer

    log_dir.mkdir(parents=True, exist_ok=True)
    server = RedisServer(log_dir, maxmemory=args.redis_memory)
    server.start()
    cluster_id = f"pc{os.getpid()}-{uuid.uuid4().hex[:6]}"  # both pools swept at stop
    host_a = ("--redis-url", server.url, "--host-pool", f"kvrelay-{cluster_id}-hostA")
    try:
        with running_cluster(model_dir, args, log_dir, host_a, cluster_id) as launcher:
            [warm] = [n for n, p in launcher.procs.items() if p.role == "prefill"]
            run_workload(launcher.url, workload)
            # B starts while Redis's write-behind queue empties (no request runs meanwhile)
            cold = launcher.add_worker("prefill", ["--host-pool", f"kvrelay-{cluster_id}-hostB"])
            wait_for_write_behind(launcher.url, server)
            launcher.wait_ready(timeout=300, names=[cold])
            drain(launcher.url, warm)
            before = device_queries(launcher.url)
            results = measure(launcher.url, workload, args)
            check_served_by(cold, warm, before, device_queries(launcher.url))
            return results
    finally:
        server.stop()


def redis_queue_depths(url: str) -> list[int]:
    resp = httpx.get(url + "/admin/cache/stats", timeout=10.0)
    resp.raise_for_status()
    return [
        int(inst["tiers"]["redis"].get("queue_depth", 0))
        for inst in resp.json()["instances"].values()
        if "redis" in inst["tiers"]
    ]


def wait_for_write_behind(url: str, server: Any, timeout_s: float = 120.0) -> int:
    """Waits until every worker's Redis queue is empty and the key count stops changing."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        depths = redis_queue_depths(url)
        with server.client() as client:
            num_keys = int(client.dbsize())
        if depths and not any(depths) and num_keys == last and num_keys > 0:
            return num_keys
        last = num_keys
        time.sleep(0.5)
    raise BenchError(f"Redis write-behind did not finish in {timeout_s:.0f}s")


def drain(url: str, instance_id: str) -> None:
    resp = httpx.post(f"{url}/admin/instances/{instance_id}/drain", timeout=10.0)
    if resp.status_code != 200:
        raise BenchError(f"drain {instance_id}: HTTP {resp.status_code}: {resp.text[:300]}")


def device_queries(url: str) -> dict[str, int]:
    """Prompt tokens each instance has looked up in its device cache so far."""
    resp = httpx.get(url + "/admin/cache/stats", timeout=10.0)
    resp.raise_for_status()
    instances = resp.json()["instances"].items()
    return {i: int(s["tiers"].get("device", {}).get("query_tokens", 0)) for i, s in instances}


def check_served_by(cold: str, warm: str, before: dict[str, int], after: dict[str, int]) -> None:
    """Raises unless the measured pass was prefilled by the cold instance alone."""
    if after.get(warm) != before.get(warm) or not after.get(cold, 0) > before.get(cold, 0):
        raise BenchError(f"the pass was not served by {cold} alone: {before} -> {after}")


RUNNERS = {"off": run_off, "L1": run_l1, "L1+L2": run_l1_l2}
