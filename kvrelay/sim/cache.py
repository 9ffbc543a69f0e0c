"""The simulated cache tiers: LRU caches of prompt segments, weighted by their KV blocks.

One ``SegmentLru`` per device pool (an instance), per host (the L1 host pool) and one global
(L2, Redis). An entry is a shareable segment (``workload.py``) or a request's unique blocks
(key ``-(rid + 1)``: they fill capacity and push segments out, but never hit). A lookup walks a
prompt's segments in order: the device's leading run, then L1 from there, then L2 — what an
engine copies in instead of computing (``engine/offload.py``).

Invariant (``check_integrity``): ``used_blocks == sum of entry weights <= capacity_blocks``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SegmentLru:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.used_blocks = 0
        self._entries: OrderedDict[int, int] = OrderedDict()  # key -> blocks, LRU first
        self._stored: set[int] = set()  # segments added since the last drain_events()
        self._evicted: dict[int, int] = {}  # segments dropped since then -> their blocks

    def __contains__(self, key: int) -> bool:
        return key in self._entries

    def touch(self, key: int) -> None:
        self._entries.move_to_end(key)

    def put(self, key: int, blocks: int, limit: int | None = None) -> None:
        """Adds (or refreshes) an entry, evicting LRU entries to stay within ``limit``
        (default: capacity). An entry larger than the limit is not kept."""
        limit = self.capacity_blocks if limit is None else limit
        old = self._entries.pop(key, None)
        if old is not None:
            self.used_blocks -= old
        if blocks > limit:
            if old is not None and key >= 0:
                self._evicted[key] = old
            return
        if key >= 0:
            self._stored.add(key)
        self._entries[key] = blocks
        self.used_blocks += blocks
        self.shrink(limit)

    def shrink(self, limit: int) -> None:
        """Evicts LRU entries until at most ``limit`` blocks are held."""
        entries = self._entries
        while self.used_blocks > limit and entries:
            key, blocks = entries.popitem(last=False)
            self.used_blocks -= blocks
            if key >= 0:
                self._evicted[key] = blocks

    def leading(self, segments: Sequence[tuple[int, int]], start: int) -> int:
        """How many of ``segments[start:]``, in a row, are held (touched as hits)."""
        n = 0
        for key, _ in segments[start:]:
            if key not in self._entries:
                break
            self._entries.move_to_end(key)
            n += 1
        return n

    def drain_events(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The net change since the last call: (segment, blocks) stored and evicted."""
        entries = self._entries
        stored = [(k, entries[k]) for k in self._stored if k in entries]
        evicted = [(k, n) for k, n in self._evicted.items() if k not in entries]
        self._stored, self._evicted = set(), {}
        return stored, evicted

    def check_integrity(self) -> None:
        assert self.used_blocks == sum(self._entries.values()) <= max(self.capacity_blocks, 0)
