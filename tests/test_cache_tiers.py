"""The global KV cache tier with real processes: L1 host pool across instances, L2 Redis
across "hosts", cache-aware placement, outages, and what stats and usage report.

Every case checks that outputs with cache hits equal the offline engine's (no cache).
"""

from __future__ import annotations

import time

import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cachetier.block_hash import hash_blocks
from tests.cluster_harness import (
    metric_value,
    read_text,
    running_cluster,
    wait_idle,
    worker_stats,
)
from tests.redis_server import redis_server  # noqa: F401 - fixture

BS = 16
MAX_TOKENS = 8
SYSTEM = "You are a careful assistant. Answer briefly and cite the cache tier. " * 6


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    llm = LLM(tiny_model_dir, num_blocks=512, enable_prefix_caching=False)
    tok = llm.get_tokenizer()
    texts = [SYSTEM + "Question one?", SYSTEM + "Question two, longer than the first one?"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(texts, greedy)
    return [(t, tok.encode(t), o.outputs[0].text) for t, o in zip(texts, outs)]


def _client(launcher) -> openai.OpenAI:
    return openai.OpenAI(base_url=launcher.url + "/v1", api_key="unused", max_retries=0)


def _complete(launcher, prompt: str):
    return _client(launcher).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def _full_blocks(ids: list[int]) -> int:
    """Tokens in the blocks a hit can cover (the last token is always computed)."""
    return (len(ids) - 1) // BS * BS


def _by_tier(res) -> dict[str, int]:
    return res.usage.model_extra["kvrelay_cached_tokens_by_tier"]


def _drain(launcher, instance_id: str) -> None:
    import urllib.request

    req = urllib.request.Request(
        launcher.url + f"/admin/instances/{instance_id}/drain", method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def test_device_hit_routes_back_and_reports_cached_tokens(tiny_model_dir, tmp_path, prompts):
    text, ids, expected = prompts[0]
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=2) as launcher:
        first = _complete(launcher, text)
        assert first.choices[0].text == expected
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        time.sleep(0.5)  # a heartbeat carries the cache events to the router
        second = _complete(launcher, text)
        assert second.choices[0].text == expected
        # cache-aware placement sent it back to the instance that holds the prefix
        assert second.usage.prompt_tokens_details.cached_tokens == _full_blocks(ids)
        assert _by_tier(second) == {"device": _full_blocks(ids)}


def test_host_pool_hit_on_another_instance(tiny_model_dir, tmp_path, prompts):
    text, ids, expected = prompts[0]
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=2) as launcher:
        assert _complete(launcher, text).choices[0].text == expected
        stats = worker_stats(launcher)
        served = next(
            i
            for i, s in stats.items()
            if i.startswith("prefill") and s["tiers"]["device"]["query_tokens"]
        )
        _drain(launcher, served)
        second = _complete(launcher, text)
        assert second.choices[0].text == expected
        assert second.usage.prompt_tokens_details.cached_tokens == _full_blocks(ids)
        assert _by_tier(second) == {"device": 0, "host": _full_blocks(ids)}
        other = next(i for i in stats if i.startswith("prefill") and i != served)
        host = worker_stats(launcher)[other]["tiers"]["host"]
        assert host["hit_tokens"] == _full_blocks(ids)
        report = launcher.get_json("/admin/cache/stats")
        assert report["tiers"]["host"]["hit_tokens"] == _full_blocks(ids)
        assert report["tiers"]["host"]["used_blocks"] >= _full_blocks(ids) // BS
        inst = {d["instance_id"]: d for d in launcher.get_json("/admin/instances")["data"]}
        metrics = read_text(inst[other]["status_url"] + "/metrics")
        hits = metric_value(metrics, "kvrelay_prefix_cache_hits_total", tier="host")
        assert hits == _full_blocks(ids)


def _undrain(launcher, instance_id: str) -> None:
    import urllib.request

    req = urllib.request.Request(
        launcher.url + f"/admin/instances/{instance_id}/undrain", method="POST"
    )
    with urllib.request.urlopen(req, timeout=5) as resp:
        assert resp.status == 200


def _instance(launcher, instance_id: str) -> dict:
    data = launcher.get_json("/admin/instances")["data"]
    return next(d for d in data if d["instance_id"] == instance_id)


