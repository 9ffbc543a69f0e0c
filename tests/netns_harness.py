"""Several "hosts" on one machine: Linux network namespaces on a private bridge.

``Hosts(n)`` makes namespaces ``kvh<run>-<i>``, each with a veth into a bridge in the root
namespace and a private address ``10.<a>.<b>.<i+1>/24``; the root namespace gets ``.254`` on
the bridge, so the test (a client) reaches every host and nothing else is routed. Each host
also has a mount namespace of its own with a private tmpfs on ``/dev/shm``, held by an anchor
process, as a real host has: its processes share shared memory with each other and with no
other host (no pool, L1 or parameter, is shared by accident), and the segments vanish with
the host. A link can
be shaped with ``tc tbf`` (rate, burst, latency; netem is not available on these kernels).
Processes start inside a host with ``host.spawn(argv)``.

Everything made is removed on exit, in reverse order, whatever failed: processes (their
process groups, SIGTERM then SIGKILL), namespaces (which takes their veth ends, and so the
peers), the bridge. ``leftovers()`` lists what a run could leave behind, for the tests' leak
checks. Tests that need it skip, saying why, where namespaces cannot be made (not root, no
``ip``): ``require_netns()``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import pytest

PREFIX = "kvh"


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs iproute2 (ip, tc)"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    probe = f"{PREFIX}probe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def require_netns() -> None:
    reason = netns_unavailable()
    if reason:
        pytest.skip(reason)


def leftovers() -> list[str]:
    """Namespaces and links with this harness's prefix that still exist."""
    spaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    found = [line.split()[0] for line in spaces.splitlines() if line.startswith(PREFIX)]
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(PREFIX):
            found.append(name)
    return found


class Host:
    """One namespace: its name, its address, the processes started in it."""

    def __init__(self, hosts: Hosts, index: int) -> None:
        self.index = index
        self.netns = f"{hosts.run_id}-{index}"
        self.addr = f"{hosts.subnet}.{index + 1}"
        self.veth = f"{hosts.run_id}v{index}"  # the end in the bridge (root namespace)
        self._hosts = hosts
        self.anchor: subprocess.Popen | None = None  # holds the mount namespace

    def start_anchor(self, shm_size: str) -> None:
        """A process whose mount namespace has a private tmpfs on /dev/shm."""
        mount = f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm && exec sleep infinity"
        self.anchor = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "-m", "--propagation", "private",
             "sh", "-c", mount],
            stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        comm = Path(f"/proc/{self.anchor.pid}/comm")
        deadline = time.monotonic() + 10
        while comm.read_text().strip() != "sleep":  # ip, unshare and sh each exec the next
            if self.anchor.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"host {self.netns}: no private /dev/shm")
            time.sleep(0.02)

    def spawn(self, argv: Sequence[str], log: Path, env: dict[str, str] | None = None):
        """Starts ``argv`` inside this host (its own process group), output to ``log``."""
        assert self.anchor is not None
        out: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed by Hosts.close
        popen = subprocess.Popen(
            ["nsenter", "-t", str(self.anchor.pid), "-m", "-n", "--", *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        self._hosts._procs.append((popen, out))
        return popen

    def kvrelay(self, args: Sequence[str], log: Path, env: dict[str, str] | None = None):
        return self.spawn([sys.executable, "-m", "kvrelay", *args], log, env)

    def shape(self, rate: str, burst: str = "256kb", latency: str = "50ms") -> None:
        """Shapes this host's egress (its veth end inside the namespace) with tbf."""
        subprocess.run(
            ["tc", "-n", self.netns, "qdisc", "replace", "dev", "eth0",
             "root", "tbf", "rate", rate, "burst", burst, "latency", latency],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip


class Hosts:
    """``n`` hosts on one bridge; a context manager that always cleans up."""

    def __init__(self, n: int, shm_size: str = "2g") -> None:
        self.shm_size = shm_size
        self.run_id = f"{PREFIX}{secrets.token_hex(3)}"  # 9 chars: names fit IFNAMSIZ (15)
        self.subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"{self.run_id}br"
        self.root_addr = f"{self.subnet}.254"
        self.hosts = [Host(self, i) for i in range(n)]
        self._procs: list[tuple[subprocess.Popen, IO[bytes]]] = []

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getitem__(self, index: int) -> Host:
        return self.hosts[index]

    def _create(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.root_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for host in self.hosts:
            subprocess.run(["ip", "netns", "add", host.netns], check=True, capture_output=True)
            _ip(
                "link",
                "add",
                host.veth,
                "type",
                "veth",
                "peer",
                "name",
                "eth0",
                "netns",
                host.netns,
            )
            _ip("link", "set", host.veth, "master", self.bridge)
            _ip("link", "set", host.veth, "up")
            _ip("addr", "add", f"{host.addr}/24", "dev", "eth0", netns=host.netns)
            _ip("link", "set", "eth0", "up", netns=host.netns)
            _ip("link", "set", "lo", "up", netns=host.netns)
            host.start_anchor(self.shm_size)

    def stop_process(self, popen: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, sig)
        try:
            popen.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=15)

    def close(self) -> None:
        for popen, out in reversed(self._procs):
            if popen.poll() is None:
                self.stop_process(popen)
            out.close()
        self._procs.clear()
        for host in reversed(self.hosts):
            if host.anchor is not None:  # the last process of the mount namespace: its
                self.stop_process(host.anchor)  # /dev/shm and every segment in it go too
                host.anchor = None
            # the root end first: a deleted namespace frees its devices asynchronously
            subprocess.run(["ip", "link", "del", host.veth], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@contextlib.contextmanager
def hosts(n: int) -> Iterator[Hosts]:
    with Hosts(n) as made:
        yield made


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f}s"
        time.sleep(0.2)
