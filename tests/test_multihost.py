"""kvrelay across hosts, for real: each role in its own network namespace on a private bridge.

Each "host" has its own address and ``--host-id``, so the KV hand-off between hosts goes over
TCP, and Redis (L2) is the only tier two hosts share. Every case compares the text with the
same prompt run on one machine, and leaves no namespace, link, process or segment behind.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.cli.launcher import free_port
from kvrelay.protocol.credential import ClusterCredential
from kvrelay.transport.shm_pool import cleanup_segments, list_segments
from tests.cluster_harness import metric_value
from tests.netns_harness import Host, Hosts, leftovers, require_netns, wait_for

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
SYSTEM = "You are a helpful assistant who answers every question in full sentences. " * 6


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    """Greedy text of the prompts on one machine, with the offline engine."""
    require_netns()
    llm = LLM(tiny_model_dir, num_blocks=512, enable_prefix_caching=False)
    texts = [SYSTEM + "Question one?", SYSTEM + "Question two, a longer one?"]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {t: o.outputs[0].text for t, o in zip(texts, llm.generate(texts, greedy))}


@pytest.fixture
def netns_hosts():
    """A factory of ``Hosts``; checks that everything made is gone afterwards."""
    made: list[Hosts] = []

    def make(n: int) -> Hosts:
        hosts = Hosts(n).__enter__()
        made.append(hosts)
        return hosts

    before = set(leftovers())
    yield make
    for hosts in made:
        hosts.close()
    assert set(leftovers()) - before == set(), "namespaces or links left behind"


class Cluster:
    """Processes of one cluster spread over ``hosts``; ``cluster_id`` names its segments."""

    def __init__(self, hosts: Hosts, model: Path, logs: Path) -> None:
        self.hosts, self.model, self.logs = hosts, model, logs
        self.cluster_id = f"mh{os.getpid()}{time.monotonic_ns() % 10**8}"
        self.routers: dict[str, tuple[Host, int, int]] = {}  # name -> host, HTTP, control
        self.procs: dict[str, object] = {}
        # every process of the cluster holds its secret (in the environment, never argv)
        secret = ClusterCredential.generate().hex()
        self.env = {**os.environ, "KVRELAY_CLUSTER_SECRET": secret}

    def kvrelay(self, host: Host, args: list[str], log: Path):
        return host.kvrelay(args, log, self.env)

    def control_addrs(self) -> str:
        return ",".join(f"tcp://{h.addr}:{c}" for h, _, c in self.routers.values())

    def url(self, name: str = "router-0") -> str:
        host, port, _ = self.routers[name]
        return f"http://{host.addr}:{port}"

    def start_redis(self, host: Host) -> str:
        """A Redis on ``host`` reachable from the others: with a password, as Redis requires
        of a server bound to a non-loopback address (protected mode)."""
        port, password = free_port(), secrets.token_hex(16)
        self.procs["redis"] = host.spawn(
            ["redis-server", "--bind", host.addr, "--port", str(port), "--save", "",
             "--appendonly", "no", "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru",
             "--requirepass", password],
            self.logs / "redis.log",
        )  # fmt: skip
        return f"redis://:{password}@{host.addr}:{port}/0"

    def start_router(self, host: Host, name: str = "router-0") -> None:
        port, control = free_port(), free_port()
        self.routers[name] = (host, port, control)
        self.procs[name] = self.kvrelay(
            host,
            ["serve", "--role", "router", "--model", str(self.model), "--host", host.addr,
             "--port", str(port), "--control-addr", f"tcp://{host.addr}:{control}",
             "--dead-after", "1.5", "--served-model-name", "tiny"],
            self.logs / f"{name}.log",
        )  # fmt: skip

    def start_worker(self, host: Host, role: str, name: str, *extra: str) -> None:
        self.procs[name] = self.kvrelay(
            host,
            ["serve", "--role", role, "--model", str(self.model), "--host", host.addr,
             "--advertise-host", host.addr, "--host-id", f"host{host.index}",
             "--cluster-id", self.cluster_id, "--instance-id", name,
             "--control-addr", self.control_addrs(), "--num-blocks", "512", "--threads", "1",
             "--host-pool", f"kvrelay-{self.cluster_id}-h{host.index}", *extra],
            self.logs / f"{name}.log",
        )  # fmt: skip

    def instances(self, router: str = "router-0") -> dict[str, dict]:
        try:
            with urllib.request.urlopen(self.url(router) + "/admin/instances", timeout=2) as r:
                return {d["instance_id"]: d for d in json.loads(r.read())["data"]}
        except OSError:
            return {}

    def wait_joined(self, names: set[str], router: str = "router-0") -> None:
        wait_for(lambda: names <= set(self.instances(router)), 120, f"{names} joined {router}")

    def client(self, router: str = "router-0") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url(router) + "/v1", api_key="unused", max_retries=0)

    def complete(self, prompt: str, router: str = "router-0"):
        return self.client(router).completions.create(
            model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True}, timeout=120,
        )  # fmt: skip

    def worker_stats(self, name: str, router: str = "router-0") -> dict:
        url = self.instances(router)[name]["status_url"]
        with urllib.request.urlopen(url + "/stats", timeout=5) as resp:
            return json.loads(resp.read())

    def worker_metrics(self, name: str, router: str = "router-0") -> str:
        url = self.instances(router)[name]["status_url"]
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            return resp.read().decode()

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        self.hosts.stop_process(self.procs.pop(name), sig)

    def cleanup(self) -> list[str]:
        """Stops the processes (the Hosts do too) and removes the cluster's segments."""
        for name in list(self.procs):
            self.kill(name, signal.SIGTERM)
        return cleanup_segments(f"kvrelay-{self.cluster_id}-")


