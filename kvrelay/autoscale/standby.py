"""A warm standby worker process (the fast path of the ``local`` hook's scale-up).

``python -m kvrelay.autoscale.standby [--parent-pid PID] SERVE_ARGS...`` imports torch and
the worker modules — the seconds a fresh process spends before it can do anything — then
blocks on stdin for one JSON line, an ``Activation`` naming its role and instance id, and
becomes ``kvrelay serve --role ROLE --instance-id ID ACTIVATION_ARGS... SERVE_ARGS...``::

    spawned ──imports──> warm (blocked on stdin) ──Activation line──> worker (registers when ready)
                             └──EOF (the hook closed the pipe or died)──> exits 0, serves nothing

On Linux the process also asks the kernel for SIGTERM when the thread that started it ends
(``PR_SET_PDEATHSIG``), so the workers of a router that was killed do not outlive it; a
worker shuts down cleanly on SIGTERM.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# What a worker imports before it can serve; torch dominates.
_PRELOAD = (
    "torch",
    "kvrelay.cli",
    "kvrelay.worker.serve",
    "kvrelay.prefill.worker",
    "kvrelay.decode.worker",
    "kvrelay.transport.shm_pool",
)
_PR_SET_PDEATHSIG = 1
_WORKER_ROLES = ("prefill", "decode", "colocated")


@dataclasses.dataclass(frozen=True, slots=True)
class Activation:
    """The one line a standby waits for."""

    role: str  # prefill | decode | colocated
    instance_id: str
    args: tuple[str, ...] = ()  # more ``kvrelay serve`` flags, e.g. ("--status-port", "8123")

    def __post_init__(self) -> None:
        if self.role not in _WORKER_ROLES:
            raise ValueError(f"role must be one of {_WORKER_ROLES}, got {self.role!r}")
        if not self.instance_id:
            raise ValueError("instance_id must not be empty")

    def to_line(self) -> bytes:
        data = {"role": self.role, "instance_id": self.instance_id, "args": list(self.args)}
        return json.dumps(data).encode() + b"\n"

    @classmethod
    def from_line(cls, line: str) -> Activation:
        """Raises ``ValueError`` for anything but a valid activation object."""
        data = json.loads(line)
        if not isinstance(data, dict) or set(data) - {"role", "instance_id", "args"}:
            raise ValueError(f"not an activation: {line.strip()!r}")
        args = data.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise ValueError(f"activation args must be a list of strings, got {args!r}")
        return cls(str(data.get("role")), str(data.get("instance_id", "")), tuple(args))


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM to this process when its parent goes (Linux); exit now if it already went."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    if parent_pid and os.getppid() != parent_pid:
        sys.exit(0)  # the parent died before we asked to follow it


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    parent_pid = 0
    if args[:1] == ["--parent-pid"]:
        parent_pid, args = int(args[1]), args[2:]
    die_with_parent(parent_pid)
    for name in _PRELOAD:
        importlib.import_module(name)
    line = sys.stdin.readline()
    if not line.strip():
        return 0
    try:
        activation = Activation.from_line(line)
    except ValueError as e:
        print(f"kvrelay standby: bad activation: {e}", file=sys.stderr)
        return 2
    cli = importlib.import_module("kvrelay.cli")  # preloaded above
    serve = ["serve", "--role", activation.role, "--instance-id", activation.instance_id]
    return int(cli.main([*serve, *activation.args, *args]))


if __name__ == "__main__":
    sys.exit(main())
