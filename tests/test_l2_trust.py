"""The global tier inside the trust boundary, with real processes and a real redis-server.

An attacker who can write Redis forges blocks (noise with the unkeyed checksum recomputed,
valid blocks replayed under other keys): every answer equals the unforged one, the forged
blocks are rejected and counted, and the worker keeps serving. Encrypted blocks hold no run
of the KV. ``cache_salt`` keeps tenants' prefixes apart in every tier and in placement.
"""

from __future__ import annotations

import time

import numpy as np
import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cachetier.base import _HEADER, DTYPE_CODES, HEADER_BYTES, BlockFormat, pack_header
from kvrelay.cachetier.block_hash import BlockHash, hash_blocks
from kvrelay.protocol.credential import ClusterCredential
from tests.cluster_harness import metric_value, read_text, running_cluster, worker_stats
from tests.redis_server import redis_server  # noqa: F401 - fixture

BS = 16
MAX_TOKENS = 8
NS = b"kvrelay:"
TEXTS = (
    "Alpha bravo charlie delta echo foxtrot golf hotel india juliett kilo lima mike. " * 4,
    "Zulu yankee x-ray whiskey victor uniform tango sierra romeo quebec papa oscar. " * 4,
)


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=512, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(list(TEXTS), greedy)
    return [(t, tok.encode(t), o.outputs[0].text) for t, o in zip(TEXTS, outs)]


@pytest.fixture
def secret(monkeypatch: pytest.MonkeyPatch) -> ClusterCredential:
    credential = ClusterCredential.generate()
    monkeypatch.setenv("KVRELAY_CLUSTER_SECRET", credential.hex())
    monkeypatch.delenv("KVRELAY_CLUSTER_SECRET_FILE", raising=False)
    return credential


def _complete(launcher, prompt: str, salt: str | None = None):
    client = openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)
    extra: dict[str, object] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    return client.completions.create(
        model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra
    )


def _num_blocks(ids: list[int]) -> int:
    return (len(ids) - 1) // BS


def _by_tier(res) -> dict[str, int]:
    return res.usage.model_extra["kvrelay_cached_tokens_by_tier"]


def _keys(launcher, ids: list[int]) -> list[BlockHash]:
    from kvrelay.engine.identity import model_identity

    return hash_blocks(ids, BS, model_identity(launcher.spec.model, "float32"))[: _num_blocks(ids)]


def _wait_stored(server, keys: list[BlockHash], timeout: float = 20.0) -> list[bytes]:
    raw = server.client()
    deadline = time.monotonic() + timeout
    while raw.exists(*[NS + k for k in keys]) != len(keys):
        assert time.monotonic() < deadline, "blocks not written to Redis in time"
        time.sleep(0.2)
    return [bytes(raw.get(NS + k)) for k in keys]  # type: ignore[arg-type]


def _format_of(value: bytes) -> BlockFormat:
    fields = _HEADER.unpack(value[:HEADER_BYTES])
    dtype = {code: name for name, code in DTYPE_CODES.items()}[fields[2]]
    return BlockFormat(fields[3], fields[4], fields[5], fields[6], dtype)


def _forge_unkeyed(key: BlockHash, value: bytes, seed: int) -> bytes:
    """Noise under the unkeyed format, its xxh3 checksum recomputed: what the issue did."""
    fmt = _format_of(value)
    noise = np.random.default_rng(seed).integers(0, 256, fmt.payload_bytes, dtype=np.uint8)
    return pack_header(fmt, key, noise) + noise.tobytes()


def _cold_worker(launcher) -> str:
    """A fresh prefill worker (no host pool), with every other prefill drained: the next
    request can only find its prefix in Redis."""
    import urllib.request

    old = [i for i in worker_stats(launcher) if i.startswith("prefill")]
    name = launcher.add_worker("prefill", ["--host-pool", "off"])
    launcher.wait_ready(names=[name])
    for instance_id in old:
        url = launcher.url + f"/admin/instances/{instance_id}/drain"
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5):
            pass
    return name


def _redis_errors(launcher, name: str) -> dict[str, int]:
    return worker_stats(launcher)[name]["tiers"]["redis"]["errors_by_reason"]


