"""Scale-up benchmark, measurements: part 1 (a new worker's start to its first token, per
mode), part 2 (pool attach alone) and part 3 (chain multicast to N receivers)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
from common import median, wait_for_quiet_cpu
from scale_up_setup import (
    SERVED_NAME,
    START_TIMEOUT_S,
    BenchError,
    Checkpoint,
    bench_environ,
    evict_page_cache,
    pool_server,
    read_line,
    running_cluster,
    stop_process,
)

from kvrelay.cli.launcher import Launcher, free_port
from kvrelay.transport.rate_limit import mbps_to_bytes_per_s

MODES = ("disk", "build", "pool", "peer")
MODE_FLAGS = {"disk": ("--no-param-pool",), "build": (), "pool": (), "peer": ("--param-peers",)}
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_WEIGHTS_LOGGED = re.compile(r"(built|filled) parameter pool \S+ .* in ([\d.]+) s")
POOL_EVENT = {"disk": None, "build": "built", "pool": None, "peer": "filled"}  # logged by mode
RECEIVER_CODE = """\
import json, os, sys, time
from kvrelay.cachetier.param_transfer import fetch_pool
from kvrelay.engine.identity import model_identity
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.transport.curve import SocketSecurity
model, dtype, scope, link = sys.argv[1:5]
fingerprint = model_identity(model, dtype)
print("ready", flush=True)
line = sys.stdin.readline()  # the start signal: where to forward from, whom to fetch from
start = time.time()
order = json.loads(line)
got = fetch_pool(fingerprint, dtype, order["sources"], scope=scope, forward_bind=order["bind"],
                 timeout=60.0, link_bytes_per_s=float(link),
                 security=SocketSecurity(ClusterCredential.load()))
print(json.dumps({"start": start, "end": time.time(), "seconds": got.seconds,
                  "sources": list(got.sources_used)}), flush=True)
sys.stdin.readline()  # forward until the benchmark closes stdin
got.server.close()
got.pool.close()
os._exit(0)  # all closed: no interpreter finalization (~1 s of each exit with torch loaded)
"""


# ---------------------------------------------------------------------------- part 1


@dataclass(frozen=True, slots=True)
class StartRun:
    model: str
    mode: str
    repeat: int
    instance: str
    first_token_s: float  # add_worker -> first streamed token
    joined_s: float  # add_worker -> the router lists the instance
    ready_s: float | None  # add_worker -> the worker's "ready" log line
    weights_logged_s: float | None  # the pool build / peer fill the worker logged
    resident_bytes: int | None  # checkpoint bytes in the page cache at the start


def first_token(url: str, prompt: str) -> float:
    """Streams a 1-token completion; returns the ``time.time()`` of its first token."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": 1, "stream": True}
    first = None
    timeout = httpx.Timeout(START_TIMEOUT_S)
    with (
        httpx.Client(base_url=url, timeout=timeout) as client,
        client.stream("POST", "/v1/completions", json=body) as resp,
    ):
        if resp.status_code != 200:
            resp.read()
            raise BenchError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        for line in resp.iter_lines():
            data = line[5:].strip() if line.startswith("data:") else ""
            if data and data != "[DONE]":
                if "error" in json.loads(data):
                    raise BenchError(f"error event: {data[:300]}")
                first = first or time.time()
    if first is None:
        raise BenchError("the stream carried no token")
    return first


