"""The tiers below the device pool, in order: read through them, write to them.

Reads go L1 (host pool) then L2 (Redis) for what L1 lacked, and promote L2 hits into L1,
so the next reader on this host finds them one tier up. Writes go through to L1 (a memcpy,
synchronous) and behind to L2 (queued; the tier's thread sends them). A tier that fails
reads as a miss; the request never sees the failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvrelay.cachetier.base import KvTier, TierChanges
from kvrelay.cachetier.block_hash import BlockHash


class TierHit(NamedTuple):
    """Payloads for a prefix of the asked keys, and how many blocks each tier gave."""

    payloads: list[np.ndarray]
    blocks_by_tier: dict[str, int]


class TieredCache:
    def __init__(self, tiers: Sequence[KvTier]) -> None:
        self.tiers = list(tiers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def fetch(self, keys: Sequence[BlockHash]) -> TierHit:
        """Longest prefix of ``keys`` found going down the tiers; promotes lower hits up."""
        payloads: list[np.ndarray] = []
        by_tier: dict[str, int] = {}
        for i, tier in enumerate(self.tiers):
            if len(payloads) == len(keys):
                break
            rest = keys[len(payloads) :]
            got = tier.get(rest)
            if got:
                by_tier[tier.name] = len(got)
                for upper in self.tiers[:i]:
                    upper.put(list(zip(rest, got)))
                payloads.extend(got)
        return TierHit(payloads, by_tier)

    def store(self, items: Sequence[tuple[BlockHash, np.ndarray]]) -> None:
        """Offers blocks to every tier (L1 synchronously, L2 write-behind)."""
        if items:
            for tier in self.tiers:
                tier.put(items)

    def take_changes(self) -> dict[str, TierChanges]:
        """Per reporting tier, what this process stored and evicted since the last call
        (tiers that report nothing, or had no change, are left out)."""
        out = {}
        for tier in self.tiers:
            changes = tier.take_changes()
            if changes is not None and (changes.stored or changes.evicted):
                out[tier.name] = changes
        return out

    def stats(self) -> dict[str, Any]:
        return {tier.name: tier.stats() for tier in self.tiers}

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