@pytest.mark.parametrize("encrypt", [False, True], ids=["mac", "aead"])
def test_forged_blocks_never_reach_a_user(
    tiny_model_dir,
    tmp_path,
    prompts,
    redis_server,  # noqa: F811
    secret,
    encrypt,
):
    server = redis_server()
    (text_a, ids_a, want_a), (text_b, ids_b, want_b) = prompts
    flags = ("--num-blocks", "512", "--threads", "1", "--redis-url", server.url)
    flags += ("--host-pool", "off", "--l2-encrypt" if encrypt else "--no-l2-encrypt")
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, worker_args=flags) as launcher:
        assert _complete(launcher, text_a).choices[0].text == want_a
        assert _complete(launcher, text_b).choices[0].text == want_b
        keys_a, keys_b = _keys(launcher, ids_a), _keys(launcher, ids_b)
        values_a = _wait_stored(server, keys_a)
        _wait_stored(server, keys_b)
        raw = server.client()
        for i, (key, value) in enumerate(zip(keys_a, values_a)):
            raw.set(NS + key, _forge_unkeyed(key, value, i))
        for key, value in zip(keys_b, values_a):  # valid blocks, replayed under other keys
            raw.set(NS + key, value)

        name = _cold_worker(launcher)
        for text, want in ((text_a, want_a), (text_b, want_b)):
            res = _complete(launcher, text)
            assert res.choices[0].text == want
            assert res.usage.prompt_tokens_details.cached_tokens == 0
            assert _by_tier(res).get("redis", 0) == 0
        errors = _redis_errors(launcher, name)  # every forged block read, not only the first
        assert errors == {"unkeyed": len(keys_a), "bad_header": min(len(keys_a), len(keys_b))}
        inst = {d["instance_id"]: d for d in launcher.get_json("/admin/instances")["data"]}
        metrics = read_text(inst[name]["status_url"] + "/metrics")
        counted = metric_value(
            metrics, "kvrelay_cache_tier_errors_total", tier="redis", reason="unkeyed"
        )
        assert counted == len(keys_a)
        # Still serving, and the rejected blocks were replaced by good ones: another cold
        # worker reads the whole prefix of A from Redis.
        seal = 2 if encrypt else 1
        _wait_for(lambda: all(v[56] == seal for v in _wait_stored(server, keys_a)))
        second = _cold_worker(launcher)
        res = _complete(launcher, text_a)
        assert res.choices[0].text == want_a
        assert _by_tier(res) == {"device": 0, "redis": _num_blocks(ids_a) * BS}
        assert sum(_redis_errors(launcher, second).values()) == 0


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)


def test_encrypted_blocks_hold_no_plaintext(
    tiny_model_dir,
    tmp_path,
    prompts,
    redis_server,  # noqa: F811
    secret,
):
    server = redis_server()
    text, ids, want = prompts[0]
    flags = ("--num-blocks", "512", "--threads", "1", "--redis-url", server.url)
    flags += ("--host-pool", "off")
    plain: list[bytes] = []
    with running_cluster(
        tiny_model_dir, tmp_path / "mac", worker_args=(*flags, "--no-l2-encrypt")
    ) as launcher:
        assert _complete(launcher, text).choices[0].text == want
        values = _wait_stored(server, _keys(launcher, ids))
        fmt = _format_of(values[0])
        plain = [v[HEADER_BYTES : HEADER_BYTES + fmt.payload_bytes] for v in values]
    server.client().flushall()
    with running_cluster(tiny_model_dir, tmp_path / "aead", worker_args=flags) as launcher:
        assert _complete(launcher, text).choices[0].text == want
        values = _wait_stored(server, _keys(launcher, ids))
        stats = worker_stats(launcher)
    assert {s["tiers"]["redis"]["seal"] for s in stats.values()} == {"aead"}
    assert len(values) == len(plain) == _num_blocks(ids)
    for value, payload in zip(values, plain):
        assert value[:4] == b"KVRB"
        runs = {payload[i : i + 32] for i in range(0, len(payload) - 32, 32)}
        runs.discard(bytes(32))  # all-zero runs are not the KV; noise has none either
        assert runs, "the plaintext block has content"
        assert not any(run in value for run in runs)


def test_cache_salt_scopes_prefix_sharing(tiny_model_dir, tmp_path, prompts):
    text, ids, want = prompts[0]
    full = _num_blocks(ids) * BS
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=2) as launcher:
        first = _complete(launcher, text, salt="tenant-a")
        assert first.choices[0].text == want
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(0.5)  # a heartbeat carries the cache events to the router
        other = _complete(launcher, text, salt="tenant-b")
        assert other.choices[0].text == want
        assert other.usage.prompt_tokens_details.cached_tokens == 0
        unsalted = _complete(launcher, text)
        assert unsalted.choices[0].text == want
        assert unsalted.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(0.5)
        same = _complete(launcher, text, salt="tenant-a")
        assert same.choices[0].text == want
        # the router placed it on the instance holding tenant-a's prefix: a device hit
        assert same.usage.prompt_tokens_details.cached_tokens == full
        assert _by_tier(same) == {"device": full}
