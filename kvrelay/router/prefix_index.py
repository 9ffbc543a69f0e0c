"""Which prefix blocks sit where, per cache tier (for cache-aware placement).

Fed by ``CacheEvent``s. Two tiers are tracked, each a ``PrefixIndex`` of holders:

    tier     holder         events                                      on a fresh router
    device   instance id    full set on registration, deltas after      complete at once
    host     host id        deltas from every writer on that host       empty; fills from
             (its L1 pool)  (stored / evicted by that writer's puts)     the events after start

The router hashes each request's prompt the same way the workers do (chained block hash over
the model fingerprint). A candidate's match is its leading device blocks, then the blocks
right after them in its host's L1 pool: what its engine would copy in at admission
(``engine/offload.py``) instead of computing. Redis (L2) is global, the same for every
candidate, so it is not tracked.

Both tiers are hints. The L1 pool is a best-effort, set-associative LRU shared by every
instance of a host; each writer reports its own stores and evictions a heartbeat late, and
a router that started after a block was written never hears of it. A stale entry costs a
miss (the engine computes what it did not find), never a wrong block. A host's L1 index is
dropped with the last instance of that host the router knows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from kvrelay.cachetier.block_hash import BlockHash, chain_seed, hash_blocks
from kvrelay.protocol.messages import CacheEvent

logger = logging.getLogger(__name__)

# Placement credit of one matched block, per tier, in device blocks (a device block saves
# computing ``block_size`` prompt tokens, each worth ``cache_weight`` queued prefill tokens:
# ``Registry.place``). A device hit costs nothing. An L1 hit costs a copy out of shared
# memory and a checksum: small next to computing the block (reading a 1,501-token prefix
# from Redis, network included, took a tenth of computing it; see BENCHMARKS.md), so it
# saves nearly as much. But the L1 index is the staler one (another writer's evictions
# arrive a heartbeat late; a router never hears of blocks written before it started), so
# its blocks count half: a device hit beats an L1 hit of the same length, and an L1 run
# more than twice as long as a device run beats it.
TIER_WEIGHTS = {"device": 1.0, "host": 0.5}

_NO_HOLDERS: frozenset[str] = frozenset()


class PrefixMatch(NamedTuple):
    """Blocks of one prompt a candidate instance would not compute."""

    device_blocks: int  # leading blocks in its own device cache
    host_blocks: int  # the blocks right after those, in its host's L1 pool

    @property
    def credit(self) -> float:
        """Placement credit, in device blocks (``TIER_WEIGHTS``)."""
        return TIER_WEIGHTS["device"] * self.device_blocks + TIER_WEIGHTS["host"] * self.host_blocks


class PrefixIndex:
    """Block hash -> holders and back, for one tier (holders: instance or host ids)."""

    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

    def apply(self, holder: str, event: CacheEvent) -> None:
        if event.reset:
            self.remove(holder)
        held = self._blocks.setdefault(holder, set())
        for key in event.evicted:
            if key in held:
                held.discard(key)
                self._drop_holder(key, holder)
        for key in event.stored:
            held.add(key)
            self._holders.setdefault(key, set()).add(holder)

    def remove(self, holder: str) -> None:
        for key in self._blocks.pop(holder, set()):
            self._drop_holder(key, holder)

    def _drop_holder(self, key: bytes, holder: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(holder)
            if not holders:
                del self._holders[key]

    def matched_blocks(self, keys: Sequence[BlockHash]) -> dict[str, int]:
        """Per holder, how many leading ``keys`` it holds (holders of none omitted). Costs
        set intersections over the first key's holders, never a visit of every holder."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None  # the holders of every key so far
        num_keys = 0
        for key in keys:
            holders = self._holders.get(bytes(key), _NO_HOLDERS)
            kept = set(holders) if alive is None else alive & holders
            if alive is not None and len(kept) < len(alive):
                matched.update(dict.fromkeys(alive - kept, num_keys))
            alive = kept
            if not alive:
                break
            num_keys += 1
        matched.update(dict.fromkeys(alive or (), num_keys))
        return matched

    def num_held_from(self, holder: str, keys: Sequence[BlockHash], start: int) -> int:
        """How many of ``keys[start:]``, in a row from the first, ``holder`` holds."""
        held = self._blocks.get(holder)
        if not held:
            return 0
        count = 0
        for key in keys[start:]:
            if bytes(key) not in held:
                break
            count += 1
        return count

    def num_blocks(self, holder: str) -> int:
        return len(self._blocks.get(holder, ()))

    def sizes(self) -> dict[str, int]:
        """Blocks known per holder."""
        return {holder: len(blocks) for holder, blocks in self._blocks.items()}


