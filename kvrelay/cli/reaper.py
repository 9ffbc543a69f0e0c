"""Removes a launched cluster's shared memory once its launcher and its processes are gone.

``python -m kvrelay.cli.reaper LAUNCHER_PID PREFIX``, started by the launcher
(``Launcher.start``) as its child. A launcher that stops normally unlinks every segment named
for its cluster (``Launcher.stop``) and ends this process. One killed with SIGKILL cannot: its
routers and workers then notice it is gone (``follow_launcher``), drain and exit, and each
worker unlinks its own KV pools; the L1 host pool that they all map stays, and nobody would
free it. This process waits for its parent, the launcher, to go, then for the last live
process that maps a segment starting with ``PREFIX`` to exit, and unlinks what is left.

It imports neither torch nor the engine, and polls: the parent pid every
``LAUNCHER_CHECK_S``, then ``/proc``'s mappings, for at most ``MAX_WAIT_S`` (a process that
maps a segment that long after its launcher died is not one of ours to wait for).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence

from kvrelay.cachetier.segments import segment_mappers
from kvrelay.cli.launcher import LAUNCHER_CHECK_S, wait_for_parent_exit
from kvrelay.transport.shm_pool import cleanup_segments, list_segments

logger = logging.getLogger("kvrelay.reaper")

MAX_WAIT_S = 600.0  # after the launcher: the longest wait for the cluster's processes


def reap(prefix: str, max_wait_s: float = MAX_WAIT_S) -> list[str]:
    """Unlinks the segments starting with ``prefix`` once no live process maps any of them
    (or after ``max_wait_s``); returns the names removed."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline:
        names = list_segments(prefix)
        if not names:
            return []
        mappers = segment_mappers()
        if not any(mappers.get(name) for name in names):
            break
        time.sleep(LAUNCHER_CHECK_S)
    return cleanup_segments(prefix)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 2 or not args[0].isdigit() or not args[1].startswith("kvrelay-"):
        print("usage: python -m kvrelay.cli.reaper LAUNCHER_PID kvrelay-PREFIX", file=sys.stderr)
        return 2
    launcher_pid, prefix = int(args[0]), args[1]
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        wait_for_parent_exit(launcher_pid)
        removed = reap(prefix)
    except KeyboardInterrupt:
        return 0
    if removed:
        logger.warning("launcher %d is gone; removed %s", launcher_pid, ", ".join(removed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
