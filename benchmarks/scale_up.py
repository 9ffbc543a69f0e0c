"""Scale-up: start an instance to its first served token, weights from disk vs pool vs peer.

Part 1, per model, on one cluster (router, 1 prefill and 1 decode worker, ``--threads 1``):
for each mode, retire the current prefill worker (drain, SIGTERM), evict the checkpoint from
the page cache, start one prefill worker with the mode's flags and time from ``add_worker``
to the first streamed token of a 1-token completion that only it can serve (checked with
its device-cache counters; its log must show the pool event the mode expects). Modes, in
this order in every repeat:

- ``disk``: ``--no-param-pool``, the weights come from the checkpoint;
- ``build``: the first instance on a host: no pool yet, it builds the host's pool from disk;
- ``pool``: the host's pool is ready (built by the previous worker): attach;
- ``peer``: no pool on this host; ``--param-peers`` names a ``kvrelay pool serve`` of the
  same model under another ``--scope`` (another host, emulated on this one), so the worker
  fills this host's pool over ZMQ (TCP loopback) instead of reading the disk.

The cluster's router and original workers load a byte copy of the checkpoint (same name and
fingerprint, other files) with ``--no-param-pool``: they never hold the host's pool, and no
running process maps the measured files, so ``posix_fadvise(DONTNEED)`` really evicts them
(``fincore`` checks). The breakdown: ``ready`` (the worker's "ready" log line), ``joined``
(the router lists it), and the weights' time, logged by the worker for ``build`` / ``peer``
and measured in this process for ``disk`` (``load_weights``, file evicted) and ``pool``.

Part 2: ``ParamPool.attach_or_create`` alone on a ready pool, ``--attach-repeats`` times
(goal: under 100 ms and flat in model size).

Part 3: chain multicast of the largest pool whose copies fit in memory, from the same
``kvrelay pool serve`` (after that model's starts) to 1, 2, 4 receivers, each a process with
its own scope that forwards while it fills (``plan_chain`` order). Receivers start, import
and fingerprint the model, then all start fetching at one signal; the time is from the
signal to the last receiver's pool ready (goal: 4 receivers under 1.5x the time of 1).
Two conditions, each with its own origin: unlimited (loopback TCP as fast as the CPUs go:
every "host" shares this machine's cores, so the run is CPU-bound) and link-limited
(``--link-mbps``: the origin and every forwarding receiver send at most that rate, a token
bucket per server as one NIC per host; ``--link-mbps 0`` leaves this condition out).

Checkpoints: make_tiny ``small`` / ``medium`` (float32), and a random Llama of 1.0B
parameters (TinyLlama's shape, the small tokenizer's vocabulary, bfloat16) written once into
``--cache-dir`` and kept there. Each run links them into a temporary directory with a
per-run key in ``config.json``, so the run's pool names collide with no other process's.
Before each timed start or chain, the script waits up to ``--quiet-wait`` s for idle CPUs.

    python benchmarks/scale_up.py               # small, medium, 1b; writes BENCHMARKS.md
    python benchmarks/scale_up.py --quick --no-write
    python benchmarks/scale_up.py --chain-only --no-write --json out.json   # part 3 alone
    python benchmarks/scale_up.py --render out.json    # report a saved --json again
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import logging
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    median,
    text_table,
    update_benchmarks_md,
    wait_for_quiet_cpu,
    write_json,
)

from kvrelay.cluster.launcher import ClusterSpec, Launcher, free_port
from kvrelay.transport.rate_limit import mbps_to_bytes_per_s

SECTION_TITLE = "Scale-up: start to first token (disk vs host pool vs peer) and chain multicast"
SERVED_NAME = "bench"
MODELS = ("tiny", "small", "medium", "1b")
MODES = ("disk", "build", "pool", "peer")
MODE_FLAGS = {"disk": ("--no-param-pool",), "build": (), "pool": (), "peer": ("--param-peers",)}
GOAL_ATTACH_MS = 100.0
GOAL_FLAT = 2.0  # "flat": the slowest model's attach within this factor of the fastest's
GOAL_CHAIN_RATIO = 1.5
DEFAULT_LINK_MBPS = 400.0  # the modelled link: well below this machine's aggregate / 4
ONE_B_SHAPE = {  # TinyLlama-1.1B's shape; with the small tokenizer's 8,192 rows: 1.00B params
    "hidden_size": 2048,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "head_dim": 64,
}
NONCE_KEY = "kvrelay_bench_run"  # the per-run key in config.json (the loader ignores it)
START_TIMEOUT_S = 600.0
_LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_WEIGHTS_LOGGED = re.compile(r"(built|filled) parameter pool \S+ .* in ([\d.]+) s")
POOL_EVENT = {"disk": None, "build": "built", "pool": None, "peer": "filled"}  # logged by mode
RECEIVER_CODE = """\
import json, sys, time
from kvrelay.cachetier.param_transfer import fetch_pool
from kvrelay.engine.loader import model_fingerprint
model, dtype, scope, bind, sources, link = sys.argv[1:7]
fingerprint = model_fingerprint(model)
print("ready", flush=True)
sys.stdin.readline()
start = time.time()
got = fetch_pool(fingerprint, dtype, sources.split(","), scope=scope, forward_bind=bind,
                 timeout=60.0, link_bytes_per_s=float(link))
print(json.dumps({"start": start, "end": time.time(), "seconds": got.seconds,
                  "sources": list(got.sources_used)}), flush=True)
