"""RedisTier against a real redis-server: exact bytes, prefixes, TTL/NX, corruption, outages."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import redis

from kvrelay.cachetier.base import BlockFormat
from kvrelay.cachetier.block_hash import BlockHash, hash_blocks
from kvrelay.cachetier.redis_conn import redact_url
from kvrelay.cachetier.redis_tier import RedisTier
from kvrelay.protocol.credential import ClusterCredential
from tests.redis_server import RedisServer, free_port
from tests.redis_server import redis_server as redis_server  # the fixture

FMT = BlockFormat(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
NS = b"test:"
LOGGER = "kvrelay.cachetier.redis_tier"
RECOVERY_DEADLINE_S = 30.0

StartServer = Callable[..., RedisServer]
MakeTier = Callable[..., RedisTier]


def make_keys(n: int, seed: int = 0) -> list[BlockHash]:
    return hash_blocks(list(range(seed, seed + n * FMT.block_size)), FMT.block_size, b"fp")


def make_payloads(n: int, seed: int = 0, fmt: BlockFormat = FMT) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, fmt.payload_bytes, dtype=np.uint8) for _ in range(n)]


@pytest.fixture
def make_tier() -> Iterator[MakeTier]:
    """RedisTier factory (namespace ``test:``); closes every tier and checks no writer is left."""
    tiers: list[RedisTier] = []

    def make(url: str, fmt: BlockFormat = FMT, **options: object) -> RedisTier:
        tier = RedisTier(url, fmt, namespace=NS, **options)  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
    left = [t.name for t in threading.enumerate() if t.name.startswith("kvrelay-redis-")]
    assert left == []


@pytest.fixture
def server(redis_server: StartServer) -> RedisServer:
    return redis_server()


def raw_value(raw: redis.Redis, key: BlockHash) -> bytes:
    value = raw.get(NS + key)
    assert isinstance(value, bytes)
    return value


def store(tier: RedisTier, keys: list[BlockHash], payloads: list[np.ndarray]) -> None:
    assert tier.put(list(zip(keys, payloads))) == len(keys)
    assert tier.flush(10.0)


def test_round_trip_exact_bytes(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url)
    keys, payloads = make_keys(3), make_payloads(3)
    store(tier, keys, payloads)

    assert tier.lookup(keys) == 3
    got = tier.get(keys)
    assert len(got) == 3
    for arr, want in zip(got, payloads):
        assert arr.dtype == np.uint8 and arr.flags.writeable and arr.flags.owndata
        assert arr.tobytes() == want.tobytes()
    raw = server.client()
    assert raw_value(raw, keys[0])[64:] == payloads[0].tobytes()
    stats = tier.stats()
    assert stats["put_blocks"] == 3
    assert stats["bytes_written"] == 3 * FMT.value_bytes
    assert stats["bytes_read"] == 3 * FMT.payload_bytes
    assert (stats["lookups"], stats["query_blocks"], stats["hit_blocks"]) == (2, 6, 6)
    assert (stats["errors"], stats["dropped_puts"], stats["queue_depth"]) == (0, 0, 0)
    assert stats["available"] is True


def test_longest_prefix(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url)
    keys, payloads = make_keys(5), make_payloads(5)
    store(tier, [keys[i] for i in (0, 1, 3)], [payloads[i] for i in (0, 1, 3)])

    assert tier.lookup(keys) == 2
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads[:2]]
    assert tier.lookup(keys[2:]) == 0
    assert tier.get(keys[2:]) == []
    assert tier.lookup(keys[3:4]) == 1
    assert tier.lookup([]) == 0
    assert tier.get([]) == []


def test_ttl_set_and_refreshed(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url, ttl_seconds=100)
    keys, payloads = make_keys(1), make_payloads(1)
    store(tier, keys, payloads)
    raw = server.client()
    assert 0 < raw.ttl(NS + keys[0]) <= 100

    raw.expire(NS + keys[0], 5)
    store(tier, keys, payloads)
    assert 5 < raw.ttl(NS + keys[0]) <= 100
    stats = tier.stats()
    assert (stats["put_blocks"], stats["refreshed_blocks"]) == (1, 1)


def test_nx_keeps_first_value(server: RedisServer, make_tier: MakeTier) -> None:
    first, second = make_tier(server.url), make_tier(server.url)
    keys = make_keys(1)
    (a,), (b,) = make_payloads(1, seed=1), make_payloads(1, seed=2)
    store(first, keys, [a])
    store(second, keys, [b])

    assert [x.tobytes() for x in second.get(keys)] == [a.tobytes()]
    assert second.stats()["put_blocks"] == 0
    assert second.stats()["refreshed_blocks"] == 1


@pytest.mark.parametrize("tamper", ["garbage", "other_key", "flipped_byte"])
def test_corrupt_value_is_a_miss_and_deleted(
    server: RedisServer, make_tier: MakeTier, tamper: str
) -> None:
    tier = make_tier(server.url)
    keys, payloads = make_keys(3), make_payloads(3)
    store(tier, [keys[0], keys[2]], [payloads[0], payloads[2]])
    raw = server.client()
    if tamper == "garbage":
        bad = b"garbage"
    elif tamper == "other_key":
        bad = raw_value(raw, keys[0])
    else:
        good = bytearray(raw_value(raw, keys[2]))
        good[100] ^= 1
        bad = bytes(good)
    raw.set(NS + keys[1], bad)

    got = tier.get(keys)
    assert [a.tobytes() for a in got] == [payloads[0].tobytes()]
    stats = tier.stats()
    assert (stats["errors"], stats["available"]) == (1, True)
    assert tier.flush(10.0)
    assert raw.exists(NS + keys[1]) == 0  # deleted, so a good copy can be stored again

    store(tier, keys[1:2], payloads[1:2])
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads]


def test_put_is_write_behind(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url, timeout=10.0)
    keys, payloads = make_keys(3), make_payloads(3)
    raw = server.client()
    raw.client_pause(60_000, all=False)  # writes block in the server; reads still answer
    try:
        assert tier.put(list(zip(keys, payloads))) == 3  # returns with nothing written yet
        assert raw.exists(*[NS + k for k in keys]) == 0
        assert tier.stats()["queue_depth"] == 3
    finally:
        raw.client_unpause()
    assert tier.flush(10.0)
    assert raw.exists(*[NS + k for k in keys]) == 3
    assert tier.stats()["queue_depth"] == 0


def test_queue_overflow_drops_and_counts(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url, queue_blocks=4, batch_blocks=2)
    keys, payloads = make_keys(10), make_payloads(10)
    assert tier.put(list(zip(keys, payloads))) == 4
    assert tier.flush(10.0)
    stats = tier.stats()
    assert (stats["dropped_puts"], stats["put_blocks"]) == (6, 4)
    assert tier.lookup(keys) == 4


def test_put_rejects_wrong_payload(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url)
    with pytest.raises(ValueError, match="uint8 of 512 bytes"):
        tier.put([(make_keys(1)[0], np.zeros(10, dtype=np.uint8))])


def test_redis_absent_is_a_counted_miss(
    make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    url = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    tier = make_tier(url, credential=ClusterCredential.generate())  # no "unkeyed" warning
    keys, payloads = make_keys(2), make_payloads(2)
    for _ in range(5):
        assert tier.lookup(keys) == 0
        assert tier.get(keys) == []
        tier.put(list(zip(keys, payloads)))
    assert tier.flush(10.0)

    stats = tier.stats()
    assert stats["errors"] >= 1
    assert stats["skipped_calls"] >= 1
    assert stats["available"] is False
    assert stats["dropped_puts"] == 10
    assert stats["hit_blocks"] == 0
    assert "hunter2" not in stats["url"]
    assert "used_bytes" not in stats
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unavailable" in warnings[0].getMessage()


def test_killed_mid_run_then_recovers(
    server: RedisServer, make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = make_tier(server.url)
    keys, payloads = make_keys(4), make_payloads(4)
    store(tier, keys, payloads)
    running, stopped = threading.Event(), threading.Event()

    def kill() -> None:
        running.wait()
        server.stop(kill=True)
        stopped.set()

    killer = threading.Thread(target=kill)
    killer.start()
    num_after_stop = 0
    while num_after_stop < 50:
        tier.put(list(zip(keys, payloads)))
        tier.lookup(keys)
        tier.get(keys)
        tier.stats()
        running.set()
        num_after_stop += stopped.is_set()
    killer.join()
    stats = tier.stats()
    assert stats["errors"] >= 1
    assert stats["available"] is False

    server.start()  # empty, on the same port
    deadline = time.monotonic() + RECOVERY_DEADLINE_S
    while tier.get(keys) == [] and time.monotonic() < deadline:
        tier.put(list(zip(keys, payloads)))
        tier.flush(10.0)
        time.sleep(0.05)
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads]
    assert tier.stats()["available"] is True
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [m for level, m in messages if level == logging.WARNING and "unavailable" in m] != []
    assert sum("is back" in m for _, m in messages) >= 1


def test_availability_returns_within_a_probe_interval_without_traffic(
    server: RedisServer, make_tier: MakeTier
) -> None:
    """With the backoff at its 10 s cap and no calls at all, the probe finds Redis back."""
    tier = make_tier(server.url, probe_interval=0.2)
    server.stop(kill=True)
    assert tier.lookup(make_keys(1)) == 0  # the failure opens the breaker
    for _ in range(8):  # as after a long outage: the backoff grew to its cap
        tier._breaker.record_failure("test", ConnectionError("still down"))
    assert tier.stats()["available"] is False
    server.start()
    deadline = time.monotonic() + 5.0  # half the capped backoff: only the probe can do it
    while not tier.stats()["available"]:
        assert time.monotonic() < deadline, "the probe did not find redis back"
        time.sleep(0.05)
    keys, payloads = make_keys(2), make_payloads(2)
    store(tier, keys, payloads)
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads]


def test_server_is_allkeys_lru_and_evicts(redis_server: StartServer, make_tier: MakeTier) -> None:
    server = redis_server(maxmemory="8mb")
    raw = server.client()
    assert raw.config_get("maxmemory-policy") == {"maxmemory-policy": "allkeys-lru"}
    big = BlockFormat(num_layers=4, block_size=16, num_kv_heads=8, head_dim=64, dtype="float16")
    assert big.payload_bytes == 128 * 1024
    tier = make_tier(server.url, fmt=big, batch_blocks=4)
    keys, payloads = make_keys(128), make_payloads(128, fmt=big)  # 16 MiB into 8 MiB
    for i in range(0, 128, 8):
        assert tier.put(list(zip(keys[i : i + 8], payloads[i : i + 8]))) == 8
        assert tier.flush(10.0)

    stats = tier.stats()
    assert stats["errors"] == 0 and stats["put_blocks"] == 128
    assert stats["maxmemory"] == 8 * 1024 * 1024
    assert 0 < stats["used_bytes"] <= stats["maxmemory"]
    assert stats["evicted_keys"] > 0
    assert tier.lookup(keys[-1:]) == 1
    assert [a.tobytes() for a in tier.get(keys[-1:])] == [payloads[-1].tobytes()]


def test_stats_report_server_memory(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url)
    stats = tier.stats()
    assert stats["maxmemory"] == 64 * 1024 * 1024
    assert stats["evicted_keys"] == 0
    assert stats["used_bytes"] > 0
    assert stats["url"] == server.url


def test_redact_url() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:s3cret@h:6379/1") == "rediss://user:***@h:6379/1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert redact_url("unix:///tmp/r.sock?db=0&password=s3cret") == (
        "unix:///tmp/r.sock?db=0&password=***"
    )


def test_invalid_options_raise() -> None:
    with pytest.raises(ValueError, match="queue_blocks must be > 0"):
        RedisTier("redis://127.0.0.1:1/0", FMT, queue_blocks=0)


def test_rejections_are_logged_at_most_once_a_minute(
    server: RedisServer, make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = make_tier(server.url, credential=ClusterCredential.generate())
    keys, payloads = make_keys(4), make_payloads(4)
    store(tier, keys, payloads)
    raw = server.client()
    for key in keys[1:]:
        raw.set(NS + key, raw_value(raw, keys[0]))  # replayed under other keys
    assert len(tier.get(keys)) == 1
    assert tier.stats()["errors_by_reason"] == {"bad_header": 3}  # the whole chain swept
    assert len(tier.get(keys)) == 1  # deleted now, or still there: a miss either way
    rejected = [r for r in caplog.records if "rejected block" in r.getMessage()]
    assert len(rejected) == 1 and rejected[0].levelno == logging.WARNING
    assert tier.flush(10.0)
    assert raw.exists(*[NS + k for k in keys[1:]]) == 0


def test_no_credential_is_a_loud_warning(
    server: RedisServer, make_tier: MakeTier, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    tier = make_tier(server.url)
    assert tier.stats()["seal"] == "unkeyed"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "unauthenticated" in warnings[0]
    keyed = make_tier(server.url, credential=ClusterCredential.generate(), encrypt=True)
    assert keyed.stats()["seal"] == "aead"


def test_get_reads_a_long_prefix_in_batches(server: RedisServer, make_tier: MakeTier) -> None:
    tier = make_tier(server.url, batch_blocks=4)
    keys, payloads = make_keys(11), make_payloads(11)
    store(tier, keys[:9], payloads[:9])
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads[:9]]
    raw = server.client()
    before = int(raw.info("stats")["total_commands_processed"])
    assert len(tier.get(keys[:3] + keys[10:] + keys[3:9])) == 3  # stops at the gap
    calls = int(raw.info("stats")["total_commands_processed"]) - before - 1  # the INFO itself
    assert calls == 1  # one MGET of the first 4 keys; the batches after the gap never sent
