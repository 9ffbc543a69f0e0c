"""Starts real clusters (``kvrelay serve`` processes) for tests, and checks them afterwards.

``running_cluster`` yields a started ``Launcher``; on exit it waits for every surviving
worker to go idle, asserts that none reports used or leaked KV blocks, stops the cluster
and asserts that no shared-memory segment of it remains.
"""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.transport.shm_pool import list_segments

# A long greedy stream that a fault or an exit interrupts midway (test_faults,
# test_graceful_exit): the prompt and its length; conftest's ``stream_reference`` is its text.
STREAM_PROMPT = "The cache moves to the decode worker"
STREAM_TOKENS = 400


def worker_stats(launcher: Launcher) -> dict[str, dict[str, Any]]:
    """``/stats`` of every worker the router knows, by instance id."""
    out = {}
    for inst in launcher.get_json("/admin/instances")["data"]:
        with urllib.request.urlopen(inst["status_url"] + "/stats", timeout=5) as resp:
            out[inst["instance_id"]] = json.loads(resp.read())
    return out


def wait_idle(launcher: Launcher, timeout: float = 30.0) -> dict[str, dict[str, Any]]:
    """Waits until no worker holds a request or a hand-off; returns their stats.

    A worker a test killed stays in the router's list until its heartbeats are missed for
    ``--dead-after``, and its status port refuses connections meanwhile: that is waited out
    too (within ``timeout``; a worker still listed and unreachable then fails the test)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = worker_stats(launcher)
        except urllib.error.URLError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        busy = [
            s
            for s in stats.values()
            if s["num_running"]
            or s["num_waiting"]
            or s.get("num_pending_kv")
            or s["num_used_blocks"]
        ]
        if not busy or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def decode_running(launcher: Launcher, timeout: float = 10.0) -> str:
    """The one decode worker running the stream's request, once one counts it. Under load
    (two test files at a time) one read of /stats after five tokens found the prefill worker
    still counting the request and no decode worker counting it yet."""
    deadline = time.monotonic() + timeout
    while True:
        stats = worker_stats(launcher)
        busy = [i for i, s in stats.items() if s["num_running"] and i.startswith("decode")]
        if busy:
            assert len(busy) == 1, stats
            return busy[0]
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def assert_no_leaks(launcher: Launcher) -> None:
    for instance_id, s in wait_idle(launcher).items():
        assert s["num_used_blocks"] == 0, f"{instance_id} holds blocks when idle: {s}"
        assert s["num_leaked_blocks"] == 0, f"{instance_id} leaked blocks: {s}"


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus metric's samples whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] != name:
            continue
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total


def admin_request(
    launcher: Launcher,
    path: str,
    method: str = "POST",
    body: Any = None,
    token: str | None = None,
) -> tuple[int, Any]:
    """(status, JSON body) of a router admin call; HTTP errors are returned, not raised."""
    data = b"" if body is None and method == "POST" else None
    if body is not None:
        data = json.dumps(body).encode()
    request = urllib.request.Request(launcher.url + path, data, method=method)
    request.add_header("Content-Type", "application/json")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def read_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return str(resp.read().decode())


# The two topologies a serving test runs on (a fixture's ``params``): one colocated worker, or
# one prefill and one decode worker.
TOPOLOGIES: dict[str, dict[str, int]] = {
    "colocated": {"num_prefill": 0, "num_decode": 0, "num_colocated": 1},
    "1P+1D": {"num_prefill": 1, "num_decode": 1, "num_colocated": 0},
}


@contextlib.contextmanager
def running_cluster(
    model_dir: Path,
    log_dir: Path,
    check_leaks: bool = True,
    **spec_kwargs: Any,
) -> Iterator[Launcher]:
    spec_kwargs.setdefault("worker_args", ("--num-blocks", "512", "--threads", "1"))
    spec_kwargs.setdefault("router_args", ("--dead-after", "1.5", "--served-model-name", "tiny"))
    spec = ClusterSpec(model=str(model_dir), log_dir=str(log_dir), **spec_kwargs)
    launcher = Launcher(spec)
    try:
        launcher.start(timeout=120)
        yield launcher
        if check_leaks:
            assert_no_leaks(launcher)
    finally:
        launcher.stop()
        leftover = list_segments(f"kvrelay-{launcher.cluster_id}-")
        assert leftover == [], f"shared memory left behind: {leftover}"
