"""A model's identity covers every byte: two checkpoints that differ in one tensor never share
a parameter pool, a KV block (device, host pool, Redis, router index) or a hand-off pair.

The twin checkpoint (``_twin``) is the tiny one with one tensor negated in place: same size,
same safetensors header, same config and tokenizer, and the changed bytes lie away from the
start, the middle and the end of the file (outside the three 64 KiB samples the old
fingerprint read).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import openai
import pytest

from kvrelay.cachetier import param_ops
from kvrelay.cachetier.block_hash import hash_blocks
from kvrelay.cachetier.param_pool import ParamPool
from kvrelay.cachetier.param_segment import CorruptPool
from kvrelay.cachetier.param_transfer import fetch_pool
from kvrelay.cachetier.segments import SHM_DIR
from kvrelay.cli.launcher import ClusterSpec, Launcher
from kvrelay.engine import identity
from kvrelay.engine.identity import IDENTITY_FILE, model_identity
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.protocol.messages import KvLayout, LoadReport, PeerInfo, Register, Role
from kvrelay.router.registry import Registry
from kvrelay.transport.curve import SocketSecurity
from tests.cluster_harness import metric_value, read_text, running_cluster, worker_stats
from tests.redis_server import redis_server  # noqa: F401 - fixture

CREDENTIAL = ClusterCredential.generate()  # the pool server's and the fetcher's
MEMBER = SocketSecurity(CREDENTIAL)

REPO = Path(__file__).resolve().parent.parent
SAMPLE = 1 << 16
BS = 16
MAX_TOKENS = 8
PROMPT = [0, *range(40, 40 + 3 * BS + 5)]  # three full blocks and a tail


def _changed_tensor(path: Path) -> tuple[str, int, int]:
    """The largest tensor whose bytes avoid the start, middle and end 64 KiB (and a margin)."""
    size = path.stat().st_size
    (header_len,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    base = 8 + header_len
    avoid = [(0, 2 * SAMPLE), (size // 2 - 2 * SAMPLE, size // 2 + 2 * SAMPLE)]
    avoid.append((size - 2 * SAMPLE, size))
    best = ("", 0, 0)
    for name, meta in header.items():
        if name == "__metadata__" or meta["dtype"] != "F32":
            continue
        start, end = base + meta["data_offsets"][0], base + meta["data_offsets"][1]
        clear = all(end <= lo or start >= hi for lo, hi in avoid)
        if clear and end - start > best[2] - best[1]:
            best = (name, start, end)
    assert best[0], "no tensor away from the sampled regions"
    return best


def _negate_in_place(path: Path, start: int, end: int) -> None:
    """Negates the float32 values in ``[start, end)`` without changing the file's size."""
    with path.open("r+b") as f:
        f.seek(start)
        values = np.frombuffer(f.read(end - start), dtype="<f4")
        f.seek(start)
        f.write((-values).astype("<f4").tobytes())


@pytest.fixture(scope="module")
def twins(tiny_model_dir, tmp_path_factory) -> tuple[Path, Path, tuple[str, int, int]]:
    twin = tmp_path_factory.mktemp("twin") / "tiny"
    shutil.copytree(tiny_model_dir, twin)
    (twin / IDENTITY_FILE).unlink()  # it describes the original's files
    changed = _changed_tensor(twin / "model.safetensors")
    _negate_in_place(twin / "model.safetensors", changed[1], changed[2])
    return Path(tiny_model_dir), twin, changed


