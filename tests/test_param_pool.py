"""Parameter pool: one copy of the weights per host, shared by real processes.

Children are forked from a forkserver that has imported torch once, so each starts in
milliseconds. Each test works in its own scope and checks that no segment of it remains.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.cachetier import param_ops, param_segment
from kvrelay.cachetier.param_locks import PoolBusy, interest
from kvrelay.cachetier.param_pool import ParamPool
from kvrelay.cachetier.param_segment import CorruptPool
from kvrelay.cachetier.segments import SHM_DIR
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.engine import LLMEngine, build_engine_config
from kvrelay.engine.identity import model_identity
from kvrelay.engine.loader import load_weights
from kvrelay.engine.make_tiny import make_tiny
from kvrelay.protocol.sampling_params import SamplingParams
from kvrelay.text.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm (Linux)")

REPO = Path(__file__).resolve().parents[1]
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["torch", "kvrelay.cachetier.param_pool", "kvrelay.engine.loader"])
TIMEOUT_S = 60


@pytest.fixture
def scope() -> Iterator[str]:
    """A scope of this test alone; every segment under it is removed afterwards."""
    name = f"t{os.getpid()}x{time.monotonic_ns() % 10**9:09d}"
    yield name
    for entry in os.listdir(SHM_DIR):
        if entry.startswith(f"{param_ops.PREFIX}{name}"):
            (SHM_DIR / entry).unlink()


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A ~134 MB float32 llama checkpoint."""
    return make_tiny(tmp_path_factory.mktemp("small-llama"), arch="llama", size="small", seed=0)


def _segments(scope: str) -> list[str]:
    return sorted(e for e in os.listdir(SHM_DIR) if e.startswith(f"{param_ops.PREFIX}{scope}"))


def _reference(model_dir: Path, dtype: str = "float32") -> dict[str, torch.Tensor]:
    return load_weights(model_dir, ModelConfig.from_dir(model_dir), dtype)


