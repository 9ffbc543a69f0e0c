"""The router's per-tier prefix index and cache-aware placement, with exact expectations.

Keys are plain 16-byte values; instances live on hosts "A" and "B" as ``Register`` says.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from kvrelay.cachetier.block_hash import BlockHash, hash_blocks
from kvrelay.protocol import messages
from kvrelay.protocol.messages import (
    KV_HANDOFF_VERSION,
    WIRE_TYPES,
    CacheEvent,
    KvLayout,
    LoadReport,
    PeerInfo,
    Register,
    Role,
    decode,
    encode,
)
from kvrelay.router.cache_stats import build_report
from kvrelay.router.metrics import RouterMetrics
from kvrelay.router.prefix_index import (
    TIER_WEIGHTS,
    CacheIndex,
    PrefixMatch,
    reusable_block_keys,
)
from kvrelay.router.registry import Registry
from tests.cluster_harness import metric_value

LAYOUT = KvLayout(2, 64, 16, 2, 8, "float32")
K = [BlockHash(bytes([i]) * 16) for i in range(8)]


def raw(*indices: int) -> list[bytes]:
    return [bytes(K[i]) for i in indices]


def device(instance_id: str, stored=(), evicted=(), reset: bool = False) -> CacheEvent:
    return CacheEvent(instance_id, raw(*stored), raw(*evicted), reset=reset)


def host(instance_id: str, host_id: str, stored=(), evicted=()) -> CacheEvent:
    return CacheEvent(instance_id, raw(*stored), raw(*evicted), tier="host", host_id=host_id)


@pytest.fixture
def index() -> CacheIndex:
    index = CacheIndex()
    for instance_id, host_id in (("a0", "A"), ("a1", "A"), ("b0", "B")):
        index.add_instance(instance_id, host_id)
    return index


def test_device_and_host_events_build_each_tier(index: CacheIndex) -> None:
    assert index.apply(device("a0", stored=[0, 1, 2, 3]))
    assert index.apply(host("a0", "A", stored=[0, 1, 2, 3, 4, 5]))
    assert index.apply(host("a1", "A", evicted=[5]))  # another writer of host A's pool
    assert index.apply(device("b0", stored=[0]))
    assert index.sizes() == {"device": {"a0": 4, "b0": 1}, "host": {"A": 5}}
    # per candidate: its device prefix, then its host's L1 run right after it
    assert index.match(K[:6]) == {
        "a0": PrefixMatch(4, 1),  # device 0-3, L1 4 (5 was evicted)
        "a1": PrefixMatch(0, 5),  # nothing on its device: L1 0-4
        "b0": PrefixMatch(1, 0),  # host B's L1 is empty
    }
    assert index.match([K[0], K[6], K[1]]) == {  # a run ends at its first gap
        "a0": PrefixMatch(1, 0),
        "a1": PrefixMatch(0, 1),
        "b0": PrefixMatch(1, 0),
    }
    assert index.apply(device("a0", stored=[7], reset=True))  # a full set replaces the old
    assert index.match(K[:6])["a0"] == PrefixMatch(0, 5)
    assert index.apply(device("a0", evicted=[7, 6]))  # an unknown key is no error
    assert index.sizes()["device"] == {"a0": 0, "b0": 1}


def test_events_of_unknown_instances_tiers_or_hosts_are_ignored(index: CacheIndex) -> None:
    assert not index.apply(device("stranger", stored=[0]))
    assert not index.apply(host("b0", "A", stored=[0]))  # b0 registered on host B
    assert not index.apply(dataclasses.replace(device("a0", stored=[0]), tier="redis"))  # type: ignore[arg-type]
    assert index.apply(host("b0", "", stored=[1]))  # no host named: the registered one
    assert index.sizes() == {"device": {}, "host": {"B": 1}}


def test_a_host_index_goes_with_the_last_instance_of_the_host(index: CacheIndex) -> None:
    index.apply(host("a0", "A", stored=[0, 1]))
    index.apply(device("a0", stored=[0]))
    index.remove_instance("a0")  # a1 still reports host A's pool
    assert index.sizes() == {"device": {}, "host": {"A": 2}}
    assert index.match(K[:2]) == {"a1": PrefixMatch(0, 2)}
    index.add_instance("a1", "A")  # re-registration keeps the pool's index
    assert index.sizes()["host"] == {"A": 2}
    index.remove_instance("a1")  # the last one: nobody reports the pool's evictions now
    assert index.sizes() == {"device": {}, "host": {}}
    assert index.match(K[:2]) == {}
    index.add_instance("a2", "A")  # a fresh instance on A: the L1 index fills from events
    assert index.match(K[:2]) == {}


def _registry(*instances: tuple[str, str, int]) -> Registry:
    """Prefill instances (id, host, queued prefill tokens) and one decode."""
    registry = Registry()
    for instance_id, host_id, num_tokens in instances:
        info = PeerInfo(instance_id, Role.PREFILL, host_id, "tcp://x:1", "", None, LAYOUT, b"f")
        registry.register(Register(info, "tiny", 1024, 1))
        num_waiting = -(-num_tokens // LAYOUT.block_size)  # one request a block
        report = LoadReport(instance_id, num_waiting, 0, 64, 64, num_prefill_tokens=num_tokens)
        registry.report(report)
    decode_info = PeerInfo("d0", Role.DECODE, "A", "tcp://x:2", "", None, LAYOUT, b"f")
    registry.register(Register(decode_info, "tiny", 1024, 1))
    return registry


def _chosen(registry: Registry, matched: dict[str, PrefixMatch]) -> str:
    placement = registry.place(matched=matched)
    assert placement is not None
    return placement.prefill.instance_id


def test_placement_weights_device_above_host_and_load_above_both() -> None:
    assert TIER_WEIGHTS == {"device": 1.0, "host": 0.5}
    assert PrefixMatch(2, 3).credit == 3.5
    idle = _registry(("p0", "A", 0), ("p1", "B", 0), ("p2", "B", 0))
    assert _chosen(idle, {}) == "p0"  # a tie: the first registered
    assert _chosen(idle, {"p1": PrefixMatch(0, 1)}) == "p1"  # any L1 hit beats none
    same_len = {"p1": PrefixMatch(0, 4), "p2": PrefixMatch(4, 0)}
    assert _chosen(idle, same_len) == "p2"  # a device hit beats an L1 hit as long
    longer = {"p1": PrefixMatch(0, 3), "p2": PrefixMatch(1, 0)}
    assert _chosen(idle, longer) == "p1"  # 3 L1 blocks (1.5) beat 1 device block (1.0)
    both = {"p1": PrefixMatch(2, 2), "p2": PrefixMatch(2, 1)}
    assert _chosen(idle, both) == "p1"  # L1 after the same device prefix
    # the L1-favoured instance has 48 prompt tokens queued (3 blocks of 16): its 4 L1 blocks
    # (2.0 device blocks, 32 tokens) do not win
    busy = _registry(("p0", "A", 48), ("p1", "B", 0))
    assert _chosen(busy, {"p0": PrefixMatch(0, 4)}) == "p1"
    assert _chosen(busy, {"p0": PrefixMatch(0, 5)}) == "p1"  # 40 tokens < 48
    assert _chosen(busy, {"p0": PrefixMatch(0, 7)}) == "p0"  # 56 tokens outweigh 48 queued


def test_placement_pairs_only_equal_hand_off_versions() -> None:
    """In a rolling upgrade a prefill is paired only with a decode of its KV hand-off version;
    with none, the request runs end to end on one instance instead of failing a pull."""
    registry = Registry()

    def add(instance_id: str, role: Role, version: int, num_waiting: int) -> None:
        info = PeerInfo(instance_id, role, "A", "tcp://x:1", "", None, LAYOUT, b"f")
        info = dataclasses.replace(info, kv_version=version)
        registry.register(Register(info, "tiny", 1024, 1))
        registry.report(LoadReport(instance_id, num_waiting, 0, 64, 64))

    add("new-p", Role.PREFILL, KV_HANDOFF_VERSION, 2)
    add("old-p", Role.PREFILL, 1, 0)  # the cheaper prefill
    add("new-d", Role.DECODE, KV_HANDOFF_VERSION, 0)
    placement = registry.place()
    assert placement is not None and placement.decode is not None
    assert (placement.prefill.instance_id, placement.decode.instance_id) == ("new-p", "new-d")
    add("old-d", Role.DECODE, 1, 0)
    placement = registry.place()
    assert placement is not None and placement.decode is not None
    assert (placement.prefill.instance_id, placement.decode.instance_id) == ("old-p", "old-d")
    placement = registry.place(exclude=["new-d", "old-d"])  # no decode left: end to end
    assert placement is not None and placement.decode is None
    assert registry.instances()[0].as_dict()["kv_version"] == KV_HANDOFF_VERSION


def test_cache_events_from_an_older_worker_are_device_events() -> None:
    event = host("a0", "A", stored=[0], evicted=[1])
    assert decode(encode(event)) == event
    values = [getattr(event, f.name) for f in dataclasses.fields(CacheEvent)]
    tag = WIRE_TYPES.index(CacheEvent)
    ext = msgpack.ExtType(1, msgpack.packb([tag, *values[:4]], default=messages._default))
    assert decode(msgpack.packb(ext)) == device("a0", stored=[0], evicted=[1])


def test_index_sizes_and_placement_counters_are_exported(index: CacheIndex) -> None:
    index.apply(device("a0", stored=[0, 1]))
    index.apply(host("a1", "A", stored=[0, 1, 2]))
    report = build_report({}, [], {}, index.sizes())
    assert report["placement_index"] == {
        "device": {"num_blocks": 2, "instances": {"a0": 2}},
        "host": {"num_blocks": 3, "hosts": {"A": 3}},
    }
    metrics = RouterMetrics()
    metrics.observe_placement(2, 1)
    metrics.observe_placement(0, 3)
    metrics.observe_placement(0, 0)
    text = metrics_text(metrics)
    hits = "kvrelay_placement_prefix_hits_total"
    blocks = "kvrelay_placement_prefix_blocks_total"
    assert metric_value(text, hits, tier="device") == 1
    assert metric_value(text, hits, tier="host") == 2
    assert metric_value(text, blocks, tier="device") == 2
    assert metric_value(text, blocks, tier="host") == 4


def metrics_text(metrics: RouterMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()


@pytest.mark.parametrize(("num_tokens", "num_keys"), [(1, 0), (16, 0), (17, 1), (32, 1), (33, 2)])
def test_the_block_holding_the_last_prompt_token_is_never_scored(
    num_tokens: int, num_keys: int
) -> None:
    """The engine recomputes the last token, so at most (n - 1) // block_size blocks hit."""
    tokens = list(range(100, 100 + num_tokens))
    keys = reusable_block_keys(tokens, 16, b"f" * 16)
    assert keys == hash_blocks(tokens, 16, b"f" * 16)[:num_keys]


