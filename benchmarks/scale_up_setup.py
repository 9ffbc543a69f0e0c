"""Scale-up benchmark, setup: the run's checkpoints (written once, linked per run, evicted
from the page cache) and the processes it starts (``kvrelay pool serve``, the cluster)."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.protocol.credential import ClusterCredential, child_environ

SERVED_NAME = "bench"
MODELS = ("tiny", "small", "medium", "1b")
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


class BenchError(RuntimeError):
    """A process, request or pool did not reach the state a measurement needs."""


# ---------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True, slots=True)
class Checkpoint:
    name: str  # tiny | small | medium | 1b
    path: Path  # what measured instances load (no other process maps its files)
    twin: Path  # a byte copy in other files, for the cluster's router and original workers
    dtype: str  # the dtype it is served in (and its pools hold)
    fingerprint: str  # hex of ``model_identity``: unique to this run (see the module doc)
    num_params: int
    num_bytes: int  # the runtime weights in ``dtype``

    @property
    def host_pool(self) -> str:
        """The host-wide (unscoped) pool a worker of this checkpoint uses."""
        return self.scoped_pool("")

    def scoped_pool(self, scope: str) -> str:
        from kvrelay.cachetier.param_ops import pool_name

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
    from kvrelay.engine.identity import model_identity
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
        fingerprint = model_identity(path, dtype).hex()
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
    from kvrelay.engine.identity import weight_files

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


CREDENTIAL = ClusterCredential.generate()  # one cluster: workers, pool servers, receivers


def bench_environ() -> dict[str, str]:
    """The environment of a process the benchmark starts: it holds the cluster secret."""
    return child_environ(CREDENTIAL, os.environ)


@contextlib.contextmanager
def pool_server(
    ckpt: Checkpoint, scope: str, log_dir: Path, link_mbps: float = 0.0
) -> Iterator[Callable[[], str]]:
    """Starts ``kvrelay pool serve`` of ``ckpt`` under ``scope`` (sending at most
    ``link_mbps``, 0: unlimited); yields a function that waits for it and returns its
    address. Stops it and removes its pool at exit."""
    from kvrelay.cachetier import param_ops

    log_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "kvrelay", "pool", "serve", "--model", str(ckpt.path),
        "--dtype", ckpt.dtype, "--bind", "tcp://127.0.0.1:0", "--scope", scope,
        "--link-mbps", str(link_mbps),
    ]  # fmt: skip
    with open(log_dir / f"pool-serve-{scope}.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=bench_environ())
    addr: list[str] = []

    def address() -> str:
        if not addr:  # "<pool>: serving at tcp://127.0.0.1:PORT"
            addr.append(read_line(proc, START_TIMEOUT_S, "kvrelay pool serve").split()[-1])
        return addr[0]

    try:
        yield address
    finally:
        stop_process(proc)
        param_ops.remove(ckpt.scoped_pool(scope), force=True)


@contextlib.contextmanager
def running_cluster(
    ckpt: Checkpoint, args: argparse.Namespace, log_dir: Path
) -> Iterator[Launcher]:
    worker_args = (
        "--threads", "1", "--dtype", ckpt.dtype, "--num-blocks", str(args.num_blocks),
        "--dead-after", "30",  # the router's too: a busy router is not gone
    )  # fmt: skip
    spec = ClusterSpec(
        model=str(ckpt.twin),
        worker_args=worker_args,
        router_args=("--served-model-name", SERVED_NAME, "--dead-after", "30"),
        log_dir=str(log_dir),
        credential=CREDENTIAL,
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
