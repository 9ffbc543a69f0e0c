"""The device-cache feed of the routers' prefix index: the block manager's changes, netted.

The engine drains its block manager's changes after each step (and the worker between steps:
KV intake and aborts change blocks too); the worker sends them once a heartbeat. Between two
sends the changes are kept in order as key -> stored or evicted, the later change winning, so
each key goes out in one list only. Two plain lists would lose the order: a block stored and
evicted again between two heartbeats would reach the router in both, the router would apply
the eviction first and the store last, and go on crediting this instance with a block it no
longer holds (placement then sends prompts where their prefix is not).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvrelay.engine.block_manager import CacheEvents


class DeviceCacheFeed:
    """Netted device-cache changes between two ``take`` calls; one thread only."""

    def __init__(self) -> None:
        self._changes: dict[bytes, bool] = {}

    def note(self, events: CacheEvents) -> None:
        """Adds one drain of the block manager. Within one drain a key in both lists was
        evicted first and stored again (the block manager nets a store and its eviction)."""
        changes = self._changes
        for key in events.evicted:
            changes[bytes(key)] = False
        for key, _ in events.stored:
            changes[bytes(key)] = True

    def take(self) -> tuple[list[bytes], list[bytes]] | None:
        """(stored, evicted) since the last call, or None when nothing changed."""
        if not self._changes:
            return None
        changes, self._changes = self._changes, {}
        stored = [key for key, is_stored in changes.items() if is_stored]
        return stored, [key for key, is_stored in changes.items() if not is_stored]