def _digest(weights: dict[str, torch.Tensor]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in weights.items():
        h.update(name.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape, name
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def _recording_build(
    model_dir: Path, calls: Path, delay_s: float = 0.0
) -> Callable[[], dict[str, torch.Tensor]]:
    """A build that appends this pid to ``calls`` first (the file counts builds)."""

    def build() -> dict[str, torch.Tensor]:
        with calls.open("a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(delay_s)
        return _reference(model_dir)

    return build


def _build_calls(calls: Path) -> list[int]:
    return [int(line) for line in calls.read_text().split()] if calls.exists() else []


# -- children (run in forked processes) ------------------------------------------------------------


def _attach_child(
    model_dir: Path,
    scope: str,
    calls: Path,
    out: Any,
    start: Any = None,
    hold: Any = None,
    build_delay_s: float = 0.0,
) -> None:
    """Waits for ``start``, attaches, touches every weight, reports (pid, name, digest),
    then stays attached until ``hold`` is set (or it is killed)."""
    torch.set_num_threads(1)
    if start is not None:
        start.wait(TIMEOUT_S)
    build = _recording_build(model_dir, calls, build_delay_s)
    pool = ParamPool.attach_or_create(model_dir, "float32", build, scope=scope)
    out.put((os.getpid(), pool.name, _digest(pool.weights)))
    if hold is not None:
        hold.wait(TIMEOUT_S)
    pool.close()


def _fill_child(name: str, header: bytes, data: bytes, out: Any) -> None:
    """Fills the first half of a pool's chunks, reports, then hangs until killed."""
    pool = ParamPool.open_for_fill(name, header, len(data))
    half = pool.num_chunks // 2 * pool.chunk_bytes
    pool.buffer[:half] = data[:half]
    out.put(os.getpid())
    time.sleep(TIMEOUT_S)


def _gc_child(scope: str, stop: Any, out: Any) -> None:
    """Sweeps ``scope`` with no grace, as fast as it can, until ``stop``; reports the frees."""
    num_freed = 0
    while not stop.is_set():
        num_freed += len(param_ops.gc(grace_s=0, scope=scope))
    out.put(num_freed)


def _reattach_child(model_dir: Path, scope: str, calls: Path, rounds: int, out: Any) -> None:
    """``rounds`` times: attach (building when the pool is gone, slowly, so that a sweep
    meets the build), then, having declared interest, detach (the pool idle, past a zero
    grace) and attach again, which must find the same segment: its build raises. Reports
    (number of rebuilds, every digest, every (first, second) inode pair)."""
    torch.set_num_threads(1)
    build = _recording_build(model_dir, calls, delay_s=0.02)
    name = param_ops.pool_name(model_identity(model_dir, "float32"), "float32", scope)
    digests, inodes = set(), []

    def never() -> dict[str, torch.Tensor]:
        raise AssertionError("a pool that a process declared interest in was freed")

    for _ in range(rounds):
        first = ParamPool.attach_or_create(model_dir, "float32", build, scope=scope)
        assert param_segment._is_linked(first._fd, name)  # not freed while built or attached
        digests.add(_digest(first.weights))
        with interest(name):
            first_inode = os.fstat(first._fd).st_ino
            first.close()  # no user now: only the interest keeps the sweep off it
            time.sleep(0.005)
            with ParamPool.attach_or_create(model_dir, "float32", never, scope=scope) as again:
                digests.add(_digest(again.weights))
                inodes.append((first_inode, os.fstat(again._fd).st_ino))
    out.put((len(_build_calls(calls)), sorted(digests), inodes))


def _start(target: Callable[..., None], *args: Any, **kwargs: Any) -> Any:
    proc = CTX.Process(target=target, args=args, kwargs=kwargs, daemon=True)
    proc.start()
    return proc


def _kill(proc: Any) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT_S)
    assert proc.exitcode == -signal.SIGKILL


def _info(name: str, scope: str) -> param_ops.PoolInfo:
    (info,) = [p for p in param_ops.list_pools(scope) if p.name == name]
    return info


# -- tests -----------------------------------------------------------------------------------------


def test_first_attach_builds_and_other_processes_attach(tiny_model_dir, scope, tmp_path):
    calls, out = tmp_path / "calls", CTX.Queue()
    first = _start(_attach_child, tiny_model_dir, scope, calls, out)
    pid, name, digest = out.get(timeout=TIMEOUT_S)
    first.join(TIMEOUT_S)
    second = _start(_attach_child, tiny_model_dir, scope, calls, out)
    pid2, name2, digest2 = out.get(timeout=TIMEOUT_S)
    second.join(TIMEOUT_S)
    assert _build_calls(calls) == [pid] and pid2 != pid and name2 == name
    assert (
        name
        == f"kvrelay-params-{scope}-{model_identity(tiny_model_dir, 'float32')[:8].hex()}-float32"
    )

    def fail() -> dict[str, torch.Tensor]:
        raise AssertionError("a ready pool must not be rebuilt")

    with ParamPool.attach_or_create(tiny_model_dir, "float32", fail, scope=scope) as pool:
        reference = _reference(tiny_model_dir)
        _assert_bitwise_equal(pool.weights, reference)
        assert digest == digest2 == _digest(reference)
        assert all(t.data_ptr() % param_segment.TENSOR_ALIGN == 0 for t in pool.weights.values())
        info = _info(name, scope)
        assert (info.state, info.user_pids, info.dtype) == ("ready", (os.getpid(),), "float32")
        assert info.fingerprint == model_identity(tiny_model_dir, "float32").hex()
    assert _info(name, scope).user_pids == ()
    assert param_ops.remove(name) is True
    assert _segments(scope) == []


def test_model_on_pool_weights_generates_the_disk_tokens(tiny_model_dir, scope):
    tokenizer = Tokenizer.from_pretrained(tiny_model_dir)
    prompts = ["The parameter pool", "a", "weights in shared memory, attached zero-copy " * 3]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

    def generate(weights: dict[str, torch.Tensor] | None) -> list[list[int]]:
        config = build_engine_config(str(tiny_model_dir), num_blocks=64)
        engine = LLMEngine(config, tokenizer, weights=weights)
        for i, text in enumerate(prompts):
            engine.add_request(str(i), tokenizer.encode(text), greedy)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id] = out.token_ids
        return [tokens[str(i)] for i in range(len(prompts))]

    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope) as pool:
        assert generate(pool.weights) == generate(None)
        name = pool.name
    param_ops.remove(name)
    assert _segments(scope) == []


