"""The ``exec`` hook: runs a command with the decision in its environment.

The command sees the inherited environment plus ``ScaleDecision.env()``
(``KVRELAY_PREFILL``, ``KVRELAY_DECODE``, ``KVRELAY_CURRENT_*``, ``KVRELAY_DRAIN``,
``KVRELAY_REASONS``, ``KVRELAY_FORCED``). A list is run as an argv; a string through
``/bin/sh -c``. ``run_command`` is shared with the ``compose`` hook.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence

from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook

logger = logging.getLogger(__name__)

STDERR_TAIL_CHARS = 2000  # how much of a failed command's stderr a HookError quotes


def run_command(
    command: str | Sequence[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
) -> str:
    """Runs ``command`` to completion and returns its stdout.

    The command runs in a new session; on timeout the whole process group is killed, so a
    shell's children do not outlive it.

    Raises:
        HookError: the command cannot start, runs past ``timeout`` seconds, or exits
            non-zero (the message quotes the tail of its stderr).
    """
    shell = isinstance(command, str)
    shown = command if shell else " ".join(command)
    try:
        proc = subprocess.Popen(
            command,
            shell=shell,
            env=None if env is None else dict(env),
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except OSError as e:
        raise HookError(f"cannot run {shown!r}: {e}") from e
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise HookError(f"{shown!r} did not finish within {timeout:g} s") from e
    if proc.returncode != 0:
        tail = stderr.strip()[-STDERR_TAIL_CHARS:]
        raise HookError(f"{shown!r} exited with status {proc.returncode}: {tail}")
    return stdout


class ExecHook(ScalingHook):
    """Runs ``command`` once per decision; exit status 0 means applied."""

    name = "exec"

    def __init__(
        self, *, command: str | Sequence[str], timeout: float = 60.0, cwd: str | None = None
    ) -> None:
        """
        Args:
            command: an argv list, or a string run through ``/bin/sh -c``.
            timeout: seconds the command may run before it is killed.
            cwd: working directory (default: the autoscaler's).
        """
        if not command:
            raise ValueError("exec hook needs a non-empty 'command'")
        if timeout <= 0:
            raise ValueError(f"exec hook timeout must be > 0, got {timeout}")
        self.command: str | tuple[str, ...] = (
            command if isinstance(command, str) else tuple(command)
        )
        self.timeout = timeout
        self.cwd = cwd

    def apply(self, decision: ScaleDecision) -> None:
        env = {**os.environ, **decision.env()}
        run_command(self.command, timeout=self.timeout, env=env, cwd=self.cwd)
        logger.info("exec hook: prefill=%d decode=%d applied", decision.prefill, decision.decode)