def _old_fingerprint_inputs(path: Path) -> bytes:
    """What the sampled fingerprint read of a weight file: its size and three 64 KiB."""
    data, size = path.read_bytes(), path.stat().st_size
    mid = max(0, size // 2 - SAMPLE // 2)
    return size.to_bytes(8, "little") + data[:SAMPLE] + data[mid : mid + SAMPLE] + data[-SAMPLE:]


def test_one_tensor_changed_outside_the_samples_changes_the_identity(twins) -> None:
    a, b, (_, start, end) = twins
    wa, wb = a / "model.safetensors", b / "model.safetensors"
    assert _old_fingerprint_inputs(wa) == _old_fingerprint_inputs(wb)  # the blind spot
    assert wa.read_bytes()[:start] == wb.read_bytes()[:start]
    assert wa.read_bytes()[start:end] != wb.read_bytes()[start:end]
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (a / f).read_bytes() == (b / f).read_bytes()
    ida, idb = model_identity(a, "float32"), model_identity(b, "float32")
    assert len(ida) == len(idb) == 16 and ida != idb
    assert model_identity(a, "float32") == ida  # stable (and from the cache now)
    assert model_identity(a, "bfloat16") != ida  # the dtype is part of it


@pytest.mark.parametrize(
    "name",
    ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
     "chat_template.jinja", "special_tokens_map.json"],
)  # fmt: skip
def test_every_file_that_changes_the_model_or_its_tokens_is_covered(twins, tmp_path, name):
    a = tmp_path / "a"
    shutil.copytree(twins[0], a)
    before = model_identity(a, "float32")
    path = a / name
    path.write_bytes((path.read_bytes() if path.exists() else b"{}") + b"\n")
    assert model_identity(a, "float32") != before
    (a / "README.md").write_text("not part of the model")
    (a / IDENTITY_FILE).write_text("{}")
    changed = model_identity(a, "float32")
    assert model_identity(a, "float32") == changed


def test_make_tiny_records_the_identity_it_wrote(tiny_model_dir) -> None:
    record = json.loads((Path(tiny_model_dir) / IDENTITY_FILE).read_text())
    assert record["identity"] == model_identity(tiny_model_dir, "float32").hex()
    names = {p.name for p in identity.identity_files(tiny_model_dir)}
    assert set(record["files"]) == names and "model.safetensors" in names


_START = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from kvrelay.engine.identity import model_identity
print(model_identity(sys.argv[1], "float32").hex())
"""


def _start(model_dir: Path, cache: Path) -> tuple[str, list[str]]:
    """A fresh process computes the identity: (hex, names of the files it hashed).

    An OpenMP wait policy of its own keeps ``kvrelay.engine`` from importing torch first
    (``envs.use_short_openmp_spin``): the identity needs none of it, and the start takes
    ~0.3 s instead of ~3."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVRELAY_CACHE_DIR": str(cache)}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.run(
        [sys.executable, "-c", _START, str(model_dir)],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    hashed = [Path(line.split()[1]).name for line in proc.stderr.splitlines() if "hashed" in line]
    return proc.stdout.strip(), hashed


def test_bytes_rewritten_in_place_with_mtime_restored_are_caught_on_the_next_start(
    twins, tmp_path
) -> None:
    a, b, (_, start, end) = twins
    model = tmp_path / "model"
    shutil.copytree(a, model)
    (model / IDENTITY_FILE).unlink()
    weights = model / "model.safetensors"
    settled = max(weights.stat().st_ctime_ns, weights.stat().st_mtime_ns) + 1_100_000_000
    time.sleep(max(0.0, (settled - time.time_ns()) / 1e9))  # out of the "racy" second
    cache = tmp_path / "cache"
    first, hashed = _start(model, cache)
    assert first == model_identity(a, "float32").hex() and "model.safetensors" in hashed
    assert _start(model, cache) == (first, [])  # a restart hashes nothing
    before = weights.stat()
    _negate_in_place(weights, start, end)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (
        before.st_size, before.st_mtime_ns, before.st_ino
    )  # fmt: skip
    assert after.st_ctime_ns != before.st_ctime_ns
    again, hashed = _start(model, cache)
    assert hashed == ["model.safetensors"]
    assert again == model_identity(b, "float32").hex() != first


def test_a_pool_holding_another_identity_is_never_attached(twins) -> None:
    a, b, _ = twins
    scope = f"ident{os.getpid()}"
    with ParamPool.attach_or_create(a, "float32", scope=scope) as pool_a:
        name_b = param_ops.pool_name(model_identity(b, "float32"), "float32", scope)
        assert pool_a.name != name_b
        os.link(SHM_DIR / pool_a.name, SHM_DIR / name_b)  # b's name over a's bytes
        try:
            with pytest.raises(CorruptPool, match=model_identity(a, "float32").hex()):
                ParamPool.attach_or_create(b, "float32", scope=scope)
        finally:
            (SHM_DIR / name_b).unlink()
        with ParamPool.attach_or_create(b, "float32", scope=scope) as pool_b:
            assert pool_b.name == name_b
            assert pool_b.manifest.fingerprint == model_identity(b, "float32")
            assert pool_b.manifest.source == str(b.resolve())
    for info in param_ops.list_pools(scope):
        param_ops.remove(info.name)


def test_a_peer_serving_other_weights_fills_nothing(twins) -> None:
    a, b, _ = twins
    run = f"ident{os.getpid()}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "kvrelay", "pool", "serve", "--model", str(a),
         "--scope", f"{run}s", "--bind", "tcp://127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO), "KVRELAY_CLUSTER_SECRET": CREDENTIAL.hex()},
    )  # fmt: skip
    try:
        addr = serve.stdout.readline().strip().rsplit(" ", 1)[-1]  # type: ignore[union-attr]
        with pytest.raises(ValueError, match="a peer serves model"):
            fetch_pool(
                model_identity(b, "float32"), "float32", [addr], scope=f"{run}r", security=MEMBER
            )
        assert param_ops.list_pools(f"{run}r") == []
        got = fetch_pool(
            model_identity(a, "float32"), "float32", [addr], scope=f"{run}r", security=MEMBER
        )
        with got.pool as pool:  # the control: the same peer fills a pool of its own model
            assert pool.manifest.fingerprint == model_identity(a, "float32")
    finally:
        serve.terminate()
        serve.wait(timeout=30)
        for scope in (f"{run}s", f"{run}r"):
            for info in param_ops.list_pools(scope):
                param_ops.remove(info.name, force=True)