@pytest.fixture
def cluster_on(netns_hosts, tiny_model_dir, tmp_path):
    made: list[Cluster] = []

    def make(n: int) -> Cluster:
        made.append(Cluster(netns_hosts(n), tiny_model_dir, tmp_path))
        return made[-1]

    yield make
    for cluster in made:
        cluster.cleanup()
        assert list_segments(f"kvrelay-{cluster.cluster_id}-") == []


def test_three_hosts_hand_off_over_tcp_and_a_fourth_hits_redis(cluster_on, expected):
    """Router + Redis on host 0, prefill on 1, decode on 2: the text equals one machine's.
    Then a prefill on host 3, cold in every tier of its own, reads the prompt from Redis."""
    cluster = cluster_on(4)
    h0, h1, h2, h3 = cluster.hosts.hosts
    redis_url = cluster.start_redis(h0)
    cluster.start_router(h0)
    cluster.start_worker(h1, "prefill", "prefill-h1", "--redis-url", redis_url)
    cluster.start_worker(h2, "decode", "decode-h2", "--redis-url", redis_url)
    cluster.wait_joined({"prefill-h1", "decode-h2"})
    text, reply = next(iter(expected.items()))
    first = cluster.complete(text)
    assert first.choices[0].text == reply
    assert cluster.worker_stats("decode-h2")["num_recomputed"] == 0  # it pulled the KV
    metrics = cluster.worker_metrics("decode-h2")
    moved = metric_value(metrics, "kvrelay_kv_transfer_bytes_total", transport="tcp")
    assert moved > 0  # over TCP: the hosts share no memory

    cluster.start_worker(h3, "prefill", "prefill-h3", "--redis-url", redis_url)
    cluster.wait_joined({"prefill-h3"})
    drain = urllib.request.Request(
        cluster.url() + "/admin/instances/prefill-h1/drain", method="POST"
    )
    urllib.request.urlopen(drain, timeout=5).close()
    wait_for(lambda: cluster.instances()["prefill-h1"]["draining"], 10, "drain")

    def redis_hit() -> bool:
        second = cluster.complete(text)
        assert second.choices[0].text == reply
        tiers = second.usage.model_extra.get("kvrelay_cached_tokens_by_tier") or {}
        return tiers.get("redis", 0) > 0

    wait_for(redis_hit, 60, "a Redis hit on host 3")  # L2 writes are behind: retry
    assert cluster.worker_stats("prefill-h3")["tiers"]["redis"]["hit_tokens"] > 0