def reusable_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    fingerprint: bytes,
    cache_salt: str | None = None,
    adapter: bytes | None = None,
) -> list[BlockHash]:
    """Hashes of the prompt blocks an engine could reuse: at most ``(n - 1) // block_size``
    (``adapter``: the identity of the request's LoRA adapter, as in its blocks' keys).

    The last token is always computed (its logits are sampled), so a block that ends with it
    is never a hit, as in ``BlockManager``: scoring it would favour an instance for nothing.
    """
    seed = chain_seed(fingerprint, cache_salt, adapter)
    return hash_blocks(token_ids[: len(token_ids) - 1], block_size, seed)


class CacheIndex:
    """The router's view of the device and host (L1) tiers; owns both ``PrefixIndex``es
    and which instance lives on which host (from ``Register``)."""

    def __init__(self) -> None:
        self.device = PrefixIndex()  # holders: instance ids
        self.host = PrefixIndex()  # holders: host ids
        self._host_of: dict[str, str] = {}  # instance id -> host id
        self._on_host: dict[str, set[str]] = {}  # host id -> instance ids (the reverse)

    def add_instance(self, instance_id: str, host_id: str) -> None:
        """A (re)registered instance: its device index is rebuilt from its full-set event;
        its host's L1 index is kept (the pool outlives instances)."""
        self.device.remove(instance_id)
        old = self._host_of.get(instance_id)
        self._host_of[instance_id] = host_id
        self._on_host.setdefault(host_id, set()).add(instance_id)
        if old is not None and old != host_id:
            self._leave_host(instance_id, old)

    def remove_instance(self, instance_id: str) -> None:
        """Forgets the instance's device blocks, and its host's L1 blocks when it was the
        last instance of that host (no writer is left to report the pool's evictions)."""
        self.device.remove(instance_id)
        host_id = self._host_of.pop(instance_id, None)
        if host_id is not None:
            self._leave_host(instance_id, host_id)

    def _leave_host(self, instance_id: str, host_id: str) -> None:
        """The instance is no longer on that host; the last one out drops its L1 index."""
        on_host = self._on_host.get(host_id, set())
        on_host.discard(instance_id)
        if not on_host:
            self._on_host.pop(host_id, None)
            self.host.remove(host_id)

    def apply(self, event: CacheEvent) -> bool:
        """Applies an event of a known instance; False (ignored) for an unknown instance,
        an unknown tier, or a host event naming another host than the instance's."""
        host_id = self._host_of.get(event.instance_id)
        if host_id is None:
            return False
        if event.tier == "device":
            self.device.apply(event.instance_id, event)
            return True
        if event.tier == "host" and event.host_id in ("", host_id):
            self.host.apply(host_id, event)
            return True
        logger.warning(
            "ignoring a %r cache event of %s for host %r (registered on %r)",
            event.tier,
            event.instance_id,
            event.host_id,
            host_id,
        )
        return False

    def match(self, keys: Sequence[BlockHash]) -> dict[str, PrefixMatch]:
        """Per known instance, the blocks of ``keys`` it would not compute (none omitted).
        Visits the holders of the first key only: the instances with a device hit, then
        those without one on a host whose L1 pool has the first blocks."""
        out = {}
        num_host_from: dict[tuple[str, int], int] = {}  # (host, first block) -> L1 run
        for instance_id, num_device in self.device.matched_blocks(keys).items():
            host_id = self._host_of.get(instance_id)
            if host_id is None:
                continue
            at = (host_id, num_device)
            if at not in num_host_from:
                num_host_from[at] = self.host.num_held_from(host_id, keys, num_device)
            out[instance_id] = PrefixMatch(num_device, num_host_from[at])
        for host_id, num_host in self.host.matched_blocks(keys).items():
            for instance_id in self._on_host.get(host_id, ()):
                if instance_id not in out:
                    out[instance_id] = PrefixMatch(0, num_host)
        return out

    def sizes(self) -> dict[str, dict[str, int]]:
        """Blocks known per tier and holder (``/admin/cache/stats``)."""
        return {"device": self.device.sizes(), "host": self.host.sizes()}