sys.stdin.readline()  # forward until the benchmark closes stdin
got.server.close()
got.pool.close()
"""


class BenchError(RuntimeError):
    """A process, request or pool did not reach the state a measurement needs."""


# ---------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True, slots=True)
class Checkpoint:
    name: str  # tiny | small | medium | 1b
    path: Path  # what measured instances load (no other process maps its files)
    twin: Path  # a byte copy in other files, for the cluster's router and original workers
    dtype: str  # the dtype it is served in (and its pools hold)
    fingerprint: str  # hex of ``model_fingerprint``: unique to this run (see the module doc)
    num_params: int
    num_bytes: int  # the runtime weights in ``dtype``

    @property
    def host_pool(self) -> str:
        """The host-wide (unscoped) pool a worker of this checkpoint uses."""
        return self.scoped_pool("")

    def scoped_pool(self, scope: str) -> str:
        from kvrelay.cachetier.param_pool import pool_name

        return pool_name(bytes.fromhex(self.fingerprint), self.dtype, scope)


def write_1b(cache_dir: Path) -> Path:
    """The 1B checkpoint in ``cache_dir``, written there once (2 GB, about a minute)."""
    key = hashlib.blake2b(json.dumps(ONE_B_SHAPE, sort_keys=True).encode(), digest_size=4)
    out = cache_dir / f"kvrelay-scale-up-1b-{key.hexdigest()}"
    if (out / "model.safetensors").is_file():
        return out
    if shutil.disk_usage(cache_dir).free < 6 << 30:  # the checkpoint, then a copy per run
        raise BenchError(f"{cache_dir} has under 6 GiB free for the 1B checkpoint: --skip-1b")
    print(f"writing the 1B checkpoint to {out} (kept for later runs)", flush=True)
    tmp = cache_dir / f"{out.name}.tmp-{os.getpid()}"
    try:
        _write_1b_files(tmp)
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_1b_files(out: Path) -> None:
    import torch
    from safetensors.torch import save_file

    from kvrelay.engine.make_tiny import make_tiny

    config = json.loads((make_tiny(out, size="small") / "config.json").read_text())
    config.update(ONE_B_SHAPE, dtype="bfloat16")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    h, inter = ONE_B_SHAPE["hidden_size"], ONE_B_SHAPE["intermediate_size"]
    kv = ONE_B_SHAPE["num_key_value_heads"] * ONE_B_SHAPE["head_dim"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], h), "model.norm.weight": (h,)}
    shapes["lm_head.weight"] = (config["vocab_size"], h)
    for i in range(ONE_B_SHAPE["num_hidden_layers"]):
        a, m, n = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp.", f"model.layers.{i}."
        shapes |= {a + "q_proj.weight": (h, h), a + "k_proj.weight": (kv, h)}
        shapes |= {a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, h)}
        shapes |= {m + "gate_proj.weight": (inter, h), m + "up_proj.weight": (inter, h)}
        shapes |= {m + "down_proj.weight": (h, inter)}
        shapes |= {n + "input_layernorm.weight": (h,), n + "post_attention_layernorm.weight": (h,)}
    gen = torch.Generator().manual_seed(0)
    tensors = {
        name: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=gen) * 0.02).bfloat16()
        for name, s in shapes.items()
    }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def link_checkpoint(src: Path, dst: Path, nonce: str) -> Path:
    """``dst``: hard links to ``src``'s files and a ``config.json`` carrying ``nonce``."""
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.name != "config.json":
            try:
                os.link(path, dst / path.name)
            except OSError:  # another filesystem
                os.symlink(path.resolve(), dst / path.name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, NONCE_KEY: nonce}, indent=2))
    return dst


def prepare_checkpoints(names: Sequence[str], work: Path, cache: Path) -> list[Checkpoint]:
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import model_fingerprint
    from kvrelay.engine.make_tiny import make_tiny

    nonce = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    out = []
    for name in names:
        if name == "1b":
            src, dtype = write_1b(cache), "bfloat16"
        else:
            src, dtype = make_tiny(work / f"{name}-src", size=name), "float32"
        path = link_checkpoint(src, work / name, nonce)
        twin = shutil.copytree(path, work / "twin" / name)  # same name, fingerprint, bytes
        num_params = count_params(path)
        item = 2 if dtype == "bfloat16" else 4
        ModelConfig.from_dir(path)  # fails here, not in a worker, on a bad config
        fingerprint = model_fingerprint(path).hex()
        out.append(Checkpoint(name, path, twin, dtype, fingerprint, num_params, num_params * item))
    return out


