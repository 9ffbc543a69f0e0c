"""Which instance holds which prefix blocks in its device cache (for cache-aware placement).

Fed by ``CacheEvent``s (a full set on registration, deltas after). The router hashes each
request's prompt the same way the workers do (chained block hash over the model
fingerprint) and asks how many leading blocks each instance holds.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvrelay.cachetier.block_hash import BlockHash
from kvrelay.cluster.messages import CacheEvent


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[bytes, set[str]] = {}
        self._blocks: dict[str, set[bytes]] = {}

    def apply(self, event: CacheEvent) -> None:
        if event.reset:
            self.remove_instance(event.instance_id)
        held = self._blocks.setdefault(event.instance_id, set())
        for key in event.evicted:
            if key in held:
                held.discard(key)
                holders = self._holders.get(key)
                if holders is not None:
                    holders.discard(event.instance_id)
                    if not holders:
                        del self._holders[key]
        for key in event.stored:
            held.add(key)
            self._holders.setdefault(key, set()).add(event.instance_id)

    def remove_instance(self, instance_id: str) -> None:
        for key in self._blocks.pop(instance_id, set()):
            holders = self._holders.get(key)
            if holders is not None:
                holders.discard(instance_id)
                if not holders:
                    del self._holders[key]

    def matched_blocks(self, keys: Sequence[BlockHash]) -> dict[str, int]:
        """Per instance, how many leading ``keys`` it holds (instances holding none omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, key in enumerate(keys):
            holders = self._holders.get(bytes(key))
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for instance_id in alive:
                matched[instance_id] = i + 1
        return matched

    def num_blocks(self, instance_id: str) -> int:
        return len(self._blocks.get(instance_id, ()))