def test_prefill_and_decode_of_different_weights_never_pair(caplog) -> None:
    layout = KvLayout(2, 64, 16, 2, 8, "float32")
    registry = Registry()

    def add(instance_id: str, role: Role, fingerprint: bytes) -> None:
        info = PeerInfo(instance_id, role, "A", "tcp://x:1", "", None, layout, fingerprint)
        registry.register(Register(info, "tiny", 1024, 1))
        registry.report(LoadReport(instance_id, 0, 0, 64, 64))

    add("p-a", Role.PREFILL, b"a" * 16)
    with caplog.at_level(logging.WARNING, logger="kvrelay.router.registry"):
        add("d-b", Role.DECODE, b"b" * 16)
    assert "never pair" in caplog.text and "p-a" in caplog.text and "d-b" in caplog.text
    placement = registry.place()
    assert placement is not None and placement.decode is None  # end to end, no hand-off
    add("d-a", Role.DECODE, b"a" * 16)
    placement = registry.place()
    assert placement is not None and placement.decode is not None
    assert (placement.prefill.instance_id, placement.decode.instance_id) == ("p-a", "d-a")
    info = dataclasses.asdict(registry.get("d-b").info)  # type: ignore[union-attr]
    assert registry.get("d-b").as_dict()["model_identity"] == info["fingerprint"].hex()  # type: ignore[union-attr]


# -- real clusters -------------------------------------------------------------------------------