def test_placement_follows_the_prefix_into_the_host_pool(tiny_model_dir, tmp_path, prompts):
    """Host A computes a prompt; small device pools then force it out of A's device cache,
    but it stays in A's L1. The same prompt then goes to A (not to idle B, which a tie on
    load would pick: B registered first) and is read from A's L1, with the same output."""
    text, ids, expected = prompts[0]
    num_blocks = 24  # the prompt and its reply take 15; the filler prompts push it out
    cluster_id = f"tp{time.monotonic_ns()}"  # both pools under it: swept and leak-checked
    host_b = ("--host-id", "hostB", "--host-pool", f"kvrelay-{cluster_id}-hostB")
    host_a = ("--host-id", "hostA", "--host-pool", f"kvrelay-{cluster_id}-hostA")
    with running_cluster(
        tiny_model_dir,
        tmp_path,
        cluster_id=cluster_id,
        worker_args=("--num-blocks", str(num_blocks), "--threads", "1", *host_b),
    ) as launcher:
        added = [launcher.add_worker(role, host_a) for role in ("prefill", "decode")]
        launcher.wait_ready(names=added)
        a, b = added[0], "prefill-0"
        for instance_id in (b, "decode-0"):  # warm-up on host A alone
            _drain(launcher, instance_id)
        assert _complete(launcher, text).choices[0].text == expected
        for i in range(4):  # 4 x 10 blocks through A's 24: the prompt's blocks are evicted
            filler = f"Filler {i}: " + "the quick brown fox jumps over the lazy dog. " * 6
            _complete(launcher, filler)
        wait_idle(launcher)

        def router_caught_up() -> bool:  # heartbeats carry A's evictions and L1 writes
            index = launcher.get_json("/admin/cache/stats")["placement_index"]
            cached = worker_stats(launcher)[a]["tiers"]["device"]["cached_blocks"]
            in_l1 = index["host"]["hosts"].get("hostA", 0)
            return index["device"]["instances"].get(a) == cached and in_l1 >= len(ids) // BS

        _wait_for(router_caught_up)  # else placement could still credit A's evicted blocks
        index = launcher.get_json("/admin/cache/stats")["placement_index"]
        assert index["host"]["hosts"]["hostA"] >= len(ids) // BS
        assert "hostB" not in index["host"]["hosts"]  # decode-0 was drained: B wrote nothing
        _undrain(launcher, b)
        _wait_for(lambda: not _instance(launcher, b)["draining"])  # its report says so too

        second = _complete(launcher, text)
        assert second.choices[0].text == expected
        assert _by_tier(second) == {"device": 0, "host": _full_blocks(ids)}
        stats = worker_stats(launcher)
        assert stats[a]["tiers"]["host"]["hit_tokens"] == _full_blocks(ids)
        assert stats[b]["tiers"]["device"]["query_tokens"] == 0  # B never got a request
        metrics = read_text(launcher.url + "/metrics")
        hits = "kvrelay_placement_prefix_hits_total"
        assert metric_value(metrics, hits, tier="host") == 1
        assert metric_value(metrics, hits, tier="device") == 0
        blocks = metric_value(metrics, "kvrelay_placement_prefix_blocks_total", tier="host")
        assert blocks == len(ids) // BS


def test_redis_hit_from_a_cold_host(tiny_model_dir, tmp_path, prompts, redis_server):  # noqa: F811
    server = redis_server()
    text, ids, expected = prompts[1]
    common = ("--num-blocks", "512", "--threads", "1", "--redis-url", server.url)
    cluster_id = f"tc{time.monotonic_ns()}"  # both pools under it: swept and leak-checked
    with running_cluster(
        tiny_model_dir,
        tmp_path,
        num_prefill=1,
        cluster_id=cluster_id,
        worker_args=(*common, "--host-pool", f"kvrelay-{cluster_id}-hostA"),
    ) as launcher:
        assert _complete(launcher, text).choices[0].text == expected
        keys = hash_blocks(ids, BS, _fingerprint(launcher))
        _wait_for(
            lambda: server.client().exists(*[b"kvrelay:" + k for k in keys[: len(ids) // BS]]) > 0
        )
        cold_pool = f"kvrelay-{launcher.cluster_id}-hostB"
        name = launcher.add_worker("prefill", ["--host-pool", cold_pool])
        launcher.wait_ready(names=[name])
        _drain(launcher, "prefill-0")
        _wait_for(lambda: _flushed(server, keys, len(ids) // BS))
        second = _complete(launcher, text)
        assert second.choices[0].text == expected
        assert _by_tier(second) == {"device": 0, "redis": _full_blocks(ids)}
        redis_stats = worker_stats(launcher)[name]["tiers"]["redis"]
        assert redis_stats["hit_tokens"] == _full_blocks(ids)
        assert redis_stats["errors"] == 0


def test_redis_outage_degrades_and_recovers(tiny_model_dir, tmp_path, prompts, redis_server):  # noqa: F811
    server = redis_server()
    common = (
        "--num-blocks",
        "512",
        "--threads",
        "1",
        "--redis-url",
        server.url,
        "--host-pool",
        "off",
    )
    with running_cluster(tiny_model_dir, tmp_path, worker_args=common) as launcher:
        text, _, expected = prompts[0]
        assert _complete(launcher, text).choices[0].text == expected
        server.stop(kill=True)
        text, _, expected = prompts[1]  # not cached anywhere: computed while Redis is down
        assert _complete(launcher, text).choices[0].text == expected
        stats = worker_stats(launcher).values()
        assert sum(s["tiers"]["redis"]["errors"] for s in stats) > 0
        assert any(not s["tiers"]["redis"]["available"] for s in stats)
        written = sum(s["tiers"]["redis"]["put_blocks"] for s in stats)
        server.start()

        attempt = iter(range(1000))

        def recovered() -> bool:  # fresh prompts: new blocks to look up and to write
            _complete(launcher, f"{next(attempt)} " + prompts[1][0])
            now = worker_stats(launcher).values()
            return all(s["tiers"]["redis"]["available"] for s in now) and (
                sum(s["tiers"]["redis"]["put_blocks"] for s in now) > written
            )

        _wait_for(recovered, timeout=60)


def _fingerprint(launcher) -> bytes:
    from kvrelay.engine.identity import model_identity

    return model_identity(launcher.spec.model, "float32")


def _flushed(server, keys, n: int) -> bool:
    return server.client().exists(*[b"kvrelay:" + k for k in keys[:n]]) == n


def _wait_for(predicate, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.2)