def test_weights_outlive_the_pool_closed_under_them(tiny_model_dir, scope):
    """Tensors over the pool stay readable after ``close`` and after the pool is removed
    (an engine's background packing still reads them): the mapping goes with the last
    tensor. In a child process: before the fix the read was a SIGSEGV."""
    code = f"""
import sys, torch
from kvrelay.cachetier import param_ops
from kvrelay.cachetier.param_pool import ParamPool
pool = ParamPool.attach_or_create({str(tiny_model_dir)!r}, "float32", scope={scope!r})
kept = dict(pool.weights)
want = {{k: v.clone() for k, v in kept.items()}}
pool.close()
param_ops.remove(pool.name)
del pool
same = all(torch.equal(kept[k], want[k]) for k in want)
print("same" if same else "differs")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.split()[-1] == "same"
    assert _segments(scope) == []


def _shm_memory_kb(pid: int, name: str) -> tuple[int, int]:
    """(Rss, Pss) in kB of ``pid``'s mappings of segment ``name`` (/proc/<pid>/smaps)."""
    rss = pss = 0
    in_pool = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            in_pool = line.split(maxsplit=5)[-1] == f"/dev/shm/{name}"
        elif in_pool and line.startswith(("Rss:", "Pss:")):
            kb = int(line.split()[1])
            rss, pss = (rss + kb, pss) if line.startswith("Rss:") else (rss, pss + kb)
    return rss, pss


def _pss_shmem_kb(pid: int) -> int:
    text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    match = re.search(r"^Pss_Shmem:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) if match else -1


def test_two_processes_share_one_resident_copy(small_model_dir, scope, tmp_path):
    calls, out, hold = tmp_path / "calls", CTX.Queue(), CTX.Event()
    procs = [_start(_attach_child, small_model_dir, scope, calls, out, hold=hold)]
    pid_a, name, digest_a = out.get(timeout=TIMEOUT_S)  # built by the first
    procs.append(_start(_attach_child, small_model_dir, scope, calls, out, hold=hold))
    pid_b, _, digest_b = out.get(timeout=TIMEOUT_S)
    try:
        assert _build_calls(calls) == [pid_a] and digest_a == digest_b
        pool_kb = (SHM_DIR / name).stat().st_size // 1024
        assert pool_kb > 100_000
        usage = {pid: _shm_memory_kb(pid, name) for pid in (pid_a, pid_b)}
        rollup = {pid: _pss_shmem_kb(pid) for pid in (pid_a, pid_b)}
        print(f"pool {pool_kb} kB; (Rss, Pss) kB per process {usage}; Pss_Shmem {rollup}")
        for rss, pss in usage.values():
            assert rss > 0.95 * pool_kb  # each process touched (maps) every page
            assert 0.4 * pool_kb < pss < 0.6 * pool_kb  # and pays for half of them
        assert sum(pss for _, pss in usage.values()) < 1.3 * pool_kb  # one copy, not two
    finally:
        hold.set()
        for proc in procs:
            proc.join(TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0, 0]
    assert param_ops.gc(grace_s=0, scope=scope) == [name]
    assert _segments(scope) == []


def test_concurrent_creators_build_exactly_once(tiny_model_dir, scope, tmp_path):
    calls, out, start = tmp_path / "calls", CTX.Queue(), CTX.Event()
    procs = [
        _start(_attach_child, tiny_model_dir, scope, calls, out, start, build_delay_s=0.3)
        for _ in range(4)
    ]
    start.set()
    reports = [out.get(timeout=TIMEOUT_S) for _ in procs]
    for proc in procs:
        proc.join(TIMEOUT_S)
    assert [p.exitcode for p in procs] == [0] * 4
    assert len(_build_calls(calls)) == 1
    assert _build_calls(calls)[0] in {pid for pid, _, _ in reports}
    assert {(name, digest) for _, name, digest in reports} == {
        (reports[0][1], _digest(_reference(tiny_model_dir)))
    }
    assert param_ops.gc(grace_s=0, scope=scope) == [reports[0][1]]
    assert _segments(scope) == []


def test_a_builder_killed_mid_build_is_replaced(tiny_model_dir, scope, tmp_path):
    calls, out = tmp_path / "calls", CTX.Queue()
    # killed inside build(): it holds the build lock, and the kernel drops it
    hung = _start(_attach_child, tiny_model_dir, scope, calls, out, build_delay_s=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while not _build_calls(calls) and time.monotonic() < deadline:
        time.sleep(0.01)
    _kill(hung)
    # killed while writing a segment (a peer-transfer fill): a stale BUILDING segment
    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=f"{scope}.src") as source:
        name = param_ops.pool_name(model_identity(tiny_model_dir, "float32"), "float32", scope)
        filler = _start(_fill_child, name, source.header, bytes(source.buffer), out)
        out.get(timeout=TIMEOUT_S)
        assert _info(name, scope).state == "building"
        assert param_ops.gc(grace_s=0, scope=scope) == []  # a live builder's
        with pytest.raises(PoolBusy, match="a live builder"):
            param_ops.remove(name)
        _kill(filler)
        assert _info(name, scope).state == "stale"
        param_ops.remove(source.name, force=True)
    build = _recording_build(tiny_model_dir, calls)
    with ParamPool.attach_or_create(tiny_model_dir, "float32", build, scope=scope) as pool:
        assert _build_calls(calls) == [hung.pid, os.getpid()]
        _assert_bitwise_equal(pool.weights, _reference(tiny_model_dir))
        assert all(pool.verify_chunk(i) for i in range(pool.num_chunks))
    assert param_ops.gc(grace_s=0, scope=scope) == [name]
    assert _segments(scope) == []


def test_killed_users_are_pruned_and_the_pool_stays_intact(tiny_model_dir, scope, tmp_path):
    calls, out, hold = tmp_path / "calls", CTX.Queue(), CTX.Event()
    pool = ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope)
    procs = [_start(_attach_child, tiny_model_dir, scope, calls, out, hold=hold) for _ in range(2)]
    pids = sorted(out.get(timeout=TIMEOUT_S)[0] for _ in procs)
    assert sorted(_info(pool.name, scope).user_pids) == sorted([os.getpid(), *pids])
    with pytest.raises(PoolBusy, match="live users"):
        param_ops.remove(pool.name)
    for proc in procs:
        _kill(proc)
    assert _info(pool.name, scope).user_pids == (os.getpid(),)
    assert param_ops.gc(grace_s=0, scope=scope) == []  # the survivor still uses it
    assert all(pool.verify_chunk(i) for i in range(pool.num_chunks))
    _assert_bitwise_equal(pool.weights, _reference(tiny_model_dir))
    assert _build_calls(calls) == []
    pool.close()
    assert param_ops.gc(grace_s=300, scope=scope) == []  # idle for less than the grace
    assert param_ops.gc(grace_s=0, scope=scope) == [pool.name]
    assert _segments(scope) == []