def count_params(model_dir: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118


def evict_page_cache(model_dir: Path) -> int | None:
    """Drops the checkpoint's weight files from the page cache (``posix_fadvise``: this
    file's pages only, no root, nothing else on the machine goes cold); returns the bytes
    still resident per ``fincore``, or None where fincore is missing."""
    from kvrelay.engine.loader import weight_files

    files = weight_files(model_dir)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages cannot be dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None:
        return None
    cmd = ["fincore", "--json", "--bytes", *map(str, files)]
    result = json.loads(subprocess.run(cmd, capture_output=True, check=True, text=True).stdout)
    return sum(int(row["res"]) for row in result["fincore"])


# ---------------------------------------------------------------------------- processes


def read_line(proc: subprocess.Popen[bytes], timeout_s: float, what: str) -> str:
    """The next stdout line of ``proc`` (read byte by byte: nothing past it is consumed)."""
    assert proc.stdout is not None
    fd, line, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{what}: no output after {timeout_s:.0f} s")
        if select.select([fd], [], [], left)[0]:
            byte = os.read(fd, 1)
            if not byte:
                raise BenchError(f"{what} exited with code {proc.wait()}")
            line += byte
    return line.decode().strip()


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def pool_server(
    ckpt: Checkpoint, scope: str, log_dir: Path, link_mbps: float = 0.0
) -> Iterator[Callable[[], str]]:
    """Starts ``kvrelay pool serve`` of ``ckpt`` under ``scope`` (sending at most
    ``link_mbps``, 0: unlimited); yields a function that waits for it and returns its
    address. Stops it and removes its pool at exit."""
    from kvrelay.cachetier import param_pool

    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "kvrelay", "pool", "serve", "--model", str(ckpt.path),
        "--dtype", ckpt.dtype, "--bind", "tcp://127.0.0.1:0", "--scope", scope,
        "--link-mbps", str(link_mbps),
    ]  # fmt: skip
    with open(log_dir / f"pool-serve-{scope}.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log)
    addr: list[str] = []

    def address() -> str:
        if not addr:  # "<pool>: serving at tcp://127.0.0.1:PORT"
            addr.append(read_line(proc, START_TIMEOUT_S, "kvrelay pool serve").split()[-1])
        return addr[0]

    try:
        yield address
    finally:
        stop_process(proc)
        param_pool.remove(ckpt.scoped_pool(scope), force=True)


@contextlib.contextmanager
def running_cluster(
    ckpt: Checkpoint, args: argparse.Namespace, log_dir: Path
) -> Iterator[Launcher]:
    worker_args = ("--threads", "1", "--dtype", ckpt.dtype, "--num-blocks", str(args.num_blocks))
    spec = ClusterSpec(
        model=str(ckpt.twin),
        worker_args=worker_args,
        router_args=("--served-model-name", SERVED_NAME, "--dead-after", "30"),
        log_dir=str(log_dir),
    )
    launcher = Launcher(spec)
    try:
        launcher.start_router()
        for role in ("prefill", "decode"):
            launcher.add_worker(role, ["--no-param-pool"])
        launcher.wait_ready(START_TIMEOUT_S)
        yield launcher
    finally:
        launcher.stop()


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
    from kvrelay.cachetier import param_pool

    if is_wanted:
        param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype).close()
    else:
        param_pool.remove(ckpt.host_pool)  # PoolBusy if a worker still holds it


def run_starts(
    ckpt: Checkpoint, peer: Callable[[], str], args: argparse.Namespace, log_dir: Path
) -> list[StartRun]:
    """Every mode ``args.repeats`` times on one cluster; ``peer``: the pool server's address."""
    from kvrelay.cachetier import param_pool

    runs = []
    with contextlib.ExitStack() as stack:
        stack.callback(lambda: param_pool.remove(ckpt.host_pool, force=True))
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
    fingerprint_ms: float  # median of model_fingerprint alone (part of every attach)
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

    from kvrelay.cachetier import param_pool
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.loader import load_weights, model_fingerprint

    torch.set_num_threads(1)  # as the workers
    scope = f"attach{os.getpid()}"
    pool = param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype, scope=scope)
    try:
        total = pool.total_bytes

        def attach() -> None:
            param_pool.ParamPool.attach_or_create(ckpt.path, ckpt.dtype, scope=scope).close()

        attach()  # warm-up
        attach_s = timings(attach, args.attach_repeats)
        fp_s = timings(lambda: model_fingerprint(ckpt.path), args.attach_repeats)
    finally:
        pool.close()
        param_pool.remove(ckpt.scoped_pool(scope), force=True)
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
    """Median seconds for a fresh interpreter to import what a prefill worker imports."""
    code = "import kvrelay.cli, kvrelay.cluster.serve, kvrelay.prefill.worker"
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


