"""Parameter pools between "hosts" (separate processes with separate pool scopes on one
machine): a chain A -> B -> C of `kvrelay pool` processes ends with byte-identical pools."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import xxhash

from kvrelay.cachetier import param_ops, param_pool
from kvrelay.cachetier.param_transfer import fetch_pool
from kvrelay.engine.identity import model_identity
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.transport.chain_wire import ChainError
from kvrelay.transport.curve import SocketSecurity

CREDENTIAL = ClusterCredential.generate()
CLUSTER_ENV = {**os.environ, "KVRELAY_CLUSTER_SECRET": CREDENTIAL.hex()}  # never in argv


def _pool_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvrelay", "pool", *args]


def _wait_line(proc: subprocess.Popen[str], timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline() if proc.stdout else ""
        if line:
            return line.strip()
        assert proc.poll() is None, f"exited with {proc.returncode}"
    raise AssertionError("no output in time")


def _no_build() -> dict:
    raise AssertionError("the pool must already be there, filled from a peer")


def _digest(model: str, scope: str) -> tuple[str, str]:
    pool = param_pool.ParamPool.attach_or_create(model, "float32", _no_build, scope=scope)
    with pool:
        return pool.name, xxhash.xxh3_128_hexdigest(pool.buffer)


@pytest.fixture
def scopes():
    run = uuid.uuid4().hex[:6]
    names = {h: f"t{run}{h}" for h in "abc"}
    yield names
    for scope in names.values():
        for info in param_ops.list_pools(scope):
            param_ops.remove(info.name, force=True)
        assert param_ops.list_pools(scope) == []


def test_chain_of_three_pools_ends_byte_identical(tiny_model_dir: Path, scopes) -> None:
    model = str(tiny_model_dir)
    procs = []
    try:
        a = subprocess.Popen(
            _pool_cmd(
                "serve", "--model", model, "--scope", scopes["a"], "--bind", "tcp://127.0.0.1:0"
            ),
            stdout=subprocess.PIPE,
            text=True,
            env=CLUSTER_ENV,
        )
        procs.append(a)
        addr_a = _wait_line(a).rsplit(" ", 1)[-1]
        b = subprocess.Popen(
            _pool_cmd(
                "fetch", "--model", model, "--scope", scopes["b"], "--from", addr_a,
                "--forward-bind", "tcp://127.0.0.1:57391",
            ),
            stdout=subprocess.PIPE,
            text=True,
            env=CLUSTER_ENV,
        )  # fmt: skip
        procs.append(b)
        c = subprocess.run(
            _pool_cmd(
                "fetch", "--model", model, "--scope", scopes["c"],
                "--from", f"tcp://127.0.0.1:57391,{addr_a}",
            ),
            capture_output=True,
            text=True,
            timeout=120,
            env=CLUSTER_ENV,
        )  # fmt: skip
        assert c.returncode == 0, c.stderr
        assert "MiB in" in c.stdout
        assert "MiB in" in _wait_line(b)
        digests = {h: _digest(model, scopes[h]) for h in "abc"}
        assert len({d for _, d in digests.values()}) == 1, digests
        assert len({n for n, _ in digests.values()}) == 3  # three pools, one content
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def test_no_peer_raises_so_the_worker_falls_back_to_disk(tiny_model_dir: Path, scopes) -> None:
    fingerprint = model_identity(tiny_model_dir, "float32")
    with pytest.raises(ChainError):
        fetch_pool(
            fingerprint,
            "float32",
            ["tcp://127.0.0.1:9"],
            scope=scopes["a"],
            timeout=1,
            security=SocketSecurity(CREDENTIAL),
        )
    assert param_ops.list_pools(scopes["a"]) == []  # nothing half-filled left behind