def test_decode_killed_mid_stream_on_another_host(cluster_on, expected):
    """Two decodes on two hosts; the one streaming dies: the client's text is unchanged."""
    cluster = cluster_on(4)
    h0, h1, h2, h3 = cluster.hosts.hosts
    cluster.start_router(h0)
    cluster.start_worker(h1, "prefill", "prefill-h1")
    cluster.start_worker(h2, "decode", "decode-h2")
    cluster.start_worker(h3, "decode", "decode-h3")
    cluster.wait_joined({"prefill-h1", "decode-h2", "decode-h3"})
    text, reply = list(expected.items())[1]
    stream = cluster.client().completions.create(
        model="tiny", prompt=text, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, timeout=120,
    )  # fmt: skip
    pieces, killed = [], None
    for chunk in stream:
        pieces.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len(pieces) == 3:
            running = {
                name: cluster.worker_stats(name)["num_running"]
                for name in ("decode-h2", "decode-h3")
            }
            killed = max(running, key=running.get)
            cluster.kill(killed)
    assert killed is not None
    assert "".join(pieces) == reply


def test_two_routers_on_two_hosts_one_killed(cluster_on, expected):
    """Workers report to both routers; with one router dead the other keeps serving."""
    cluster = cluster_on(4)
    h0, h1, h2, h3 = cluster.hosts.hosts
    cluster.start_router(h0, "router-0")
    cluster.start_router(h3, "router-1")
    cluster.start_worker(h1, "prefill", "prefill-h1")
    cluster.start_worker(h2, "decode", "decode-h2")
    for router in ("router-0", "router-1"):
        cluster.wait_joined({"prefill-h1", "decode-h2"}, router)
    text, reply = next(iter(expected.items()))
    assert cluster.complete(text, "router-0").choices[0].text == reply
    cluster.kill("router-0")
    assert cluster.complete(text, "router-1").choices[0].text == reply
    assert cluster.worker_stats("decode-h2", "router-1")["num_running"] == 0


def _log_line(path: Path, needle: str, timeout: float) -> str:
    """The first line of ``path`` containing ``needle`` (waits for it)."""
    found: list[str] = []

    def seen() -> bool:
        found[:] = (
            [ln for ln in path.read_text().splitlines() if needle in ln] if path.exists() else []
        )
        return bool(found)

    wait_for(seen, timeout, f"{needle!r} in {path.name}")
    return found[0]


def test_parameter_pool_chain_across_shaped_hosts(cluster_on, expected, tmp_path):
    """Host 1 serves its weights; host 2 fetches them and forwards while it fills; host 3
    fetches from host 2 (host 1 as the fallback). Links are shaped to 200 Mbit/s with tbf.
    A colocated worker on host 3 then serves from the pool it got, with the same text."""
    cluster = cluster_on(4)
    h0, h1, h2, h3 = cluster.hosts.hosts
    for host in (h1, h2, h3):
        host.shape("200mbit")
    model = str(cluster.model)
    src, mid = f"tcp://{h1.addr}:{free_port()}", f"tcp://{h2.addr}:{free_port()}"
    cluster.procs["serve"] = cluster.kvrelay(
        h1, ["pool", "serve", "--model", model, "--bind", src], tmp_path / "serve.log"
    )
    _log_line(tmp_path / "serve.log", "serving at", 60)
    cluster.procs["fetch-h2"] = cluster.kvrelay(
        h2,
        ["pool", "fetch", "--model", model, "--from", src, "--forward-bind", mid],
        tmp_path / "fetch-h2.log",
    )
    fetch3 = cluster.kvrelay(
        h3, ["pool", "fetch", "--model", model, "--from", f"{mid},{src}"], tmp_path / "fetch-h3.log"
    )
    assert fetch3.wait(timeout=120) == 0
    lines = (tmp_path / "fetch-h3.log").read_text().splitlines()
    (pool_name,) = [ln.split(":")[0] for ln in lines if ln.startswith("kvrelay-params-")]
    assert any(f"from {mid}" in ln for ln in lines), "host 3 did not fetch through host 2"
    listing = h3.spawn(["kvrelay", "pool", "ls"], tmp_path / "ls-h3.log")
    assert listing.wait(timeout=60) == 0
    rows = [ln.split() for ln in (tmp_path / "ls-h3.log").read_text().splitlines()]
    assert [r[4] for r in rows if r and r[0] == pool_name] == ["ready"]

    cluster.start_router(h0)
    cluster.start_worker(h3, "colocated", "colocated-h3")
    cluster.wait_joined({"colocated-h3"})
    text, reply = next(iter(expected.items()))
    assert cluster.complete(text).choices[0].text == reply
    log = (tmp_path / "colocated-h3.log").read_text()
    assert "built parameter pool" not in log, "the worker read the checkpoint, not the pool"
