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

from tests.tls_ca import TestCa

START_TIMEOUT_S = 10.0
STOP_TIMEOUT_S = 5.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class RedisServer:
    """One ``redis-server`` process: no persistence, ``maxmemory`` with ``allkeys-lru``.

    ``password``: ``requirepass`` (and the probe client authenticates with it; with
    ``username``, as that ACL user, defined in ``extra_args``); ``tls``: the
    port speaks TLS only (``TestCa`` files; clients must show a certificate of that CA);
    ``extra_args``: more ``redis-server`` arguments (e.g. ``--user`` ACL rules).
    """

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        maxmemory: str = "64mb",
        password: str | None = None,
        username: str | None = None,
        tls: TestCa | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = workdir
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.maxmemory = maxmemory
        self.password = password
        self.username = username
        self.tls = tls
        self.extra_args = extra_args
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"redis-{self.port}.log"

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def client(self, timeout: float = 5.0) -> redis.Redis:
        """A raw client (bytes in, bytes out) for checking and tampering with what is stored."""
        tls: dict[str, object] = {}
        if self.tls is not None:
            tls = {
                "ssl": True,
                "ssl_ca_certs": str(self.tls.ca_cert),
                "ssl_certfile": str(self.tls.client_cert),
                "ssl_keyfile": str(self.tls.client_key),
            }
        return redis.Redis(
            host=self.host,
            port=self.port,
            username=self.username,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            **tls,  # type: ignore[arg-type]
        )

    def start(self) -> None:
        """Starts the server and waits until it answers PING; raises with its log if not."""
        assert not self.is_running, "already running"
        port = ["--port", str(self.port)]
        if self.tls is not None:
            port = [
                "--port", "0", "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls.server_cert),
                "--tls-key-file", str(self.tls.server_key),
                "--tls-ca-cert-file", str(self.tls.ca_cert),
                "--tls-auth-clients", "yes",
            ]  # fmt: skip
        if self.password is not None and self.username is None:
            port += ["--requirepass", self.password]
        cmd = [
            "redis-server",
            *port,
            "--bind", self.host,
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--maxmemory", self.maxmemory,
            "--maxmemory-policy", "allkeys-lru",
            *self.extra_args,
        ]  # fmt: skip
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        with self.client(timeout=0.5) as probe:
            while True:
                try:
                    if probe.ping():
                        return
                except (redis.ConnectionError, redis.AuthenticationError):
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