def test_gc_never_frees_a_pool_being_built_or_about_to_be_attached(tiny_model_dir, scope, tmp_path):
    """A sweeper with no grace races a process that builds, detaches and re-attaches: every
    attach gets the checkpoint's weights, a pool is never freed under its builder, and one
    that a process declared interest in survives until it attaches."""
    rounds, calls, out, stop = 25, tmp_path / "calls", CTX.Queue(), CTX.Event()
    sweeper = _start(_gc_child, scope, stop, out)
    attacher = _start(_reattach_child, tiny_model_dir, scope, calls, rounds, out)
    attacher.join(4 * TIMEOUT_S)  # its report is small: it fits the queue's pipe
    assert attacher.exitcode == 0, "the attacher failed (its traceback is above)"
    num_builds, digests, inodes = out.get(timeout=TIMEOUT_S)
    stop.set()
    num_freed = out.get(timeout=TIMEOUT_S)
    sweeper.join(TIMEOUT_S)
    assert sweeper.exitcode == 0
    assert digests == [_digest(_reference(tiny_model_dir))]
    assert len(inodes) == rounds and all(first == again for first, again in inodes)
    assert 1 <= num_builds <= rounds and num_freed >= num_builds - 1  # the sweeper did sweep
    param_ops.gc(grace_s=0, scope=scope)
    assert _segments(scope) == []


