"""The L1 change log (``record_changes``, the placement feed): what one process wrote.

Decides what a pool reports to the routers. A writer knows at ``put`` time which key it wrote
and, when it took an occupied way, which key it evicted; it notes both in a per-process dict
(key -> stored or evicted, the later change wins) while it holds the set lock anyway, and
``take_changes`` hands them over. The cost is one dict entry per newly written key, plus
reading the victim's 16-byte key when a way is evicted; a put of a present key notes nothing,
and a pool opened without the flag does no more than before. Each writer reports only its own
changes; the log is capped at ``MAX_CHANGES`` keys between two ``take_changes`` (beyond it
changes are not noted): the router's index of this pool is a hint, and a stale entry costs a
miss there, never a wrong block.
"""

from __future__ import annotations

from kvrelay.cachetier.base import TierChanges

MAX_CHANGES = 1 << 16  # keys noted between two take_changes (the worker takes every 0.2 s)


class ChangeLog:
    """Key -> stored (True) or evicted (False) by this process, the later change winning.

    Not thread-safe: ``HostPool`` notes under a set lock and swaps the log under its thread
    lock.
    """

    def __init__(self) -> None:
        self._changes: dict[bytes, bool] = {}

    def note(self, evicted: bytes | None, stored: bytes | None) -> None:
        changes = self._changes
        if len(changes) >= MAX_CHANGES:
            return
        if evicted is not None:
            changes[evicted] = False
        if stored is not None:
            changes[stored] = True

    def as_tier_changes(self) -> TierChanges:
        changes = self._changes
        stored = [key for key, is_stored in changes.items() if is_stored]
        return TierChanges(stored, [key for key, is_stored in changes.items() if not is_stored])