def run_chain(
    ckpt: Checkpoint,
    origin: str,
    num_receivers: int,
    repeat: int,
    args: argparse.Namespace,
    log_dir: Path,
    link_mbps: float = 0.0,
) -> ChainRun:
    """One chain multicast from ``origin`` to ``num_receivers`` new receiver processes, each
    forwarding at most ``link_mbps`` (0: unlimited)."""
    from kvrelay.cachetier import param_pool
    from kvrelay.transport.chain import plan_chain

    link = mbps_to_bytes_per_s(link_mbps)
    tag = f"c{os.getpid()}n{num_receivers}{uuid.uuid4().hex[:6]}"
    addrs = [f"tcp://127.0.0.1:{free_port()}" for _ in range(num_receivers)]
    plan = plan_chain(origin, addrs)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(log_dir / f"{tag}.log", "ab") as log:
            for k, addr in enumerate(addrs):
                argv = [ckpt.path, ckpt.dtype, f"{tag}k{k}", addr, ",".join(plan[addr]), link]
                cmd = [sys.executable, "-c", RECEIVER_CODE, *map(str, argv)]
                pipe = subprocess.PIPE
                procs.append(subprocess.Popen(cmd, stdin=pipe, stdout=pipe, stderr=log))
        for k, proc in enumerate(procs):
            read_line(proc, START_TIMEOUT_S, f"receiver {k}")
        if args.quiet_wait > 0:
            wait_for_quiet_cpu(args.quiet_wait, threshold=0.15)
        go = time.time()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
        done = [json.loads(read_line(p, START_TIMEOUT_S, "receiver")) for p in procs]
    finally:
        for proc in procs:  # EOF: a receiver that is done closes its pool and exits
            with contextlib.suppress(OSError):
                assert proc.stdin is not None
                proc.stdin.close()
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
            stop_process(proc)
        for k in range(num_receivers):
            param_pool.remove(ckpt.scoped_pool(f"{tag}k{k}"), force=True)
    sources = tuple(tuple(d["sources"]) for d in done)
    return ChainRun(
        num_receivers, repeat, max(d["end"] for d in done) - go,
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
        with pool_server(ckpt, scope, log_dir, link_mbps) as origin:
            for repeat in range(args.repeats):
                for n in args.receivers:
                    run = run_chain(ckpt, origin(), n, repeat, args, log_dir, link_mbps)
                    runs.append(run)
                    print(
                        f"chain {ckpt.name} to {n} ({_link(link_mbps)}) #{repeat + 1}: "
                        f"{run.last_done_s:.2f} s ({'chain' if run.is_chain else 'FAILOVER'})",
                        flush=True,
                    )
    return runs


# ---------------------------------------------------------------------------- report


def _med(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return median(present) if present else None


def _s(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:,.0f}"


def _params(num: int) -> str:
    return f"{num / 1e9:.2f}B" if num >= 1e9 else f"{num / 1e6:.0f}M"


START_HEADERS = (
    "model", "params", "weights MiB", "mode", "start -> first token p50 (s)", "min - max (s)",
    "vs disk", "worker ready (s)", "router lists it (s)", "first token after join (s)",
    "weights (s)",
)  # fmt: skip


def weight_seconds(mode: str, runs: Sequence[StartRun], attach: AttachResult | None) -> str:
    """The weights' share: logged by the worker (build, peer) or measured here (disk, pool)."""
    if mode in ("build", "peer"):
        return _s(_med([r.weights_logged_s for r in runs]))
    if attach is None:
        return "-"
    if mode == "disk":
        return _s(median(attach.disk_load_s)) + " (a)"
    return _s(median(attach.attach_ms) / 1e3, 3) + " (b)"


def start_rows(
    ckpts: Sequence[Checkpoint], starts: Sequence[StartRun], attach: dict[str, AttachResult]
) -> list[list[Any]]:
    rows = []
    for c in ckpts:
        by_mode = {m: [r for r in starts if r.model == c.name and r.mode == m] for m in MODES}
        disk = _med([r.first_token_s for r in by_mode["disk"]])
        for mode, runs in by_mode.items():
            if not runs:
                continue
            total = median([r.first_token_s for r in runs])
            after_join = median([r.first_token_s - r.joined_s for r in runs])
            spread = [r.first_token_s for r in runs]
            rows.append([
                c.name, _params(c.num_params), f"{_mib(c.num_bytes)} ({c.dtype})", mode,
                _s(total), f"{min(spread):.2f} - {max(spread):.2f}",
                "-" if disk is None else f"{disk / total:.2f}x",
                _s(_med([r.ready_s for r in runs])), _s(median([r.joined_s for r in runs])),
                _s(after_join),
                weight_seconds(mode, runs, attach.get(c.name)),
            ])  # fmt: skip
    return rows


ATTACH_HEADERS = (
    "model", "pool MiB", "attach p50 (ms)", "min (ms)", "max (ms)", "fingerprint (ms)",
    "disk load (s)", "disk load / attach",
)  # fmt: skip


def attach_rows(results: Sequence[AttachResult]) -> list[list[Any]]:
    rows = []
    for a in results:
        p50 = median(a.attach_ms)
        rows.append([
            a.model, _mib(a.pool_bytes), _s(p50), _s(min(a.attach_ms)), _s(max(a.attach_ms)),
            _s(a.fingerprint_ms), _s(median(a.disk_load_s)),
            f"{median(a.disk_load_s) * 1e3 / p50:,.0f}x",
        ])  # fmt: skip
    return rows


CHAIN_HEADERS = (
    "link", "receivers", "start -> last done p50 (s)", "min (s)", "max (s)", "vs 1 receiver",
    "per-receiver fetch p50 (s)", "pool GB/s delivered", "chain order kept",
)  # fmt: skip


def _link(link_mbps: float) -> str:
    return f"{link_mbps:g} Mbps per server" if link_mbps > 0 else "unlimited (loopback)"


def by_link(runs: Sequence[ChainRun]) -> dict[float, list[ChainRun]]:
    """Chain runs per link condition, unlimited (0) first."""
    return {m: [r for r in runs if r.link_mbps == m] for m in sorted({r.link_mbps for r in runs})}


def chain_p50(runs: Sequence[ChainRun]) -> dict[int, float]:
    """Median start -> last done per receiver count, of one link condition's runs."""
    counts = sorted({r.num_receivers for r in runs})
    return {n: median([r.last_done_s for r in runs if r.num_receivers == n]) for n in counts}


def chain_rows(ckpt: Checkpoint, runs: Sequence[ChainRun]) -> list[list[Any]]:
    return [row for group in by_link(runs).values() for row in _chain_rows(ckpt, group)]


def _chain_rows(ckpt: Checkpoint, runs: Sequence[ChainRun]) -> list[list[Any]]:
    p50s = chain_p50(runs)
    base = p50s.get(1)
    rows = []
    for n, p50 in p50s.items():
        mine = [r for r in runs if r.num_receivers == n]
        each = [median([r.fetch_s[k] for r in mine]) for k in range(n)]
        rows.append([
            _link(mine[0].link_mbps), n, _s(p50), _s(min(r.last_done_s for r in mine)),
            _s(max(r.last_done_s for r in mine)),
            "-" if base is None else f"{p50 / base:.2f}x", " / ".join(_s(v) for v in each),
            _s(n * ckpt.num_bytes / p50 / 1e9), f"{sum(r.is_chain for r in mine)}/{len(mine)}",
        ])  # fmt: skip
    return rows


def verdicts(
    attach: Sequence[AttachResult],
    starts: Sequence[StartRun],
    chain: Sequence[ChainRun],
    chain_bytes: int = 0,
) -> list[str]:
    lines = [attach_verdict(attach)] if attach else []
    lines += [start_verdict(model, starts) for model in dict.fromkeys(r.model for r in starts)]
    for group in by_link(chain).values():
        sizes = {r.num_receivers for r in group}
        if 1 in sizes and len(sizes) > 1:
            lines.append(chain_verdict(group, chain, chain_bytes))
    return lines


def attach_verdict(attach: Sequence[AttachResult]) -> str:
    p50 = {a.model: median(a.attach_ms) for a in attach}
    slowest, fastest = max(p50.values()), min(p50.values())
    sizes = [a.pool_bytes for a in attach]
    return (
        f"- Pool attach: {', '.join(f'{m} {v:.1f} ms' for m, v in p50.items())} (p50); "
        f"goal < {GOAL_ATTACH_MS:.0f} ms: {'met' if slowest < GOAL_ATTACH_MS else 'MISSED'}. "
        f"Flat in size: the pools span {max(sizes) / min(sizes):.0f}x in bytes, attach "
        f"{slowest / fastest:.2f}x in time (goal <= {GOAL_FLAT:.0f}x): "
        f"{'met' if slowest / fastest <= GOAL_FLAT else 'MISSED'}."
    )


def start_verdict(model: str, starts: Sequence[StartRun]) -> str:
    t = {
        m: _med([r.first_token_s for r in starts if r.model == model and r.mode == m])
        for m in MODES
    }
    parts = ", ".join(f"{m} {v:.2f} s" for m, v in t.items() if v is not None)
    gain = ""
    if t["disk"] and t["pool"]:
        saved = t["disk"] - t["pool"]
        what = f"{saved:.2f} s less" if saved >= 0 else f"{-saved:.2f} s more"
        gain = f"; the host pool takes {what} than disk ({t['disk'] / t['pool']:.2f}x)"
    return f"- {model}, start to first token: {parts}{gain}."


def chain_verdict(group: Sequence[ChainRun], chain: Sequence[ChainRun], num_bytes: int) -> str:
    """The goal's verdict for one link condition (``group``) and why, from the numbers: the
    pool bytes delivered per second summed over receivers, against the link and against the
    unlimited runs (``chain``) of the same ``num_bytes`` pool."""
    p50s = chain_p50(group)
    most, link_mbps = max(p50s), group[0].link_mbps
    ratio = p50s[most] / p50s[1]
    rate = {n: n * num_bytes / t / 1e9 for n, t in p50s.items()}  # GB/s, all receivers
    text = (
        f"- Chain, {_link(link_mbps)}: {most} receivers in {p50s[most]:.2f} s vs 1 in "
        f"{p50s[1]:.2f} s = {ratio:.2f}x (goal < {GOAL_CHAIN_RATIO}x): "
        f"{'met' if ratio < GOAL_CHAIN_RATIO else 'MISSED'}"
    )
    if link_mbps == 0:
        if rate[most] < 0.75 * most * rate[1]:
            return text + (
                f". CPU-bound: {most} receivers together take in {rate[most]:.2f} GB/s, one "
                f"alone {rate[1]:.2f} GB/s, so every hop's receive, checksum and write queues "
                "on the same cores (see the notes)."
            )
        return text + ". The hops overlap: the CPUs did not set the time at this size."
    link_gbs = mbps_to_bytes_per_s(link_mbps) / 1e9
    text += (
        f". One transfer at the link is {num_bytes / 1e9 / link_gbs:.2f} s; {most} receivers "
        f"take in {rate[most]:.2f} GB/s together ({most} x {link_gbs:.3f} GB/s links = "
        f"{most * link_gbs:.2f} GB/s)"
    )
    unlimited = chain_p50([r for r in chain if r.link_mbps == 0])
    cpu_gbs = most * num_bytes / unlimited[most] / 1e9 if most in unlimited else None
    if cpu_gbs is not None:
        text += f", against the {cpu_gbs:.2f} GB/s the CPUs reached unlimited"
    if ratio < GOAL_CHAIN_RATIO:
        return text + (
            ": the link, not the CPUs, sets the time, and the chain adds "
            f"{p50s[most] - p50s[1]:.2f} s for {most - 1} more hop(s), forwarding chunks as "
            "they arrive."
        )
    if cpu_gbs is not None and rate[most] > 0.75 * cpu_gbs:
        return text + ": still CPU-bound, the link rate is too close to this machine's limit."
    return text + (
        f": neither the link nor the CPUs explain the {p50s[most] - p50s[1]:.2f} s the extra "
        "hops add; see the per-receiver times."
    )


def describe(
    settings: dict[str, Any], ckpts: Sequence[Checkpoint], chain_ckpt: Checkpoint | None
) -> str:
    models = "; ".join(
        f"`{c.name}` {c.num_params:,} params in {c.dtype} ({_mib(c.num_bytes)} MiB)" for c in ckpts
    )
    repeats, blocks = settings["repeats"], settings["num_blocks"]
    text = (
        f"Models: {models}. `small` and `medium` are make_tiny llama checkpoints; `1b` is a "
        "random Llama of TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV "
        "heads, MLP 5632) with the small tokenizer's 8,192-token vocabulary, written once "
        f"into `{settings['cache_dir']}` and kept there between runs. Times are medians of "
        f"{repeats} repeat(s). Page cache: **dropped**, per file: before every start and "
        "every in-process disk load the checkpoint's weight file is evicted with "
        "`posix_fadvise(DONTNEED)` (no process maps it: the cluster's own workers load a "
        "byte copy in other files), and `fincore` confirms it (bytes resident below); "
        "Python, torch and kvrelay's own files stay warm, and the virtual disk may be cached "
        "by the hypervisor.\n\n"
        "**Start to first token.** One cluster per model: router + 1 prefill + 1 decode "
        f"(`--threads 1 --num-blocks {blocks}`, KV over shm), its original workers on "
        "`--no-param-pool` so that they never hold the host's pool. For each mode the "
        "current prefill worker is drained and stopped, one prefill worker is started with "
        "the mode's flags, and the clock runs from `Launcher.add_worker` to the first "
        "streamed event of a 1-token completion that only the new worker can prefill "
        "(checked with its device-cache counters, and its log must show the pool event the "
        "mode expects). **disk**: `--no-param-pool`. **build**: the first instance on a "
        "host: no pool yet, it loads from disk and writes the host's pool. **pool**: the "
        "host's pool is ready (the build worker's, or made beforehand): attach. **peer**: "
        "no pool on this host; `--param-peers` names a `kvrelay pool serve` of the model "
        "under another scope (another host, emulated on this one), so the worker fills this "
        "host's pool from it over ZMQ/TCP loopback. 'worker ready': the worker's `ready` log "
        "line (process start, imports, config, weights, KV cache, registration sent); "
        "'router lists it': `/admin/instances` shows it. weights: for build and peer, the "
        "time the worker logged for building / filling the pool; (a) `load_weights` in this "
        "script's process with the file evicted; (b) pool attach, from the next table.\n\n"
        "**Pool attach alone**: `ParamPool.attach_or_create` + `close` on a ready pool, "
        f"{settings['attach_repeats']} times after one warm-up, in this script's process. "
        "It includes `model_fingerprint` (config, tokenizer and 3 x 64 KiB of each weight "
        "file) and the `gc` sweep that runs first; the tensors are views of the mapping, so "
        "pages are faulted in later, by the first forward pass (in 'first token after "
        "join')."
    )
    if chain_ckpt is not None:
        text += (
            f"\n\n**Chain multicast** of the largest pool whose copies fit in memory, "
            f"`{chain_ckpt.name}` ({_mib(chain_ckpt.num_bytes)} MiB, {chain_ckpt.dtype}), "
            "from a `kvrelay pool serve` to N receivers, each a process with its own "
            "pool scope that serves what it has received onward (`fetch_pool(..., "
            "forward_bind=...)`, sources in `plan_chain` order). The receivers start, import "
            "and fingerprint the model first; then all begin at one signal, and the time is "
            "from the signal to the last receiver's pool ready (every 4 MiB chunk "
            "checksummed). 'chain order kept': every receiver pulled from its predecessor "
            "alone (no failover to an earlier hop). Two conditions, each from its own origin: "
            "**unlimited** (loopback as fast as the CPUs go) and **link-limited** "
            f"(`--link-mbps {settings.get('link_mbps', 0):g}`: the origin and every forwarding "
            "receiver send at most that rate)."
        )
    return text


class Results(NamedTuple):
    ckpts: list[Checkpoint]
    starts: list[StartRun]
    attach: list[AttachResult]
    chain: list[ChainRun]
    chain_ckpt: Checkpoint | None


def parse_results(result: dict[str, Any]) -> Results:
    """The typed values of a result dict (``run_all``'s, or a saved ``--json``)."""
    ckpts = [
        Checkpoint(**{**c, "path": Path(c["path"]), "twin": Path(c["twin"])})
        for c in result["checkpoints"]
    ]
    return Results(
        ckpts,
        [StartRun(**r) for r in result["starts"]],
        [AttachResult(**{**a, "attach_ms": tuple(a["attach_ms"])}) for a in result["attach"]],
        [ChainRun(**r) for r in result["chain"]],
        next((c for c in ckpts if c.name == result["chain_model"]), None),
    )


def _chain_bytes(r: Results) -> int:
    return r.chain_ckpt.num_bytes if r.chain_ckpt is not None else 0


def time_notes(r: Results, import_s: float | None) -> str:
    """Where a start's time goes, with this run's numbers for its largest model."""
    big = max(r.ckpts, key=lambda c: c.num_bytes)
    runs = [s for s in r.starts if s.model == big.name]
    attach = next((a for a in r.attach if a.model == big.name), None)
    if not runs or attach is None or import_s is None:
        return ""
    after = median([s.first_token_s - s.joined_s for s in runs])
    logged = {m: _med([s.weights_logged_s for s in runs if s.mode == m]) for m in ("build", "peer")}
    pool_ready = _med([s.ready_s for s in runs if s.mode == "pool"])
    text = f"Where the time goes, for `{big.name}`: "
    if pool_ready is not None:
        text += (
            f"a worker that attaches the host's pool is ready {pool_ready:.2f} s after it is "
            "started, nearly all of it process start and the imports of torch and kvrelay (a "
            f"bare interpreter importing the worker's modules took {import_s:.2f} s, median "
            "at the run's start); "
        )
    text += (
        f"the first forward pass after it joins ({after:.2f} s: one thread, the pool's "
        "pages faulted in on first use) is the same in every mode. The weights are what "
        f"differ: attaching the pool takes {median(attach.attach_ms):.1f} ms against "
        f"{median(attach.disk_load_s):.2f} s to load from disk"
    )
    if logged["build"] is not None:
        text += f"; the first instance on a host builds the pool in {logged['build']:.2f} s"
    if logged["peer"] is not None:
        rate = big.num_bytes / logged["peer"] / 1e9
        disk_rate = big.num_bytes / median(attach.disk_load_s) / 1e9
        text += (
            f"; a peer fills it in {logged['peer']:.2f} s ({rate:.2f} GB/s over loopback "
            f"TCP, checksums included), {'slower' if rate < disk_rate else 'faster'} than "
            f"this machine's disk ({disk_rate:.2f} GB/s cold from a virtual disk, casts and "
            "fusing included): a peer pays off where the network is faster than the "
            "checkpoint's storage (network or object storage, a slow local disk)"
        )
    return text + (
        ". For the smaller models the weights are a small part of a start dominated by the "
        "imports, and mode-to-mode differences of a few hundred ms there are within the "
        "spread of repeats (min - max) on this shared machine."
    )


def chain_notes(r: Results) -> str:
    """What the two chain conditions mean, with this run's rates and how the link was chosen."""
    assert r.chain_ckpt is not None
    num_bytes = r.chain_ckpt.num_bytes
    groups = by_link(r.chain)
    unlimited = chain_p50(groups.get(0.0, []))
    rates = {n: n * num_bytes / t / 1e9 for n, t in unlimited.items()}  # GB/s, all receivers
    text = (
        "What the chain numbers mean on this machine. Unlimited: the origin, every receiver "
        "and this script share 2 CPUs, and each hop costs CPU for a loopback TCP send and "
        "receive, an xxh3 check and first-touch page faults into a new shared-memory segment, "
        "so each receiver adds a whole transfer's worth of work to the same two cores. The "
        "bytes delivered per second, summed over receivers, stay flat "
        f"({' / '.join(f'{v:.2f}' for v in rates.values())} GB/s for 1 / 2 / 4 receivers): "
        "the cores, not the chain's serial hops, set the time, and it grows with N. Between "
        "hosts each hop has its own CPUs and NIC and the transfer is link-bound: N receivers "
        "take about one transfer plus (N - 1) chunk times (4 MiB chunks) plus a connect per "
        "hop (a receiver can connect only once its predecessor has the header and binds; ZMQ "
        "retries every 100 ms)."
    )
    for link_mbps in (m for m in groups if m > 0):
        link = mbps_to_bytes_per_s(link_mbps)
        most = max(rates, default=None)
        text += (
            f" Link-limited ({link_mbps:g} Mbps = {link / 1e6:.0f} MB/s) models that: the "
            "origin and every forwarding receiver pace their chunk data with a token bucket "
            "(no burst: a chunk leaves only once the previous one's bytes have had their "
            f"time on the link, {1e3 * (4 << 20) / link:.0f} ms per 4 MiB chunk), one "
            "NIC per host; loopback adds no propagation delay, so only serialisation is "
            "modelled. "
        )
        if most is not None:
            share = link / (rates[most] * 1e9 / most)
            below = "well below" if share <= 0.35 else "below" if share < 1 else "NOT below"
            text += (
                f"The link rate is {below} this machine's limit in this run: unlimited, {most} "
                f"receivers took in {rates[most]:.2f} GB/s together, {rates[most] / most:.3f} "
                f"GB/s each, and the link is {share:.0%} of that, so {most} hops receiving at "
                "the link rate leave the cores spare when it is well below."
            )
    return text


def markdown_body(result: dict[str, Any]) -> str:
    r = parse_results(result)
    by_model = {a.model: a for a in r.attach}
    resident = [s.resident_bytes for s in r.starts if s.resident_bytes is not None]
    parts = [describe(result["settings"], r.ckpts, r.chain_ckpt)]
    if r.starts:
        parts.append(markdown_table(START_HEADERS, start_rows(r.ckpts, r.starts, by_model)))
        parts.append(
            "Checkpoint bytes resident in the page cache when a worker started: at most "
            f"{max(resident, default=0):,}."
        )
    if r.attach:
        parts.append(markdown_table(ATTACH_HEADERS, attach_rows(r.attach)))
    if r.chain_ckpt is not None:
        parts.append(markdown_table(CHAIN_HEADERS, chain_rows(r.chain_ckpt, r.chain)))
    parts.append("\n".join(verdicts(r.attach, r.starts, r.chain, _chain_bytes(r))))
    parts.append(time_notes(r, result["import_s"]))
    if r.chain_ckpt is not None and r.chain:
        parts.append(chain_notes(r))
    load = result["load_average"]
    parts.append(
        f"1-min load average at start / end: {load[0]:.1f} / {load[1]:.1f} "
        "(2 CPUs; other jobs shared the machine when this is above ~2)."
    )
    parts.append(machine_markdown(result["machine"]))
    return "\n\n".join(p for p in parts if p)


# ---------------------------------------------------------------------------- main


def _csv(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [kind(v.strip()) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", type=_csv(str), default=None, help=f"from {', '.join(MODELS)}")
    p.add_argument("--skip-1b", action="store_true", help="leave out the 1B checkpoint")
    p.add_argument("--modes", type=_csv(str), default=list(MODES), help=", ".join(MODES))
    p.add_argument("--receivers", type=_csv(int), default=None, help="chain sizes (1,2,4)")
    p.add_argument("--repeats", type=int, default=None, help="repeats per measurement (3)")
    p.add_argument("--attach-repeats", type=int, default=None, help="pool attaches timed (20)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker")
    p.add_argument("--quiet-wait", type=float, default=None, help="max s to wait for idle CPUs")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(tempfile.gettempdir()),
        help="where the 1B checkpoint is written once and kept (default: the temp dir)",
    )
    p.add_argument(
        "--link-mbps",
        type=float,
        default=DEFAULT_LINK_MBPS,
        help="chain: also run every chain with each server sending at most this many "
        f"megabits/s, one modelled NIC per host (default {DEFAULT_LINK_MBPS:g}; 0: only the "
        "unlimited loopback condition)",
    )
    p.add_argument(
        "--chain-only", action="store_true", help="measure part 3 (chain multicast) alone"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, 1 repeat, chain 1 and 2")
    p.add_argument("--log-dir", type=Path, default=None, help="default: a temporary dir")
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--render", type=Path, help="measure nothing: report a saved --json")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "models": ["tiny"] if quick else ["small", "medium", "1b"],
        "receivers": [1, 2] if quick else [1, 2, 4],
        "repeats": 1 if quick else 3,
        "attach_repeats": 5 if quick else 20,
        "quiet_wait": 0.0 if quick else 20.0,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.skip_1b:
        args.models = [m for m in args.models if m != "1b"]
    bad = [m for m in args.models if m not in MODELS] + [m for m in args.modes if m not in MODES]
    if bad or not args.models:
        p.error(f"unknown models or modes {bad}; models: {MODELS}, modes: {MODES}")
    if min(args.repeats, args.attach_repeats, *args.receivers, 1) < 1:
        p.error("--repeats, --attach-repeats and --receivers must be >= 1")
    if args.link_mbps < 0:
        p.error("--link-mbps must be >= 0 (0: no link-limited condition)")
    if args.chain_only and not args.receivers:
        p.error("--chain-only needs --receivers")
    args.modes = [m for m in MODES if m in args.modes]
    return args


def run_all(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ckpts = prepare_checkpoints(args.models, work / "models", args.cache_dir)
    log_dir = args.log_dir or work / "logs"
    load_start = os.getloadavg()[0]
    chain_ckpt = pick_chain_model(ckpts, max(args.receivers)) if args.receivers else None
    import_s = None if args.chain_only else measure_import(args.repeats)
    attach = [] if args.chain_only else [measure_attach(c, args) for c in ckpts]
    starts: list[StartRun] = []
    chain: list[ChainRun] = []
    for c in ckpts:
        if not args.chain_only:  # the pool server is the peer of the starts
            with pool_server(c, f"peer{os.getpid()}", log_dir / c.name) as server:
                starts += run_starts(c, server, args, log_dir / c.name)
        if c is chain_ckpt:
            chain = run_chains(c, args, log_dir / "chain")
    keys = ("repeats", "attach_repeats", "num_blocks", "link_mbps", "chain_only")
    settings = {k: getattr(args, k) for k in keys}
    return {
        "command": command_line(),
        "settings": {**settings, "cache_dir": str(args.cache_dir)},
        "checkpoints": [{**asdict(c), "path": str(c.path), "twin": str(c.twin)} for c in ckpts],
        "machine": machine_info(1),
        "load_average": (load_start, os.getloadavg()[0]),
        "import_s": import_s,
        "starts": [asdict(r) for r in starts],
        "attach": [asdict(a) for a in attach],
        "chain_model": chain_ckpt.name if chain_ckpt else None,
        "chain": [asdict(r) for r in chain],
    }


def report(result: dict[str, Any], json_path: Path | None, write_md: bool) -> None:
    r = parse_results(result)
    by_model = {a.model: a for a in r.attach}
    if r.starts:
        print()
        print(text_table(START_HEADERS, start_rows(r.ckpts, r.starts, by_model)))
    if r.attach:
        print()
        print(text_table(ATTACH_HEADERS, attach_rows(r.attach)))
    if r.chain_ckpt is not None:
        print(f"\nchain: {r.chain_ckpt.name}, {_mib(r.chain_ckpt.num_bytes)} MiB")
        print(text_table(CHAIN_HEADERS, chain_rows(r.chain_ckpt, r.chain)))
    print()
    print("\n".join(verdicts(r.attach, r.starts, r.chain, _chain_bytes(r))))
    if r.chain_ckpt is not None and r.chain:
        print()
        print(chain_notes(r))
    if json_path is not None:
        write_json(json_path, result)
    if write_md:
        path = update_benchmarks_md(SECTION_TITLE, markdown_body(result), result["command"])
        print(f"\nwrote section {SECTION_TITLE!r} of {path}")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. under nohup) unwinds like Ctrl-C, so every process and pool is cleaned up.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse_args(argv)
    if args.render is not None:
        report(json.loads(args.render.read_text()), None, write_md=not args.no_write)
        return 0
    with tempfile.TemporaryDirectory(prefix="kvrelay-scale-up-") as tmp:
        result = run_all(args, Path(tmp))
    report(result, args.json, write_md=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