def test_fill_from_a_peer_checks_every_chunk(tiny_model_dir, scope):
    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=f"{scope}.src") as source:
        data = bytearray(source.buffer)
        name = param_ops.pool_name(model_identity(tiny_model_dir, "float32"), "float32", scope)
        with pytest.raises(CorruptPool):
            ParamPool.open_for_fill(name, source.header, source.total_bytes + 1)
        abandoned = ParamPool.open_for_fill(name, source.header, source.total_bytes)
        abandoned.close()  # closed before mark_ready: unlinked
        assert _segments(scope) == [source.name]
        assert param_ops.list_pools(scope) == []
        pool = ParamPool.open_for_fill(name, source.header, source.total_bytes)
        assert (pool.chunk_bytes, pool.chunk_checksums) == (
            source.chunk_bytes,
            source.chunk_checksums,
        )
        data[5] ^= 0xFF
        pool.buffer[:] = data
        assert pool.num_chunks >= 2 and not pool.verify_chunk(0) and pool.verify_chunk(1)
        with pytest.raises(CorruptPool, match=r"chunks \[0\]"):
            pool.mark_ready()
        data[5] ^= 0xFF
        pool.buffer[:] = data
        assert pool.verify_chunk(0)
        pool.mark_ready()
        with pytest.raises(FileExistsError):
            ParamPool.open_for_fill(name, source.header, source.total_bytes)
        _assert_bitwise_equal(pool.weights, source.weights)
        assert _info(name, scope).user_pids == (os.getpid(),)
        assert pool.buffer.readonly
        pool.close()
    assert param_ops.remove(source.name)
    assert param_ops.gc(grace_s=0, scope=scope) == [name]
    assert _segments(scope) == []


_CLI_DRIVER = """
import contextlib, io, json, sys
from kvrelay.cli import main
results = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    results.append([rc, out.getvalue(), err.getvalue()])
print(json.dumps(results))
"""


def _cli(*commands: list[str]) -> list[tuple[int, str, str]]:
    """Runs ``kvrelay <argv>`` for each argv, in order, in one new process (one torch import)."""
    argvs = json.dumps([["pool", *argv] for argv in commands])
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CLI_DRIVER, argvs],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=True,
    )  # fmt: skip
    return [tuple(r) for r in json.loads(proc.stdout.splitlines()[-1])]


def test_pool_cli_lists_refuses_and_frees(tiny_model_dir, scope):
    used = ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope)
    with ParamPool.attach_or_create(tiny_model_dir, "bfloat16", scope=scope) as idle:
        sizes = {p.name: f"{(SHM_DIR / p.name).stat().st_size / 2**20:.1f}" for p in (used, idle)}
    ls, refused, gc, force, ls_after = _cli(
        ["ls", "--scope", scope],
        ["rm", used.name],
        ["gc", "--grace", "0", "--scope", scope],
        ["rm", "--force", used.name],
        ["ls", "--scope", scope],
    )
    header = ["NAME", "IDENTITY", "DTYPE", "MIB", "STATE", "USERS", "IDLE_S", "SOURCE"]
    assert ls[0] == 0 and ls[1].splitlines()[0].split() == header
    rows = {line.split()[0]: line.split() for line in ls[1].splitlines()[1:]}
    assert set(rows) == {used.name, idle.name}
    f32, bf16 = (model_identity(tiny_model_dir, d).hex()[:16] for d in ("float32", "bfloat16"))
    pid, source = str(os.getpid()), str(Path(tiny_model_dir).resolve())
    assert rows[used.name][1:] == [f32, "float32", sizes[used.name], "ready", pid, "-", source]
    assert rows[idle.name][1:6] == [bf16, "bfloat16", sizes[idle.name], "ready", "-"]
    assert float(rows[idle.name][6]) >= 0 and rows[idle.name][7] == source
    assert refused[0] == 1 and f"live users (pids [{pid}])" in refused[2]
    assert (gc[0], gc[1].split()) == (0, [idle.name])
    assert (force[0], force[1].split()) == (0, [used.name])
    assert (ls_after[0], ls_after[1].split()) == (0, header)
    used.close()  # its segment was removed under it: detaching still works
    assert _segments(scope) == []


def test_gc_frees_unwritten_segments_and_leaves_other_formats(scope):
    empty, foreign = (f"{param_ops.PREFIX}{scope}-{kind}-float32" for kind in ("empty", "other"))
    (SHM_DIR / empty).write_bytes(bytes(4096))  # a creator killed before its header
    (SHM_DIR / foreign).write_bytes(b"OTHERFMT" + bytes(4088))
    assert [(p.name, p.state) for p in param_ops.list_pools(scope)] == [(empty, "stale")]
    assert param_ops.gc(grace_s=300, scope=scope) == [empty]
    assert _segments(scope) == [foreign]
    with pytest.raises(ValueError, match="pool name"):
        param_ops.remove("../etc/passwd")
    with pytest.raises(CorruptPool, match="another format"):
        param_ops.remove(foreign)
    assert param_ops.remove(foreign, force=True)
    assert _segments(scope) == []