def _reference(model_dir: Path) -> str:
    """The text of transformers' greedy continuation of PROMPT (checked against kvrelay's
    offline engine token by token)."""
    import torch
    import transformers

    from kvrelay import LLM, SamplingParams

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    expected = out[0, len(PROMPT) :].tolist()
    llm = LLM(model_dir, num_blocks=64, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate([{"prompt_token_ids": PROMPT}], greedy)[0].outputs[0]
    assert got.token_ids == expected
    return got.text


def _complete(launcher):
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
    return client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def expected(twins) -> dict[Path, str]:
    """Per checkpoint: transformers' greedy continuation of PROMPT, as text."""
    pytest.importorskip("transformers")
    a, b, _ = twins
    out = {a: _reference(a), b: _reference(b)}
    assert out[a] != out[b]
    return out


def test_two_checkpoints_served_in_turn_share_no_weights_and_no_kv(
    twins,
    expected,
    tmp_path,
    redis_server,  # noqa: F811
) -> None:
    a, b, _ = twins
    server = redis_server()
    shared_l1 = f"kvrelay-ident{os.getpid()}-l1"  # one L1 pool for both clusters
    args = ("--num-blocks", "256", "--threads", "1", "--redis-url", server.url,
            "--host-pool", shared_l1)  # fmt: skip
    full_blocks = (len(PROMPT) - 1) // BS
    try:
        for i, model in enumerate((a, b, a)):
            with running_cluster(model, tmp_path / str(i), worker_args=args) as launcher:
                res = _complete(launcher)
                assert res.choices[0].text == expected[model]
                by_tier = res.usage.model_extra["kvrelay_cached_tokens_by_tier"]
                if i < 2:  # a's blocks are in L1 and Redis when b runs: no hit for b
                    assert res.usage.prompt_tokens_details.cached_tokens == 0, by_tier
                else:  # a again, on fresh workers: its own blocks come back from L1
                    assert res.usage.prompt_tokens_details.cached_tokens == full_blocks * BS
                keys = hash_blocks(PROMPT, BS, model_identity(model, "float32"))
                redis_keys = [b"kvrelay:" + k for k in keys[:full_blocks]]
                _wait_for(lambda k=redis_keys: server.client().exists(*k) == full_blocks, 60)
                pools = {s["tiers"]["host"]["pool_name"] for s in worker_stats(launcher).values()}
                assert pools == {shared_l1}
        # each built (or found: same bytes, e.g. another test run's copy) its own weights pool
        ready = {p.fingerprint for p in param_ops.list_pools() if p.state == "ready"}
        assert {model_identity(m, "float32").hex() for m in (a, b)} <= ready
    finally:
        from kvrelay.cachetier import host_ops

        host_ops.remove_host_pool(shared_l1)


def _pulled_bytes(launcher, instance_id: str) -> float:
    rows = launcher.get_json("/admin/instances")["data"]
    info = {i["instance_id"]: i for i in rows}[instance_id]
    return metric_value(
        read_text(info["status_url"] + "/metrics"), "kvrelay_kv_transfer_bytes_total"
    )


def test_a_prefill_and_a_decode_of_other_weights_refuse_to_pair(twins, expected, tmp_path):
    a, b, _ = twins
    spec = ClusterSpec(
        model=str(a), log_dir=str(tmp_path),
        worker_args=("--num-blocks", "256", "--threads", "1", "--host-pool", "off"),
        router_args=("--dead-after", "1.5", "--served-model-name", "tiny"),
    )  # fmt: skip
    launcher = Launcher(spec)
    try:
        launcher.start_router()
        launcher.add_worker("prefill")
        decode_b = launcher.add_worker("decode", ["--model", str(b)])
        launcher.wait_ready(timeout=120)
        res = _complete(launcher)  # end to end on one instance: its own model's answer
        assert res.choices[0].text in (expected[a], expected[b])
        assert _pulled_bytes(launcher, decode_b) == 0
        log = (tmp_path / "router.log").read_text()
        assert "serve different weights: they never pair" in log
        assert decode_b in log and "prefill-0" in log
        decode_a = launcher.add_worker("decode")
        launcher.wait_ready(timeout=120, names=[decode_a])
        res = _complete(launcher)  # prefill a now pairs with decode a only
        assert res.choices[0].text == expected[a]
        assert _pulled_bytes(launcher, decode_a) > 0
        assert _pulled_bytes(launcher, decode_b) == 0
    finally:
        launcher.stop()
