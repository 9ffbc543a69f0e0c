"""Starts a cluster as local processes: the embedded default (``kvrelay up``) and the tests.

Every process is ``python -m kvrelay serve --role ...`` — the same command compose and
Kubernetes run. Ports are picked free at start and shared-memory names carry the cluster
id, so two clusters on one host never collide. ``stop()`` ends every process (SIGTERM, then
SIGKILL after a grace period) and unlinks every segment named for the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from kvrelay import envs
from kvrelay.protocol.credential import ClusterCredential, child_environ
from kvrelay.router import EXIT_ADDRESS_IN_USE
from kvrelay.worker import cpu_priority

logger = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "colocated")


class LaunchError(RuntimeError):
    """A cluster process did not start or did not become ready in time."""


class StartInterrupted(LaunchError):
    """``interrupt`` was set (Ctrl-C, SIGTERM) before the cluster was ready."""


class AddressInUse(LaunchError):
    """A router exited because its HTTP port or control address was taken."""


START_ATTEMPTS = 3  # starts on fresh ports when a picked port was taken before the router bound it


LAUNCHER_CHECK_S = 0.5  # how often a started process looks for its launcher


def follow_launcher(pid: int) -> None:
    """In a process that a launcher started (``--launcher-pid``): SIGTERM to this process
    once that launcher, its parent, is gone, so that a ``kvrelay up`` killed with SIGKILL
    (which it cannot catch to stop its cluster) leaves no router or worker behind: each
    drains and exits as on any SIGTERM, a worker unlinking its KV pools (the L1 host pool
    they share is the reaper's: ``kvrelay.cli.reaper``). The processes run in sessions of
    their own (a terminal's Ctrl-C goes to the launcher, which stops them in order), so
    nothing else would end them. A thread polls the parent pid rather than asking for
    PR_SET_PDEATHSIG, which fires when the *thread* that started the process ends."""
    threading.Thread(
        target=_watch_launcher, args=(pid,), name="follow-launcher", daemon=True
    ).start()


def wait_for_parent_exit(pid: int) -> None:
    """Returns once this process's parent is no longer ``pid`` (an orphan is adopted by init
    or a subreaper): ``follow_launcher``'s thread and ``kvrelay.cli.reaper``."""
    while os.getppid() == pid:
        time.sleep(LAUNCHER_CHECK_S)


def _watch_launcher(pid: int) -> None:
    wait_for_parent_exit(pid)
    logger.warning("the launcher (pid %d) that started this process is gone; shutting down", pid)
    os.kill(os.getpid(), signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raises LaunchError when ``host:port`` is taken: a readiness probe would otherwise
    reach whatever already listens there (another cluster) and report it as ours.

    Bound with SO_REUSEADDR, as the router's server binds: connections of a cluster stopped a
    moment ago wait in TIME_WAIT for up to a minute and must not refuse its restart, while
    a socket listening on the port still does (Linux refuses a second listener)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise LaunchError(
                f"port {port} on {host} is in use ({e.strerror}); another cluster may be "
                "serving there: stop it or pick another --port"
            ) from None


def check_model_dir(model: str) -> None:
    """Raises LaunchError unless ``model`` is a checkpoint directory (before any start)."""
    path = Path(model)
    if not path.is_dir():
        raise LaunchError(f"model directory {model} does not exist")
    if not (path / "config.json").is_file():
        raise LaunchError(
            f"{model} is not a checkpoint directory (no config.json); "
            "`kvrelay model get` or `kvrelay model make-tiny` writes one"
        )


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    model: str  # checkpoint directory
    num_prefill: int = 1  # prefill workers
    num_decode: int = 1  # decode workers
    num_colocated: int = 0  # colocated workers (prefill and decode in one engine)
    host: str = "127.0.0.1"  # bind address of every process
    port: int = 0  # router HTTP port; 0 = a free one
    transport: str = "auto"  # auto | shm | tcp
    cluster_id: str = ""  # default: a fresh unique id
    worker_args: tuple[str, ...] = ()  # extra `kvrelay serve` flags for every worker
    router_args: tuple[str, ...] = ()  # extra flags for the router
    log_dir: str | None = None  # one log file per process; None = inherit stderr
    num_routers: int = 1  # routers side by side; every worker reports to all of them
    credential: ClusterCredential | None = None  # the cluster secret; None: a new one
    insecure_no_auth: bool = False  # no secret at all: every process runs --insecure-no-auth
    admin_token: str | None = None  # the router's /admin/* token (in its environment)
    # role -> --threads of that role's workers, over --threads in worker_args and the split
    role_threads: Mapping[str, int] = dataclasses.field(default_factory=dict)
    autoscale: bool = False  # the router adds workers: their threads may come to overlap

    def __post_init__(self) -> None:
        if self.num_routers < 1:
            raise ValueError(f"need at least one router, got {self.num_routers}")
        counts = (self.num_prefill, self.num_decode, self.num_colocated)
        if min(counts) < 0:
            raise ValueError(f"instance counts must be >= 0, got {counts}")
        if self.insecure_no_auth and self.credential is not None:
            raise ValueError("a credential and insecure_no_auth: choose one")
        if not self.num_colocated and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("need at least one prefill and one decode worker, or colocated ones")
        for role, threads in self.role_threads.items():
            if role not in ROLES or threads < 1:
                raise ValueError(f"threads of role {role!r} must be >= 1, got {threads!r}")


@dataclasses.dataclass
class Proc:
    name: str
    role: str
    popen: subprocess.Popen[bytes]
    log: IO[bytes] | None


def worker_threads(spec: ClusterSpec, num_cpus: int) -> int:
    """torch threads per worker when ``--threads`` is not given: the CPUs split between the
    workers of one role (colocated workers: between all of them). Workers of one role are
    busy at the same times and would only take cores from each other; a prefill and a decode
    worker mostly are not (a prompt's prefill, then its decode), so each role may use every
    core the other leaves idle. With OpenMP's passive wait (``envs.use_passive_openmp_wait``)
    a thread that finds its core taken sleeps instead of spinning at a barrier, which made the
    overlap cheap: 1P+1D on 2 vCPUs with 2 threads each against 1 each served a production
    trace with TTFT p50 0.92-0.98 against 1.17-1.22 s and TPOT p50 30-31 against 38-39 ms,
    32 prompts at once at 78.9 / 82.7 against 78.3 / 73.0 tok/s, and the first request after
    a start as fast (BENCHMARKS.md "1P+1D threads: ..."). Before that wait policy, two
    2-thread pools on 2 cores spun at each other's barriers (a decode-attention call 33 ms
    against 0.4)."""
    if spec.num_colocated:
        per_core = spec.num_prefill + spec.num_decode + spec.num_colocated
    else:
        per_core = max(spec.num_prefill, spec.num_decode)
    return max(1, num_cpus // max(1, per_core))


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Launcher:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.threads_per_worker = worker_threads(spec, available_cpus())
        self.cluster_id = spec.cluster_id or f"up{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.credential: ClusterCredential | None = None
        if not spec.insecure_no_auth:
            self.credential = spec.credential or ClusterCredential.generate()
        self._pick_ports()
        self.procs: dict[str, Proc] = {}
        self._counts = dict.fromkeys(ROLES, 0)
        self._reaper: subprocess.Popen[bytes] | None = None  # kvrelay.cli.reaper
        # set from a signal handler: ``wait_ready`` gives up (``StartInterrupted``)
        self.interrupt = threading.Event()

    def _pick_ports(self) -> None:
        """Free ports for the routers (``spec.port`` for the first one's HTTP, when given)."""
        host = self.spec.host
        self.port = self.spec.port or free_port(host)
        self.control_addr = f"tcp://{host}:{free_port(host)}"
        # routers after the first: (HTTP port, control address) each
        self.more_routers = [
            (free_port(host), f"tcp://{host}:{free_port(host)}")
            for _ in range(self.spec.num_routers - 1)
        ]

    @property
    def segment_prefix(self) -> str:
        """What every shared-memory segment of this cluster's name starts with."""
        return f"kvrelay-{self.cluster_id}-"

    @property
    def host_pool_name(self) -> str:
        """The L1 host pool this cluster's workers share unless told otherwise."""
        return f"{self.segment_prefix}l1"

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.port}"

    @property
    def router_urls(self) -> list[str]:
        """Every router's URL, the first's (``url``) first."""
        return [self.url, *(f"http://{self.spec.host}:{p}" for p, _ in self.more_routers)]

    # ------------------------------------------------------------------ start
    def start(self, timeout: float = 120.0) -> None:
        """Starts the routers and the workers; returns when all are ready.

        A port picked here can be taken by another process before the router binds it (it
        is free only when picked): the router then exits with ``EXIT_ADDRESS_IN_USE``, and
        everything started is stopped and started again on new ports, up to
        ``START_ATTEMPTS`` times."""
        check_model_dir(self.spec.model)
        if self.spec.port:
            check_port_free(self.spec.host, self.spec.port)
        deadline = time.monotonic() + timeout
        for attempt in range(1, START_ATTEMPTS + 1):
            self._start_processes()
            try:
                self.wait_ready(max(1.0, deadline - time.monotonic()))
                return
            except AddressInUse as e:
                if attempt == START_ATTEMPTS:
                    raise
                logger.warning("%s; starting again on other ports", e)
                self.stop()
                self._counts = dict.fromkeys(ROLES, 0)
                self._pick_ports()

    def _start_processes(self) -> None:
        self.start_router()
        for i, (port, addr) in enumerate(self.more_routers, start=1):
            args = ["--port", str(port), *self.spec.router_args]
            self._spawn(f"router-{i}", "router", args, control_addr=addr)
        for role, count in zip(
            ROLES, (self.spec.num_prefill, self.spec.num_decode, self.spec.num_colocated)
        ):
            for _ in range(count):
                self.add_worker(role)

    def start_router(self) -> None:
        """Starts the router (again, after a crash: same port and control address)."""
        self._spawn("router", "router", ["--port", str(self.port), *self.spec.router_args])

    def add_worker(self, role: str, extra_args: Sequence[str] = ()) -> str:
        """Starts one more worker; returns its instance id (it joins when ready)."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        name = f"{role}-{self._counts[role]}"
        self._counts[role] += 1
        given = (*self.spec.worker_args, *extra_args)
        defaults = []
        if "--host-pool" not in given:
            defaults += ["--host-pool", self.host_pool_name]  # removed with the cluster at stop
        if "--threads" not in given:
            defaults += ["--threads", str(self.threads_per_worker)]
        if role == "decode" and "--cpu-nice" not in given and self.prefill_first():
            defaults += ["--cpu-nice", str(cpu_priority.DECODE_NICE)]
        role_threads = []  # after worker_args: the last --threads is the one argparse keeps
        if role in self.spec.role_threads and "--threads" not in extra_args:
            role_threads = ["--threads", str(self.spec.role_threads[role])]
        args = [
            "--cluster-id", self.cluster_id,
            "--instance-id", name,
            "--transport", self.spec.transport,
            *defaults,
            *self.spec.worker_args,
            *role_threads,
            *extra_args,
        ]  # fmt: skip
        self._spawn(name, role, args)
        return name

    def _spawn(
        self, name: str, role: str, args: list[str], control_addr: str | None = None
    ) -> None:
        """Starts one process; a worker reports to every router, a router binds its own
        ``control_addr`` (default: the first router's)."""
        if control_addr is None and role == "router":
            control_addr = self.control_addr
        elif control_addr is None:
            control_addr = ",".join([self.control_addr, *(a for _, a in self.more_routers)])
        cmd = [
            sys.executable, "-m", "kvrelay", "serve",
            "--role", role,
            "--model", self.spec.model,
            "--host", self.spec.host,
            "--control-addr", control_addr,
            "--launcher-pid", str(os.getpid()),
            *args,
        ]  # fmt: skip
        if self._reaper is None:
            self._start_reaper()
        log = None
        if self.spec.log_dir:
            Path(self.spec.log_dir).mkdir(parents=True, exist_ok=True)
            log = open(Path(self.spec.log_dir) / f"{name}.log", "ab")  # noqa: SIM115 - kept open
        popen = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
            start_new_session=True,
            env=self._environ(role),
        )
        self.procs[name] = Proc(name, role, popen, log)
        logger.debug("started %s (pid %d): %s", name, popen.pid, " ".join(cmd))

    def _start_reaper(self) -> None:
        """The process that frees the cluster's shared memory if this one is killed before
        ``stop`` (``kvrelay.cli.reaper``); ``stop`` ends it."""
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.cli.reaper", str(os.getpid()), self.segment_prefix],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C is the launcher's to handle
            env=envs.inheritable(os.environ),
        )

    def _environ(self, role: str = "router") -> dict[str, str]:
        """A process's environment: the cluster secret and the admin token travel here, never
        in argv (which every local user can read in /proc). A worker whose cluster's threads
        fit the CPUs gets the OpenMP short spin (``own_cores``)."""
        environ = child_environ(self.credential, envs.inheritable(os.environ))
        if self.spec.admin_token:
            environ["KVRELAY_ADMIN_TOKEN"] = self.spec.admin_token
        if role != "router" and self.own_cores():
            environ = envs.short_spin_environ(environ)
        return environ

    def prefill_first(self) -> bool:
        """Decode workers run at a lower CPU priority (``cpu_priority.DECODE_NICE``): prefill
        workers may be on the same cores (``own_cores`` False) and there are some, or an
        autoscaler may add them. A prompt's prefill then gets the cores it shares with decode
        steps, as a colocated engine schedules a waiting prompt before its decode rows
        (``kvrelay.worker.cpu_priority``)."""
        has_prefill = self.spec.num_prefill > 0 or self.spec.autoscale
        return has_prefill and not self.own_cores()

    def own_cores(self) -> bool:
        """True when every worker of the cluster can have its threads' cores to itself: the
        workers' ``--threads`` add up to at most the CPUs, and no autoscaler adds more. Then
        their OpenMP threads spin briefly between a step's ops (``envs.use_short_openmp_spin``:
        a colocated worker's TPOT p50 75 / 73 against 79 / 80 ms passive); where the threads
        overlap (1P+1D on shared cores) a spinning thread holds the core the other worker needs
        (TPOT p50 83 / 78 against 52 / 54 ms), so they wait passively."""
        if self.spec.autoscale:
            return False
        counts = {
            "prefill": self.spec.num_prefill,
            "decode": self.spec.num_decode,
            "colocated": self.spec.num_colocated,
        }
        total = sum(n * self.role_threads(role) for role, n in counts.items() if n)
        return total <= available_cpus()

    def role_threads(self, role: str) -> int:
        """``--threads`` a worker of ``role`` gets (as ``add_worker`` passes it)."""
        if role in self.spec.role_threads:
            return self.spec.role_threads[role]
        args = self.spec.worker_args
        for i in range(len(args) - 1, -1, -1):  # the last --threads is the one argparse keeps
            if args[i] == "--threads" and i + 1 < len(args):
                return int(args[i + 1])
            if args[i].startswith("--threads="):
                return int(args[i].split("=", 1)[1])
        return self.threads_per_worker

    def wait_ready(self, timeout: float = 120.0, names: Sequence[str] | None = None) -> None:
        """Waits until the router is up and every named worker (default: all) has joined;
        raises ``StartInterrupted`` as soon as ``interrupt`` is set."""
        wanted = set(names if names is not None else self.worker_names())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.interrupt.is_set():
                raise StartInterrupted("interrupted while starting")
            self._check_alive()
            joined = [self.joined_instances(url) for url in self.router_urls]
            if all(j is not None and wanted <= j for j in joined):
                return
            self.interrupt.wait(0.2)
        raise LaunchError(f"cluster not ready after {timeout:.0f}s{self._where_logs()}")

    def worker_names(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.role != "router"]

    def joined_instances(self, url: str | None = None) -> set[str] | None:
        """Instance ids the router at ``url`` (default: the first) knows; None while it
        does not answer."""
        data = self.get_json("/admin/instances", base=url)
        return None if data is None else {d["instance_id"] for d in data["data"]}

    def get_json(self, path: str, timeout: float = 2.0, base: str | None = None) -> Any:
        headers = {}
        token = self.spec.admin_token or envs.get("KVRELAY_ADMIN_TOKEN")
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request((base or self.url) + path, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as resp:
                return json.loads(resp.read())
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def _check_alive(self) -> None:
        for proc in self.procs.values():
            code = proc.popen.poll()
            if code == EXIT_ADDRESS_IN_USE and proc.role == "router":
                raise AddressInUse(
                    f"{proc.name} exited: its port or control address is in use{self._where_logs()}"
                )
            if code is not None and proc.role == "router":
                raise LaunchError(f"{proc.name} exited with code {code}{self._where_logs()}")

    def _where_logs(self) -> str:
        if self.spec.log_dir:
            return f"; logs: {self.spec.log_dir}"
        return "; its log is above"

    # ------------------------------------------------------------------ stop
    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Sends ``sig`` to one process (fault tests) and reaps it."""
        proc = self.procs.pop(name)
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(sig)
        proc.popen.wait(timeout=30)
        if proc.log:
            proc.log.close()

    def stop(self, grace: float = 10.0) -> list[str]:
        """Ends every process and unlinks the cluster's shared memory; returns what it removed."""
        workers = [p for p in self.procs.values() if p.role != "router"]
        routers = [p for p in self.procs.values() if p.role == "router"]
        # the router first: its autoscaler must not see workers vanish and replace them
        for group in (routers, workers):
            for proc in group:
                with contextlib.suppress(ProcessLookupError):
                    proc.popen.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace
            for proc in group:
                try:
                    proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop in %.0fs; killing it", proc.name, grace)
                    proc.popen.kill()
                    proc.popen.wait()
        for proc in self.procs.values():
            if proc.log:
                proc.log.close()
        self.procs.clear()
        from kvrelay.transport.shm_pool import cleanup_segments

        removed = cleanup_segments(self.segment_prefix)
        if self._reaper is not None:  # nothing left for it to free
            self._reaper.terminate()
            try:
                self._reaper.wait(timeout=grace)
            except subprocess.TimeoutExpired:  # stopped (SIGSTOP) or stuck: never wait on it
                self._reaper.kill()
                self._reaper.wait()
            self._reaper = None
        return removed

    def __enter__(self) -> Launcher:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_up(spec: ClusterSpec, timeout: float = 300.0) -> int:
    """``kvrelay up``: start, print the URL, serve until Ctrl-C / SIGTERM or the router dies."""
    launcher = Launcher(spec)

    def on_signal(signum: int, _frame: Any) -> None:
        launcher.interrupt.set()  # also ends a start that is still waiting for workers

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code, served = 0, False
    try:
        launcher.start(timeout)
        roles = f"{spec.num_prefill} prefill + {spec.num_decode} decode"
        if spec.num_colocated:
            roles = f"{spec.num_colocated} colocated" + (f" + {roles}" if spec.num_prefill else "")
        print(
            f"kvrelay: serving {Path(spec.model).name} ({roles}) at {launcher.url}/v1", flush=True
        )
        served = True
        while not launcher.interrupt.wait(0.2):
            launcher._check_alive()
    except StartInterrupted:
        logger.info("stopping: a signal came before every process was ready")
    except LaunchError as e:
        logger.error("%s", e)
        code = 1
    finally:
        removed = launcher.stop()
        logger.info("stopped; removed %d shared-memory segment(s)", len(removed))
        if served:  # the pool it built or attached outlives it, on purpose
            logger.info(
                "the host's parameter pool stays for the next start (attach in milliseconds "
                "instead of reading the checkpoint): `kvrelay pool ls` shows it, "
                "`kvrelay pool gc --grace 0` frees unused ones"
            )
    return code
