"""``/dev/shm``: its room (``shm_room``), and which live processes map a segment, as the
kernel sees it (``/proc/*/maps``).

Used where a segment's own bookkeeping cannot answer: an L1 pool keeps no user table, and a
parameter pool written by another kvrelay version has a table this version cannot trust.
Processes of other users are invisible without privileges; callers treat the answer as a
lower bound.
"""

from __future__ import annotations

import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def shm_room() -> int | None:
    """Bytes free in /dev/shm now (None where there is none to ask). Segments created but not
    yet written count as free: a check against it catches a segment larger than /dev/shm (a
    container's 64 MiB default), not several that only together exceed it."""
    try:
        vfs = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return vfs.f_bavail * vfs.f_frsize


def segment_mappers() -> dict[str, tuple[int, ...]]:
    """``{segment name: pids}`` of the live processes that map a file of ``/dev/shm``."""
    found: dict[str, set[int]] = {}
    prefix = f"{SHM_DIR}/"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            maps = (proc / "maps").read_text()
        except OSError:  # exited, or another user's
            continue
        for line in maps.splitlines():
            at = line.find(prefix)
            if at >= 0:
                name = line[at + len(prefix) :].removesuffix(" (deleted)")
                found.setdefault(name, set()).add(int(proc.name))
    return {name: tuple(sorted(pids)) for name, pids in found.items()}