def test_cache_salt_gives_its_own_keys_in_the_placement_index(index: CacheIndex) -> None:
    """The same prompt under another salt (or none) matches nothing another salt cached."""
    from kvrelay.engine.block_manager import BlockManager
    from kvrelay.engine.sequence import Sequence
    from kvrelay.protocol.sampling_params import SamplingParams

    tokens, fp = list(range(100, 165)), b"f" * 16
    salted = reusable_block_keys(tokens, 16, fp, "tenant-a")
    assert len(salted) == 4
    assert reusable_block_keys(tokens, 16, fp, "tenant-a") == salted
    others = [reusable_block_keys(tokens, 16, fp, s) for s in ("tenant-b", None)]
    assert all(not set(salted) & set(keys) for keys in others)
    # The engine's keys are the router's: placement credits exactly what the engine reuses.
    bm = BlockManager(num_blocks=8, block_size=16, fingerprint=fp)
    seq = Sequence("s", tokens, SamplingParams(cache_salt="tenant-a"))
    bm.update_hashes(seq)
    assert seq.block_hashes[:4] == salted

    index.apply(CacheEvent("a0", [bytes(k) for k in salted], []))
    assert index.match(salted) == {"a0": PrefixMatch(4, 0)}
    assert index.match(others[0]) == index.match(others[1]) == {}
