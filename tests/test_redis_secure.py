"""The L2 tier against a secured redis-server: AUTH (requirepass), an ACL user allowed only
the commands the tier uses, TLS with client certificates. Right credentials connect; wrong
ones leave the tier unavailable, loudly (a WARNING, ``available`` false), never failing a
request."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from kvrelay.cachetier.base import BlockFormat
from kvrelay.cachetier.block_hash import hash_blocks
from kvrelay.cachetier.redis_conn import RedisEndpoint
from kvrelay.cachetier.redis_tier import RedisTier
from kvrelay.protocol.credential import ClusterCredential
from tests.cluster_harness import running_cluster
from tests.redis_server import RedisServer
from tests.redis_server import redis_server as redis_server  # the fixture
from tests.tls_ca import TestCa

FMT = BlockFormat(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16")
CRED = ClusterCredential(bytes(32))
LOGGER = "kvrelay.cachetier.redis_tier"
PASSWORD = "s3cret-pass"
# The ACL of DESIGN.md: the tier's keys only, the tier's commands only.
ACL = (
    "--user", "default", "off",
    "--user", "kvrelay", "on", f">{PASSWORD}", "~kvrelay:*", "resetchannels", "-@all",
    "+mget", "+exists", "+expire", "+set", "+del", "+ping", "+info",
)  # fmt: skip

StartServer = Callable[..., RedisServer]


@pytest.fixture
def make_tier() -> Iterator[Callable[..., RedisTier]]:
    tiers: list[RedisTier] = []

    def make(endpoint: RedisEndpoint) -> RedisTier:
        tier = RedisTier(endpoint, FMT, credential=CRED, encrypt=True, timeout=2.0)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()
    assert [t for t in threading.enumerate() if t.name == "kvrelay-redis-writer"] == []


def _password_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"pw-{abs(hash(text))}"
    path.write_text(text + "\n")
    return str(path)


def _round_trip(tier: RedisTier) -> None:
    keys = hash_blocks(list(range(8)), FMT.block_size, b"fp")
    rng = np.random.default_rng(0)
    payloads = [rng.integers(0, 256, FMT.payload_bytes, dtype=np.uint8) for _ in keys]
    assert tier.put(list(zip(keys, payloads))) == len(keys)
    assert tier.flush(10.0)
    assert [a.tobytes() for a in tier.get(keys)] == [p.tobytes() for p in payloads]
    stats = tier.stats()
    assert stats["available"] is True and stats["errors"] == 0 and stats["put_blocks"] == 2


def _assert_refused(tier: RedisTier, caplog: pytest.LogCaptureFixture, why: str) -> None:
    keys = hash_blocks(list(range(4)), FMT.block_size, b"fp")
    assert tier.get(keys) == []
    stats = tier.stats()
    assert stats["available"] is False
    assert stats["errors_by_reason"].get("unavailable", 0) >= 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("unavailable" in w and why in w for w in warnings), warnings


def test_requirepass(
    redis_server: StartServer,
    make_tier,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = redis_server(password=PASSWORD)
    _round_trip(
        make_tier(RedisEndpoint(server.url, password_file=_password_file(tmp_path, PASSWORD)))
    )
    url_with_password = server.url.replace("redis://", f"redis://:{PASSWORD}@")
    assert make_tier(RedisEndpoint(url_with_password)).stats()["available"] is True

    wrong = make_tier(RedisEndpoint(server.url, password_file=_password_file(tmp_path, "nope")))
    _assert_refused(wrong, caplog, "Authentication")
    _assert_refused(make_tier(RedisEndpoint(server.url)), caplog, "Authentication")
    assert "s3cret" not in caplog.text and "nope" not in caplog.text


def test_acl_user_with_only_the_tiers_commands(
    redis_server: StartServer, make_tier, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    server = redis_server(extra_args=ACL, username="kvrelay", password=PASSWORD)
    url = server.url.replace("redis://", "redis://kvrelay@")
    _round_trip(make_tier(RedisEndpoint(url, password_file=_password_file(tmp_path, PASSWORD))))
    assert "NOPERM" not in caplog.text
    other_user = server.url.replace("redis://", "redis://intruder@")
    refused = make_tier(RedisEndpoint(other_user, password_file=_password_file(tmp_path, PASSWORD)))
    _assert_refused(refused, caplog, "")


def test_tls_with_client_certificates(
    redis_server: StartServer, make_tier, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ca = TestCa.create(tmp_path / "ca")
    server = redis_server(tls=ca)
    assert server.url.startswith("rediss://")
    good = RedisEndpoint(
        server.url,
        ca_file=str(ca.ca_cert),
        cert_file=str(ca.client_cert),
        key_file=str(ca.client_key),
    )
    _round_trip(make_tier(good))

    no_client_cert = RedisEndpoint(server.url, ca_file=str(ca.ca_cert))
    _assert_refused(make_tier(no_client_cert), caplog, "")
    other_ca = TestCa.create(tmp_path / "other", name="not-the-servers-ca")
    wrong_ca = RedisEndpoint(
        server.url,
        ca_file=str(other_ca.ca_cert),
        cert_file=str(ca.client_cert),
        key_file=str(ca.client_key),
    )
    _assert_refused(make_tier(wrong_ca), caplog, "certificate verify failed")
    plaintext = server.url.replace("rediss://", "redis://")
    _assert_refused(make_tier(RedisEndpoint(plaintext)), caplog, "")


def test_endpoint_rejects_inconsistent_options(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    pem.write_text("x")
    with pytest.raises(ValueError, match="need a rediss:// \\(TLS\\) url"):
        RedisEndpoint("redis://h:6379/0", ca_file=str(pem))
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        RedisEndpoint("rediss://h:6379/0", cert_file=str(pem))
    with pytest.raises(ValueError, match="no such file"):
        RedisEndpoint("rediss://h:6379/0", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="redis://, rediss:// or unix://"):
        RedisEndpoint("http://h:6379/0")
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        RedisEndpoint("redis://h:6379/0", password_file=str(empty)).client_options()


def test_wrong_password_shows_in_cache_stats(
    tiny_model_dir, tmp_path: Path, redis_server: StartServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVRELAY_CLUSTER_SECRET", ClusterCredential.generate().hex())
    server = redis_server(password=PASSWORD)
    flags = ("--num-blocks", "512", "--threads", "1", "--host-pool", "off")
    flags += ("--redis-url", server.url, "--redis-password-file", _password_file(tmp_path, "no"))
    with running_cluster(tiny_model_dir, tmp_path, num_prefill=1, worker_args=flags) as launcher:
        report = launcher.get_json("/admin/cache/stats")
        workers = [i for i in report["instances"].values() if "redis" in i["tiers"]]
        assert len(workers) == 2
        assert all(w["tiers"]["redis"]["available"] is False for w in workers)
        assert report["tiers"]["redis"]["available"] is False
        assert report["tiers"]["redis"]["errors_by_reason"]["unavailable"] >= 2
        logs = "".join(p.read_text() for p in tmp_path.glob("*.log"))
        assert "WARNING" in logs and "unavailable" in logs and "AuthenticationError" in logs
