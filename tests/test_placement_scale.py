"""Sublinear placement decides exactly as ranking every instance does (issue #16).

``Registry.place`` looks at the matched instances and the first ones of its load orders, and
``CacheIndex.match`` at the holders of the prompt's first block. Each is checked against a
straightforward reference (the scan of every instance they replaced) over randomized
registries, reports, assignments, drains, removals and prompts, with values drawn from small
sets so that ties (and their tie-breaks) are common.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

import pytest

from kvrelay.protocol.messages import CacheEvent, KvLayout, LoadReport, PeerInfo, Register, Role
from kvrelay.router.instance import Instance, Placement, can_pair
from kvrelay.router.prefix_index import CacheIndex, PrefixMatch
from kvrelay.router.registry import Registry

ROLES = (Role.PREFILL, Role.PREFILL, Role.DECODE, Role.DECODE, Role.COLOCATED)
MATCHES = (PrefixMatch(1, 0), PrefixMatch(4, 0), PrefixMatch(0, 8), PrefixMatch(2, 4))


def reference_place(
    registry: Registry,
    exclude: set[str],
    matched: Mapping[str, PrefixMatch],
    num_prompt_tokens: int,
) -> Placement | None:
    """Every live instance scored, sorted and scanned (``Registry.place`` before #16)."""

    def cost(inst: Instance) -> tuple[float, float]:
        match = matched.get(inst.instance_id)
        saved = 0.0 if match is None else match.credit * inst.info.layout.block_size
        work = inst.queued_tokens() + num_prompt_tokens - registry.cache_weight * saved
        return work, inst.load_score()

    def live(role: Role) -> list[Instance]:
        return [
            i
            for i in registry.instances(role)
            if not (i.load.draining or i.draining) and i.instance_id not in exclude
        ]

    def placed(prefill: Instance, decode: Instance | None) -> Placement:
        match = matched.get(prefill.instance_id)
        hit = 0 if match is None else match.device_blocks * prefill.info.layout.block_size
        return Placement(prefill, decode, max(0, num_prompt_tokens - hit))

    prefills, decodes = live(Role.PREFILL), live(Role.DECODE)
    for prefill in sorted(prefills, key=cost):
        peers = [d for d in decodes if can_pair(prefill.info, d.info)]
        if peers:
            key = lambda d: (-d.load.num_free_blocks, d.load.num_running + d.num_assigned)  # noqa: E731
            return placed(prefill, min(peers, key=key))
    for pool in (live(Role.COLOCATED), prefills + decodes):
        if pool:
            return placed(min(pool, key=cost), None)
    return None


def _register(registry: Registry, rng: random.Random, instance_id: str) -> None:
    layout = KvLayout(1, 64, rng.choice((16, 32)), 1, 1, "float32")
    kv_version = rng.choice((1, 1, 1, 2))
    fingerprint = rng.choice((b"f", b"f", b"f", b"g"))
    role = rng.choice(ROLES)
    info = PeerInfo(
        instance_id, role, "A", "", "", None, layout, fingerprint, kv_version=kv_version
    )
    registry.register(Register(info, "tiny", 4096, 1), connection=instance_id.encode())


def _report(registry: Registry, rng: random.Random, instance_id: str) -> None:
    report = LoadReport(
        instance_id,
        num_waiting=rng.choice((0, 0, 1, 2)),
        num_running=rng.choice((0, 1, 3)),
        num_free_blocks=rng.choice((0, 32, 64)),
        num_total_blocks=64,
        num_pending_kv=rng.choice((0, 0, 1)),
        draining=rng.random() < 0.1,
        num_prefill_tokens=rng.choice((0, 0, 16, 64, 100, 200)),
    )
    registry.report(report)


def _mutate(registry: Registry, rng: random.Random, ids: list[str]) -> None:
    """One random change: a join (new id, or a re-register that may change role), a leave,
    a report, or a drain flag flipped by the router."""
    instance_id = rng.choice(ids)
    roll = rng.random()
    if roll < 0.15:
        _register(registry, rng, instance_id)
    elif roll < 0.2:
        registry.remove(instance_id)
    elif roll < 0.9:
        if registry.get(instance_id) is not None:
            _report(registry, rng, instance_id)
    elif (inst := registry.get(instance_id)) is not None:
        inst.draining = not inst.draining


def _request(rng: random.Random, ids: list[str]) -> tuple[set[str], dict[str, PrefixMatch], int]:
    exclude = set(rng.sample(ids, min(len(ids), rng.choice((0, 0, 0, 1, 3)))))
    holders = rng.sample(ids, min(len(ids), rng.choice((0, 1, 2, 5, len(ids) // 2))))
    matched = {i: rng.choice(MATCHES) for i in holders}
    return exclude, matched, rng.choice((0, 60, 600))


def _ids(placement: Placement | None) -> tuple[str, str | None, int] | None:
    if placement is None:
        return None
    decode = None if placement.decode is None else placement.decode.instance_id
    return placement.prefill.instance_id, decode, placement.num_new_tokens


@pytest.mark.parametrize("seed", range(12))
def test_place_chooses_as_ranking_every_instance_does(seed: int) -> None:
    rng = random.Random(seed)
    registry = Registry(cache_weight=rng.choice((0.0, 0.5, 1.0, 2.0)))
    ids = [f"i{n}" for n in range(rng.choice((3, 8, 40)))]
    for instance_id in ids:
        _register(registry, rng, instance_id)
    num_placed = 0
    for step in range(600):
        _mutate(registry, rng, ids)
        exclude, matched, num_prompt_tokens = _request(rng, ids)
        expected = reference_place(registry, exclude, matched, num_prompt_tokens)
        placement = registry.place(exclude, matched, num_prompt_tokens)
        assert _ids(placement) == _ids(expected), step
        if placement is not None and rng.random() < 0.7:
            registry.assign(placement)  # the load orders must follow what assign counts
            num_placed += 1
        if step % 50 == 0:
            registry.check_integrity()
    registry.check_integrity()
    assert num_placed > 100


def test_a_placement_assigned_after_its_instance_left_changes_nothing() -> None:
    rng = random.Random(0)
    registry = Registry()
    for instance_id in ("a", "b"):
        _register(registry, rng, instance_id)
    placement = registry.place()
    assert placement is not None
    for inst in placement.instances:
        registry.remove(inst.instance_id)
    registry.assign(placement)
    registry.check_integrity()


def reference_match(
    device: dict[str, set[bytes]], host: dict[str, set[bytes]], host_of: dict[str, str],
    keys: list[bytes],
) -> dict[str, PrefixMatch]:  # fmt: skip
    """Per registered instance, its leading device run, then its host's L1 run after it."""

    def run(held: set[bytes], start: int) -> int:
        count = 0
        while start + count < len(keys) and keys[start + count] in held:
            count += 1
        return count

    out = {}
    for instance_id, host_id in host_of.items():
        num_device = run(device.get(instance_id, set()), 0)
        num_host = run(host.get(host_id, set()), num_device)
        if num_device or num_host:
            out[instance_id] = PrefixMatch(num_device, num_host)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_match_lists_what_scanning_every_instance_finds(seed: int) -> None:
    rng = random.Random(seed)
    blocks = [bytes([n]) * 8 for n in range(10)]
    index = CacheIndex()
    device: dict[str, set[bytes]] = {}
    host: dict[str, set[bytes]] = {}
    host_of: dict[str, str] = {}
    ids, hosts = [f"i{n}" for n in range(12)], ["h0", "h1", "h2"]
    for step in range(400):
        instance_id, roll = rng.choice(ids), rng.random()
        if roll < 0.1:  # (re)joins, maybe on another host: its device set starts afresh
            old = host_of.get(instance_id)
            host_of[instance_id] = rng.choice(hosts)
            index.add_instance(instance_id, host_of[instance_id])
            device[instance_id] = set()
            if old is not None and old not in host_of.values():
                host.pop(old, None)  # the last one out of a host takes its L1 index along
        elif roll < 0.15 and instance_id in host_of:
            index.remove_instance(instance_id)
            device.pop(instance_id, None)
            host_id = host_of.pop(instance_id)
            if host_id not in host_of.values():
                host.pop(host_id, None)
        elif instance_id in host_of:
            tier = rng.choice(("device", "host"))
            stored, evicted = rng.sample(blocks, 3), rng.sample(blocks, 2)
            event = CacheEvent(instance_id, stored, evicted, tier=tier)
            assert index.apply(event)
            held = device[instance_id] if tier == "device" else host.setdefault(
                host_of[instance_id], set()
            )  # fmt: skip
            held.difference_update(evicted)
            held.update(stored)
        keys = rng.sample(blocks, rng.choice((1, 3, 6)))
        if rng.random() < 0.5:
            keys = blocks[: len(keys)]  # a common prefix: long runs
        assert index.match(keys) == reference_match(device, host, host_of, keys), step