def _make_outdated(name: str, version: int = 1) -> None:
    """Rewrites the format version in a pool's header, as an older kvrelay would have left it."""
    with (SHM_DIR / name).open("r+b") as f:
        f.seek(len(param_segment._MAGIC))
        f.write(version.to_bytes(4, "little"))


def test_a_pool_of_another_version_is_replaced_listed_and_collected(tiny_model_dir, scope):
    """After an upgrade that changes the layout, an old pool must not stop any worker."""
    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope) as first:
        name = first.name
    _make_outdated(name)
    [info] = param_ops.list_pools(scope)
    assert (info.name, info.state, info.user_pids) == (name, "outdated", ())
    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope, grace_s=1e9) as pool:
        assert pool.name == name  # rebuilt in place of the outdated one
        _assert_bitwise_equal(dict(pool.weights), _reference(tiny_model_dir))
    assert [p.state for p in param_ops.list_pools(scope)] == ["ready"]

    _make_outdated(name)
    with (SHM_DIR / name).open("rb") as f:  # a process of the old version still maps it
        held = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    try:
        [info] = param_ops.list_pools(scope)
        assert info.state == "outdated" and os.getpid() in info.user_pids
        assert param_ops.gc(grace_s=0, scope=scope) == []
        with pytest.raises(PoolBusy, match=str(os.getpid())):
            param_ops.remove(name)
    finally:
        held.close()
    assert param_ops.gc(grace_s=300, scope=scope) == [name]  # unmapped: freed, no grace
    assert _segments(scope) == []


# -- the GPU path: pinned segment -> device copy -------------------------------------------------

NO_CUDA = "needs a CUDA device: the pinned pool -> device copy runs where one is present"


def test_a_cpu_engine_gets_the_pools_own_views(tiny_model_dir, scope):
    from kvrelay.cachetier.param_device import copy_to_device
    from kvrelay.worker.config import pool_weights

    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope) as pool:
        assert pool_weights(pool, torch.device("cpu")) is pool.weights  # zero-copy, unchanged
        assert not pool.is_pinned
        with pytest.raises(ValueError, match="needs a CUDA device"):
            copy_to_device(pool, "cpu")
    assert not pool.is_pinned


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_pool_weights_reach_the_gpu_from_the_pinned_segment(tiny_model_dir, scope, caplog):
    from kvrelay.cachetier.param_device import copy_to_device
    from kvrelay.worker.config import pool_weights

    pool = ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope)
    try:
        copied = copy_to_device(pool, "cuda")
        assert copied.is_pinned == pool.is_pinned
        if not copied.is_pinned:  # allowed (e.g. memlock limit), but it must say why
            assert "from pageable memory" in caplog.text
        for name, t in pool.weights.items():
            assert copied.weights[name].device.type == "cuda"
            assert torch.equal(copied.weights[name].cpu(), t)
        again = pool_weights(pool, torch.device("cuda"))  # the worker's path; pin is idempotent
        assert all(torch.equal(again[n], copied.weights[n]) for n in again)
        torch.ones(4, device="cuda").add_(1).sum().item()  # no CUDA error was left behind
    finally:
        pool.close()
    assert not pool.is_pinned
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_refused_registration_falls_back_to_a_plain_copy(
    tiny_model_dir, scope, caplog, monkeypatch
):
    """A real refusal (a range far past any mapping) leaves no CUDA error behind, and a pool
    whose registration is refused is copied plainly."""
    from kvrelay.cachetier import param_device

    with ParamPool.attach_or_create(tiny_model_dir, "float32", scope=scope) as pool:
        address = next(iter(pool.weights.values())).untyped_storage().data_ptr()
        with pytest.raises(param_device.PinError, match="cudaHostRegister"):
            param_device.register_host_memory(address, 1 << 50)
        torch.ones(4, device="cuda").add_(1).sum().item()  # the refusal left no CUDA error
        real = param_device.register_host_memory
        monkeypatch.setattr(param_device, "register_host_memory", lambda a, n: real(a, 1 << 50))
        copied = param_device.copy_to_device(pool, "cuda")
        assert not copied.is_pinned and not pool.is_pinned
        assert "from pageable memory" in caplog.text
        for name, t in pool.weights.items():
            assert torch.equal(copied.weights[name].cpu(), t)