def wait_joined(launcher: Launcher, name: str) -> float:
    """Polls the router until it lists ``name``; returns the ``time.time()`` it did."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if name in (launcher.joined_instances() or set()):
            return time.time()
        code = launcher.procs[name].popen.poll()
        if code is not None:
            raise BenchError(f"{name} exited with code {code}; see {launcher.spec.log_dir}")
        time.sleep(0.01)
    raise BenchError(f"{name} did not join in {START_TIMEOUT_S:.0f} s")


def log_facts(log: Path, name: str) -> tuple[float | None, str | None, float | None]:
    """From a worker's log: the ``time.time()`` of its "ready" line, and the pool event it
    logged ("built" from disk, "filled" from a peer, or None) with its seconds."""
    ready = event = weights = None
    for line in log.read_text(errors="replace").splitlines():
        if (match := _WEIGHTS_LOGGED.search(line)) is not None:
            event, weights = match.group(1), float(match.group(2))
        stamp = _LOG_TIME.match(line)
        if stamp and f" {name} ready: " in line:
            fmt = "%Y-%m-%d %H:%M:%S,%f"
            ready = datetime.datetime.strptime(stamp.group(1), fmt).timestamp()
    return ready, event, weights


def device_query_tokens(url: str) -> dict[str, int]:
    resp = httpx.get(url + "/admin/cache/stats", timeout=10.0)
    resp.raise_for_status()
    instances = resp.json()["instances"].items()
    return {i: int(s["tiers"].get("device", {}).get("query_tokens", 0)) for i, s in instances}


def retire(launcher: Launcher, name: str) -> None:
    """Drains ``name`` (the router places nothing more there) and stops it."""
    resp = httpx.post(f"{launcher.url}/admin/instances/{name}/drain", timeout=10.0)
    if resp.status_code != 200:
        raise BenchError(f"drain {name}: HTTP {resp.status_code}: {resp.text[:300]}")
    launcher.kill(name, signal.SIGTERM)


def start_one(
    launcher: Launcher, ckpt: Checkpoint, mode: str, repeat: int, flags: Sequence[str]
) -> StartRun:
    """Adds a prefill worker and times it to its first served token (see the module doc)."""
    resident = evict_page_cache(ckpt.path)
    start = time.time()
    name = launcher.add_worker("prefill", ["--model", str(ckpt.path), *flags])
    joined = wait_joined(launcher, name)
    done = first_token(launcher.url, f"Scale-up probe: {name} starts from {mode}.")
    if device_query_tokens(launcher.url).get(name, 0) <= 0:
        raise BenchError(f"the probe was not prefilled by {name}")
    ready, event, weights = log_facts(Path(launcher.spec.log_dir or ".") / f"{name}.log", name)
    if event != POOL_EVENT[mode]:
        raise BenchError(f"{mode}: {name} logged pool event {event!r}, not {POOL_EVENT[mode]!r}")
    return StartRun(
        ckpt.name, mode, repeat, name, done - start, joined - start,
        None if ready is None else ready - start, weights, resident,
    )  # fmt: skip


def set_host_pool(ckpt: Checkpoint, is_wanted: bool) -> None:
    """Makes the host's pool of ``ckpt`` exist (built here, untimed) or not."""
    from kvrelay.cachetier import param_ops, param_pool

    if is_wanted:
        param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype).close()
    else:
        param_ops.remove(ckpt.host_pool)  # PoolBusy if a worker still holds it


def run_starts(
    ckpt: Checkpoint, peer: Callable[[], str], args: argparse.Namespace, log_dir: Path
) -> list[StartRun]:
    """Every mode ``args.repeats`` times on one cluster; ``peer``: the pool server's address."""
    from kvrelay.cachetier import param_ops

    runs = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: param_ops.remove(ckpt.host_pool, force=True))
        launcher = stack.enter_context(running_cluster(ckpt, args, log_dir))
        current = "prefill-0"
        first_token(launcher.url, "Warm-up: the decode worker's first step.")
        for repeat in range(args.repeats):
            for mode in args.modes:
                retire(launcher, current)
                set_host_pool(ckpt, is_wanted=mode == "pool")
                if args.quiet_wait > 0:
                    wait_for_quiet_cpu(args.quiet_wait, threshold=0.15)
                flags = [*MODE_FLAGS[mode], *([peer()] if mode == "peer" else [])]
                run = start_one(launcher, ckpt, mode, repeat, flags)
                current = run.instance
                runs.append(run)
                print(
                    f"{ckpt.name} {mode} #{repeat + 1}: first token {run.first_token_s:.2f} s "
                    f"(joined {run.joined_s:.2f} s)",
                    flush=True,
                )
        retire(launcher, current)
    return runs


# ---------------------------------------------------------------------------- part 2


