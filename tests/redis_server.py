"""A real ``redis-server`` for tests: a free port, a temp dir, stop and restart on that port.

Use the ``redis_server`` fixture (a factory: ``server = redis_server()``); every server it
started is stopped when the test ends. The test is skipped, with the reason, where
``redis-server`` is not installed (``apt-get install -y redis-server``).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process: no persistence, ``maxmemory`` with ``allkeys-lru``."""

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: str = "64mb") -> None:
        self.workdir = workdir
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.maxmemory = maxmemory
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A raw client (bytes in, bytes out) for checking and tampering with what is stored."""
        return redis.Redis(
            host=self.host, port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def start(self) -> None:
        """Starts the server and waits until it answers PING; raises with its log if not."""
        assert not self.is_running, "already running"
        cmd = [
            "redis-server",
            "--port", str(self.port),
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client(timeout=0.5) as probe:
            while True:
                try:
                    if probe.ping():
                        return
                except redis.ConnectionError:
                    pass
                if not self.is_running or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(
                        f"redis-server on port {self.port} did not answer PING; log:\n"
                        + self.log_path.read_text(errors="replace")[-2000:]
                    )
                time.sleep(0.02)

    def stop(self, kill: bool = False) -> None:
        """SIGTERM (SIGKILL with ``kill``, or when SIGTERM is not enough) and wait."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def restart(self) -> None:
        """Stops the server and starts an empty one on the same port."""
        self.stop()
        self.start()


@pytest.fixture
def redis_server() -> Iterator[Callable[..., RedisServer]]:
    """Factory of started ``RedisServer``s (keyword args as ``RedisServer``); all stopped after."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    servers: list[RedisServer] = []
    with tempfile.TemporaryDirectory(prefix="kvrelay-redis-") as workdir:

        def start(**options: object) -> RedisServer:
            server = RedisServer(Path(workdir), **options)  # type: ignore[arg-type]
            server.start()
            servers.append(server)
            return server

        yield start
        for server in servers:
            server.stop()
