"""The ``local`` hook: scales by starting and stopping worker processes on this host.

What it owns, and only that: the processes it started (instance ids ``<role>-as<N>``) and
its warm standbys. Instances started by anything else (the launcher's initial workers,
another host) it never counts and never stops: the autoscaler asks ``owns()`` and drains
only owned instances, and ``apply`` refuses a drain list naming any other. Scale-up starts
``decision.<role> - decision.current_<role>`` instances, the counts the router saw.

Scale-up, fast path first (DESIGN.md, warm standby)::

    standby ready?  yes -> write its Activation line: role, id, status port  (imports done)
                    no  -> spawn a fresh process and activate it at once       (slow path)
    wait until each new worker's /ready says yes (it registered with the router),
    then start new standbys to replace the ones used

Scale-down: the autoscaler drained the instance and waited until it held no request;
``apply`` sends SIGTERM (the worker leaves its loop, frees its shared memory and exits) and
waits, SIGKILL after ``stop_timeout_s``.

Every process is ``python -m kvrelay.autoscale.standby`` (see there); it follows the thread
that started it (Linux PDEATHSIG), so call ``apply`` from one long-lived thread, as the
autoscaler does. ``close()`` stops everything the hook owns.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from kvrelay import envs
from kvrelay.autoscale.base import HookError, ScaleDecision, ScalingHook
from kvrelay.autoscale.standby import Activation
from kvrelay.cli.launcher import free_port
from kvrelay.protocol.credential import ClusterCredential, child_environ
from kvrelay.worker.cpu_priority import DECODE_NICE

logger = logging.getLogger(__name__)

_RESERVED_FLAGS = (
    "--role",
    "--instance-id",
    "--status-port",
    "--model",
    "--control-addr",
    "--cluster-id",
    "--host",
)
_POLL_S = 0.1
_NUM_ACTIVATIONS = 20  # activation records kept for describe()


@dataclasses.dataclass(slots=True)
class _Proc:
    popen: subprocess.Popen[bytes]
    log: IO[bytes] | None
    spawned: float  # time.monotonic()
    role: str = ""  # "" while a standby
    instance_id: str = ""
    ready_url: str = ""
    path: str = ""  # "standby" (was warm) | "fresh"
    activated: float = 0.0
    ready_s: float | None = None  # activation -> /ready


class LocalHook(ScalingHook):
    """Starts ``kvrelay serve`` workers as local processes and stops the ones it started.

    Args:
        model: checkpoint directory, as the router's.
        control_addr: the router's control address workers connect to.
        cluster_id: namespaces shared-memory names; the cluster's id.
        host: bind address of the workers.
        worker_args: more ``kvrelay serve`` flags for every worker (engine, ``--host-pool``,
            ``--transport``); not the flags the hook sets itself.
        log_dir: one log file per process; None: they inherit the router's stderr.
        standby: warm standby processes to keep (0: every start is a fresh process).
        start_timeout_s: longest wait for a new worker to be ready.
        stop_timeout_s: longest wait for a stopped worker to exit before SIGKILL.
        credential: the cluster credential its workers get (in their environment, never
            argv); None: they start with --insecure-no-auth, as the router did.
    """

    name = "local"

    def __init__(
        self,
        model: str,
        control_addr: str,
        cluster_id: str,
        host: str = "127.0.0.1",
        worker_args: Sequence[str] = (),
        log_dir: str | None = None,
        standby: int = 1,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
        credential: ClusterCredential | None = None,
    ) -> None:
        if isinstance(worker_args, str) or not all(isinstance(a, str) for a in worker_args):
            raise ValueError(f"worker_args must be a list of strings, got {worker_args!r}")
        for arg in worker_args:
            if arg.split("=", 1)[0] in _RESERVED_FLAGS:
                raise ValueError(f"worker_args may not set {arg!r}: the local hook sets it")
        if credential is not None and not isinstance(credential, ClusterCredential):
            raise ValueError("credential is the router's own; it cannot be an option")
        if standby < 0:
            raise ValueError(f"standby must be >= 0, got {standby}")
        if start_timeout_s <= 0 or stop_timeout_s <= 0:
            raise ValueError("start_timeout_s and stop_timeout_s must be > 0")
        self.host = host
        self._credential = credential
        self.num_standby = standby
        self.start_timeout_s = start_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_dir = Path(log_dir) if log_dir else None
        self._serve_args = [
            "--model", model,
            "--host", host,
            "--control-addr", control_addr,
            "--cluster-id", cluster_id,
            *worker_args,
        ]  # fmt: skip
        self._owned: dict[str, _Proc] = {}
        self._standbys: list[_Proc] = []
        self._activations: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=_NUM_ACTIVATIONS
        )
        self._ids = itertools.count()
        self._num_spawned = 0
        self._last_applied: ScaleDecision | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()  # owns()/describe() run on the event loop, close() anywhere
        self._refill()

    # ------------------------------------------------------------------ ScalingHook
    def apply(self, decision: ScaleDecision) -> None:
        if self._closed.is_set():
            raise HookError("the local hook is closed")
        if decision == self._last_applied:
            return
        foreign = [i for i in decision.drain if i not in self._owned]
        if foreign:
            raise HookError(f"cannot remove instances the local hook did not start: {foreign}")
        for instance_id in decision.drain:
            self._stop(instance_id)
        started = [
            self._start(role)
            for role, desired, current in (
                ("prefill", decision.prefill, decision.current_prefill),
                ("decode", decision.decode, decision.current_decode),
            )
            for _ in range(desired - current)
        ]
        try:
            self._wait_ready(started)
        finally:
            self._refill()
        self._last_applied = decision

    def close(self) -> None:
        """Stops every process the hook owns (workers and standbys).

        Safe to call from another thread while ``apply`` runs: that ``apply`` stops waiting
        for its new workers and raises ``HookError``.
        """
        with self._lock:
            self._closed.set()
            procs = [*self._owned.values(), *self._standbys]
            self._owned.clear()
            self._standbys.clear()
        for proc in procs:
            if proc.popen.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.popen.stdin.close()  # a standby reads EOF and exits
            with contextlib.suppress(ProcessLookupError):
                proc.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout_s
        for proc in procs:
            self._reap(proc, max(0.1, deadline - time.monotonic()))

    # ------------------------------------------------------------------ ownership
    def owns(self, instance_id: str) -> bool:
        return instance_id in self._owned

    def describe(self) -> dict[str, Any]:
        with self._lock:
            instances = {
                i: {"role": p.role, "pid": p.popen.pid, "path": p.path, "ready_s": p.ready_s}
                for i, p in self._owned.items()
            }
            num_standby = sum(1 for p in self._standbys if p.popen.poll() is None)
            activations = list(self._activations)
        return {
            "instances": instances,
            "standby": {"target": self.num_standby, "processes": num_standby},
            "activations": activations,
        }

    # ------------------------------------------------------------------ starting
    def _start(self, role: str) -> _Proc:
        instance_id = f"{role}-as{next(self._ids)}"
        proc, path = self._take_standby(), "standby"
        if proc is None or not self._activate(proc, role, instance_id):
            proc, path = self._spawn(), "fresh"
            if not self._activate(proc, role, instance_id):
                self._reap(proc, self.stop_timeout_s)
                raise HookError(f"a new process for {instance_id} died at once; see its log")
        proc.path = path
        self._keep(proc, instance_id)
        logger.info("local hook: starting %s (%s, pid %d)", instance_id, path, proc.popen.pid)
        return proc

    def _spawn(self) -> _Proc:
        self._num_spawned += 1
        cmd = [sys.executable, "-m", "kvrelay.autoscale.standby"]
        cmd += ["--parent-pid", str(os.getpid()), *self._serve_args]
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            name = f"autoscale-{os.getpid()}-{self._num_spawned}.log"
            log = open(self.log_dir / name, "ab")  # noqa: SIM115 - the process keeps it
        popen = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,  # signals to the router's group do not skip the drain
            env=child_environ(self._credential, envs.inheritable(os.environ)),
        )
        return _Proc(popen, log, time.monotonic())

    def _take_standby(self) -> _Proc | None:
        with self._lock:
            while self._standbys:
                proc = self._standbys.pop(0)
                if proc.popen.poll() is None:
                    return proc
                logger.warning("local hook: standby pid %d had exited", proc.popen.pid)
                self._close_log(proc)
        return None

    def _activate(self, proc: _Proc, role: str, instance_id: str) -> bool:
        """Gives the process its role; False when it is already gone."""
        port = free_port(self.host)
        args: tuple[str, ...] = ("--status-port", str(port))
        if role == "decode":  # on the router's host, with the prefill workers it starts
            args += ("--cpu-nice", str(DECODE_NICE))  # prefill first (worker_args come after)
        activation = Activation(role, instance_id, args)
        assert proc.popen.stdin is not None
        try:
            proc.popen.stdin.write(activation.to_line())
            proc.popen.stdin.close()
        except OSError:
            self._reap(proc, self.stop_timeout_s)
            return False
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        proc.role, proc.instance_id = role, instance_id
        proc.ready_url = f"http://{host}:{port}/ready"
        proc.activated = time.monotonic()
        return True

    def _wait_ready(self, procs: list[_Proc]) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        waiting = list(procs)
        while waiting:
            if self._closed.is_set():
                raise HookError(f"closed while {[p.instance_id for p in waiting]} were starting")
            for proc in list(waiting):
                code = proc.popen.poll()
                if code is not None:
                    self._forget(proc)
                    raise HookError(f"{proc.instance_id} exited with code {code} before ready")
                if _is_ready(proc.ready_url):
                    proc.ready_s = round(time.monotonic() - proc.activated, 3)
                    waiting.remove(proc)
                    self._record_activation(proc)
            if waiting and time.monotonic() > deadline:
                for proc in waiting:
                    self._stop(proc.instance_id)
                ids = [p.instance_id for p in waiting]
                raise HookError(f"{ids} not ready within {self.start_timeout_s:g}s")
            if waiting:
                time.sleep(_POLL_S)

    def _record_activation(self, proc: _Proc) -> None:
        logger.info(
            "local hook: %s ready %.2fs after activation (%s)",
            proc.instance_id,
            proc.ready_s,
            proc.path,
        )
        with self._lock:
            self._activations.append(
                {
                    "instance_id": proc.instance_id,
                    "role": proc.role,
                    "path": proc.path,
                    "ready_s": proc.ready_s,
                    "standby_age_s": round(proc.activated - proc.spawned, 3),
                }
            )

    def _refill(self) -> None:
        with self._lock:
            self._standbys = [p for p in self._standbys if p.popen.poll() is None]
            missing = self.num_standby - len(self._standbys)
        for _ in range(missing):
            self._keep(self._spawn())

    def _keep(self, proc: _Proc, instance_id: str = "") -> None:
        """Records a started process as an instance (or a standby); ends it after close()."""
        with self._lock:
            if not self._closed.is_set():
                if instance_id:
                    self._owned[instance_id] = proc
                else:
                    self._standbys.append(proc)
                return
        proc.popen.terminate()
        self._reap(proc, self.stop_timeout_s)
        raise HookError("the local hook was closed")

    # ------------------------------------------------------------------ stopping
    def _stop(self, instance_id: str) -> None:
        proc = self._owned.get(instance_id)
        if proc is None:
            return  # close() took it
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(signal.SIGTERM)
        self._reap(proc, self.stop_timeout_s)
        self._forget(proc)
        logger.info("local hook: stopped %s (exit code %s)", instance_id, proc.popen.returncode)

    def _forget(self, proc: _Proc) -> None:
        with self._lock:
            self._owned.pop(proc.instance_id, None)
        self._close_log(proc)

    def _reap(self, proc: _Proc, timeout: float) -> None:
        try:
            proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning(
                "local hook: pid %d did not exit in %.0fs; killing it", proc.popen.pid, timeout
            )
            proc.popen.kill()
            proc.popen.wait()
        self._close_log(proc)

    @staticmethod
    def _close_log(proc: _Proc) -> None:
        if proc.log is not None:
            proc.log.close()


def _is_ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