@dataclass(frozen=True, slots=True)
class AttachResult:
    model: str
    pool_bytes: int
    attach_ms: tuple[float, ...]  # ParamPool.attach_or_create on a ready pool, then close
    fingerprint_ms: float  # median of model_identity alone (part of every attach)
    disk_load_s: tuple[float, ...]  # load_weights with the checkpoint evicted


def timings(fn: Callable[[], object], repeats: int) -> tuple[float, ...]:
    out = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return tuple(out)


def measure_attach(ckpt: Checkpoint, args: argparse.Namespace) -> AttachResult:
    import torch

    from kvrelay.cachetier import param_ops, param_pool
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.identity import model_identity
    from kvrelay.engine.loader import load_weights

    torch.set_num_threads(1)  # as the workers
    scope = f"attach{os.getpid()}"
    pool = param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype, scope=scope)
    try:
        total = pool.total_bytes

        def attach() -> None:
            param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype, scope=scope).close()

        attach()  # warm-up
        attach_s = timings(attach, args.attach_repeats)
        fp_s = timings(lambda: model_identity(ckpt.path, ckpt.dtype), args.attach_repeats)
    finally:
        pool.close()
        param_ops.remove(ckpt.scoped_pool(scope), force=True)
    config = ModelConfig.from_dir(ckpt.path)
    loads = []
    for _ in range(args.repeats):
        evict_page_cache(ckpt.path)
        start = time.perf_counter()
        load_weights(ckpt.path, config, ckpt.dtype)  # freed at once
        loads.append(time.perf_counter() - start)
    attach_ms = tuple(1e3 * s for s in attach_s)
    return AttachResult(ckpt.name, total, attach_ms, 1e3 * median(fp_s), tuple(loads))


def measure_import(repeats: int) -> float:
    """Median seconds for a fresh interpreter to import what a prefill worker imports (and
    no more: it exits without the interpreter's finalization, as a worker does)."""
    code = "import os, kvrelay.cli, kvrelay.worker.serve, kvrelay.prefill.worker; os._exit(0)"
    return median(
        timings(lambda: subprocess.run([sys.executable, "-c", code], check=True), repeats)
    )


# ---------------------------------------------------------------------------- part 3


@dataclass(frozen=True, slots=True)
class ChainRun:
    num_receivers: int
    repeat: int
    last_done_s: float  # the start signal -> the last receiver's pool ready
    fetch_s: tuple[float, ...]  # each receiver's own fetch_pool seconds, in chain order
    sources: tuple[tuple[str, ...], ...]  # each receiver's sources used
    is_chain: bool  # every receiver pulled from its predecessor alone
    link_mbps: float = 0.0  # each server's send limit (origin and forwarding receivers); 0: none


def pick_chain_model(ckpts: Sequence[Checkpoint], max_receivers: int) -> Checkpoint:
    """The largest checkpoint whose origin + receivers' pools fit in 70% of free memory."""
    free = _mem_available()
    fits = [c for c in ckpts if c.num_bytes * (max_receivers + 1) < 0.7 * free]
    if not fits:
        raise BenchError(f"no model's {max_receivers + 1} pools fit in {free / 2**30:.1f} GiB")
    return max(fits, key=lambda c: c.num_bytes)


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


Receivers = tuple[str, list[subprocess.Popen[bytes]]]  # (tag, processes) of one chain run


def start_receivers(
    ckpt: Checkpoint, num_receivers: int, log_dir: Path, link_mbps: float = 0.0
) -> Receivers:
    """Starts ``num_receivers`` receiver processes, each forwarding at most ``link_mbps``
    (0: unlimited), and returns at once: they import and fingerprint the model, print
    "ready" and wait for their start line (``run_chain``)."""
    link = mbps_to_bytes_per_s(link_mbps)
    tag = f"c{os.getpid()}n{num_receivers}{uuid.uuid4().hex[:6]}"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(log_dir / f"{tag}.log", "ab") as log:
            for k in range(num_receivers):
                argv = [ckpt.path, ckpt.dtype, f"{tag}k{k}", link]
                cmd = [sys.executable, "-c", RECEIVER_CODE, *map(str, argv)]
                pipe = subprocess.PIPE
                procs.append(
                    subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=log, env=bench_environ())
                )
    except BaseException:
        end_receivers(ckpt, (tag, procs))
        raise
    return tag, procs


