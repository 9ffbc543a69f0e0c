"""Instances kept in the order placement ranks them, so a request looks at the first few.

A ``LoadOrder`` is a lazy heap of ``(key, order, version, instance)`` entries, ``order``
being the registry's registration order (its tie-break). The registry pushes an instance's
entry again whenever what its key reads changes (a load report, a request assigned to it)
and forgets it on removal; the older entries stay in the heap, stale, and are skipped and
dropped lazily:

    entry is current  <=>  version == current[instance_id]      (exactly one per instance)
    len(heap) <= 2 * len(current) + SLACK                        (compacted on push)

Walking the heap in order (``in_order``) costs O(k log k) for the first k entries (stale
ones included), not O(instances). What a key does not read (draining, exclusions) the
caller filters while walking.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvrelay.router.instance import Instance

SLACK = 64  # stale entries tolerated beyond one per current entry before a compaction

Key = tuple[Any, ...]
Entry = tuple[Key, int, int, "Instance"]


class LoadOrder:
    """Instances ascending by ``(key(instance), order)``; see the module docstring."""

    def __init__(self, key: Callable[[Instance], Key]) -> None:
        self._key = key
        self._heap: list[Entry] = []
        self._current: dict[str, int] = {}  # instance id -> version of its current entry
        self._versions = itertools.count()

    def __len__(self) -> int:
        return len(self._current)

    def update(self, inst: Instance, order: int) -> None:
        """(Re)files ``inst`` under its key as it is now; its older entry goes stale."""
        version = next(self._versions)
        self._current[inst.instance_id] = version
        heapq.heappush(self._heap, (self._key(inst), order, version, inst))
        if len(self._heap) > 2 * len(self._current) + SLACK:
            self._heap = [e for e in self._heap if self._is_current(e)]
            heapq.heapify(self._heap)

    def discard(self, instance_id: str) -> None:
        """Forgets the instance (its entries go stale)."""
        self._current.pop(instance_id, None)

    def _is_current(self, entry: Entry) -> bool:
        return self._current.get(entry[3].instance_id) == entry[2]

    def in_order(self) -> Iterator[Instance]:
        """The instances, each once, ascending by (key, order). Nothing may be updated or
        discarded while the iterator is in use."""
        heap = self._heap
        while heap and not self._is_current(heap[0]):
            heapq.heappop(heap)
        frontier: list[tuple[Entry, int]] = [(heap[0], 0)] if heap else []
        while frontier:
            entry, index = heapq.heappop(frontier)
            if self._is_current(entry):
                yield entry[3]
            for child in (2 * index + 1, 2 * index + 2):
                if child < len(heap):
                    heapq.heappush(frontier, (heap[child], child))

    def check_integrity(self) -> None:
        """Exactly one current entry per instance, filed under its key as it is now."""
        current = [e for e in self._heap if self._is_current(e)]
        assert len(current) == len(self._current), (len(current), len(self._current))
        for key, _order, _version, inst in current:
            assert key == self._key(inst), (inst.instance_id, key, self._key(inst))
