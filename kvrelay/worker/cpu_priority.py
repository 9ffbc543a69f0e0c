"""A worker's CPU priority against the other workers on its cores (``--cpu-nice``).

On one host a 1P+1D cluster's workers share the cores, and under Linux's default scheduling
each process started in its own session (as ``kvrelay up`` starts them) is its own
*autogroup*: the scheduler splits the CPUs fairly between the groups first, whatever the
threads' nice values. A decode worker stepping without pause then takes half the cores
from a prefill worker computing a prompt, and every first token waits twice as long.
Lowering the decode worker's priority puts prefill first across processes, as a colocated
engine's scheduler puts a waiting prompt before its decode rows: on 2 vCPUs, 1P+1D at
saturation gave TTFT p50 3.6 s against 5.7 s before, and at 1 request/s 325 against 434 ms
(single runs; BENCHMARKS.md "1P+1D: prefill first on shared cores").

Both knobs are set, since which one counts depends on the kernel: the nice value of every
thread of the process (the threads started after, the OpenMP team among them, inherit it; it
orders threads within a group, or all threads where autogroups are off) and, when the process
leads its own session, its autogroup's nice (``/proc/self/autogroup``; it orders the groups). A
process that shares its session (a shell's) leaves the autogroup alone: it would lower the
shell and everything else in it.

A lowered worker that computes a prompt itself (a decode worker under the router's conditional
disaggregation, or recomputing a preempted sequence) would compute it at the low priority
against the prefill workers it yields to: one such float32 step took 7.8 s on 2 vCPUs, the
prefill worker's 2,048-token steps 2.3 s in the same run, and every stream on the decode
worker waited for it (BENCHMARKS.md "Peers: online serving"). So ``follow_prompts`` moves its
autogroup back to nice 0 while it has a prompt to compute, and down again after. The
autogroup's nice may be raised back to 0 without privileges (a thread's nice may not: the
kernel needs CAP_SYS_NICE for that), so where autogroups are off this does nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

MAX_NICE = 19
DECODE_NICE = 19  # a decode worker's on cores it may share with prefill (kvrelay up, local hook)
AUTOGROUP = Path("/proc/self/autogroup")


def autogroup_nice(pid: int | str = "self") -> int | None:
    """A process's autogroup nice, or None where it has none to read: a kernel without
    autogroups, or a process in the root group (PID 1's session and every process that never
    started a session of its own below it; the kernel prints nothing for it)."""
    try:
        fields = Path(f"/proc/{pid}/autogroup").read_text().split()
    except OSError:
        return None
    return int(fields[-1]) if fields else None


def lower_cpu_priority(nice: int) -> list[str]:
    """Lowers this process's CPU priority by ``nice`` (0-19); returns what it changed."""
    if not 0 <= nice <= MAX_NICE:
        raise ValueError(f"--cpu-nice must be 0-{MAX_NICE}, got {nice}")
    if nice == 0:
        return []
    # every thread there is (a standby process has some before its activation); the threads
    # started later inherit it from the one that starts them
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, current + nice))
    _state.nice = nice
    changed = [f"nice {os.getpriority(os.PRIO_PROCESS, 0)}"]
    if os.getsid(0) == os.getpid():
        try:
            AUTOGROUP.write_text(f"{nice}\n")
            changed.append(f"autogroup nice {nice}")
            _state.lowered = nice
        except OSError as e:  # no autogroup support, or a kernel that refuses it
            logger.info("cpu priority: autogroup left as it is (%s)", e)
    logger.info("lower CPU priority: %s", ", ".join(changed))
    return changed


class _State:
    nice: int = 0  # what ``lower_cpu_priority`` lowered the threads by (Register.cpu_nice)
    lowered: int | None = None  # the autogroup nice ``lower_cpu_priority`` set, if it set one
    raised = False  # the autogroup is at nice 0 for a prompt (``follow_prompts``)


_state = _State()


def lowered_by() -> int:
    """How far ``lower_cpu_priority`` lowered this process (0: it did not): the worker tells
    its routers (``Register.cpu_nice``), which wait longer for its heartbeats."""
    return _state.nice


def follow_prompts(has_prompt: Callable[[], bool]) -> bool:
    """Called before each engine step: a worker whose autogroup ``lower_cpu_priority``
    lowered computes its own prompts at nice 0, and is lowered again once it has none; True
    when this call raised it. ``has_prompt`` is asked only in such a worker (the others pay
    nothing on their loop). A change the kernel refuses (one per 100 ms without
    CAP_SYS_ADMIN) is tried again at the next step."""
    if _state.lowered is None:
        return False
    has = has_prompt()
    if has == _state.raised:
        return False
    nice = 0 if has else _state.lowered
    try:
        AUTOGROUP.write_text(f"{nice}\n")
    except OSError as e:
        logger.debug("cpu priority: autogroup nice %d not set (%s)", nice, e)
        return False
    _state.raised = has
    return has