def wait_receivers_ready(receivers: Receivers) -> None:
    for k, proc in enumerate(receivers[1]):
        read_line(proc, START_TIMEOUT_S, f"receiver {k}")


def end_receivers(ckpt: Checkpoint, receivers: Receivers) -> None:
    """Stops the receivers and removes their pools; idempotent."""
    from kvrelay.cachetier import param_ops

    tag, procs = receivers
    for proc in procs:  # EOF: a receiver that is done closes its pool and exits
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10.0)
        stop_process(proc)
    for k in range(len(procs)):
        param_ops.remove(ckpt.scoped_pool(f"{tag}k{k}"), force=True)


def run_chain(
    ckpt: Checkpoint,
    origin: str,
    receivers: Receivers,
    repeat: int,
    args: argparse.Namespace,
    link_mbps: float = 0.0,
) -> ChainRun:
    """One chain multicast from ``origin`` to ``receivers`` (``start_receivers`` with
    ``link_mbps``, ready); ends them."""
    from kvrelay.transport.chain_wire import plan_chain

    procs = receivers[1]
    try:
        addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in procs]
        plan = plan_chain(origin, addrs)
        if args.quiet_wait > 0:
            wait_for_quiet_cpu(args.quiet_wait, threshold=0.15)
        go = time.time()
        for proc, addr in zip(procs, addrs):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps({"bind": addr, "sources": plan[addr]}).encode() + b"\n")
            proc.stdin.flush()
        done = [json.loads(read_line(p, START_TIMEOUT_S, "receiver")) for p in procs]
    finally:
        end_receivers(ckpt, receivers)
    sources = tuple(tuple(d["sources"]) for d in done)
    return ChainRun(
        len(procs), repeat, max(d["end"] for d in done) - go,
        tuple(d["seconds"] for d in done), sources,
        all(s == (plan[a][0],) for s, a in zip(sources, addrs)), link_mbps,
    )  # fmt: skip


def link_conditions(args: argparse.Namespace) -> list[float]:
    """The chain's conditions in Mbps: unlimited (0) first, then ``--link-mbps`` if set."""
    return [0.0] + ([args.link_mbps] if args.link_mbps > 0 else [])


def run_chains(ckpt: Checkpoint, args: argparse.Namespace, log_dir: Path) -> list[ChainRun]:
    """Every chain size ``args.repeats`` times per link condition, each condition from its
    own origin (``kvrelay pool serve --link-mbps``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    runs = []
    for link_mbps in link_conditions(args):
        scope = f"origin{os.getpid()}l{link_mbps:g}".replace(".", "_")
        with (
            pool_server(ckpt, scope, log_dir, link_mbps) as origin,
            contextlib.ExitStack() as stack,
        ):
            for repeat in range(args.repeats):
                # every chain size's receivers start together (the first repeat's with the
                # origin): their imports share the cores instead of taking turns; all are
                # ready, idle on stdin, before the first measured chain
                started = [start_receivers(ckpt, n, log_dir, link_mbps) for n in args.receivers]
                for receivers in started:
                    stack.callback(end_receivers, ckpt, receivers)
                for receivers in started:
                    wait_receivers_ready(receivers)
                for n, receivers in zip(args.receivers, started):
                    run = run_chain(ckpt, origin(), receivers, repeat, args, link_mbps)
                    runs.append(run)
                    print(
                        f"chain {ckpt.name} to {n} ({link_label(link_mbps)}) #{repeat + 1}: "
                        f"{run.last_done_s:.2f} s ({'chain' if run.is_chain else 'FAILOVER'})",
                        flush=True,
                    )
    return runs


def link_label(link_mbps: float) -> str:
    return f"{link_mbps:g} Mbps per server" if link_mbps > 0 else "unlimited (loopback)"
