"""How the L2 tier reaches Redis: the address, who it is (AUTH / ACL user), TLS, and the
circuit breaker that decides when to try a Redis that failed (``CircuitBreaker``).

``redis://[user[:password]@]host:port/db`` names the server; ``rediss://`` is the same over
TLS; ``unix:///path?db=0`` a local socket. A secured Redis is reached with::

    url            rediss://kvrelay@redis:6380/0      ACL user in the URL, password elsewhere
    password_file  /run/secrets/redis-password        first line; wins over a URL password
    ca_file        /etc/kvrelay/redis-ca.pem           verifies the server (rediss:// only)
    cert_file      /etc/kvrelay/redis-client.pem       client certificate, when Redis asks
    key_file       /etc/kvrelay/redis-client.key       (``tls-auth-clients yes``)

With ``rediss://`` the server's certificate is always verified (against ``ca_file``, else
the system's CAs) and its host name checked; a certificate option with ``redis://`` is an
error, not a silent plaintext connection.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger("kvrelay.cachetier.redis_tier")  # one logger for the tier's lines

HEALTH_CHECK_INTERVAL_S = 30
BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 10.0
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")


@dataclasses.dataclass(frozen=True, slots=True)
class RedisEndpoint:
    """Where the L2 tier's Redis is and how to authenticate to it (see the module doc)."""

    url: str  # redis:// | rediss:// | unix://
    password_file: str = ""  # AUTH password (first line of the file); "" for none / the URL's
    ca_file: str = ""  # PEM CA bundle that signed the server's certificate (rediss://)
    cert_file: str = ""  # PEM client certificate (rediss://, when the server wants one)
    key_file: str = ""  # PEM key of ``cert_file``

    def __post_init__(self) -> None:
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis url must be redis://, rediss:// or unix://, got {scheme!r}")
        tls_files = {"ca_file": self.ca_file, "cert_file": self.cert_file}
        tls_files["key_file"] = self.key_file
        given = [name for name, path in tls_files.items() if path]
        if given and scheme != "rediss":
            raise ValueError(f"redis {', '.join(given)} need a rediss:// (TLS) url")
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("redis cert_file and key_file go together")
        for name, path in (*tls_files.items(), ("password_file", self.password_file)):
            if path and not Path(path).is_file():
                raise ValueError(f"redis {name}: no such file {path}")

    @property
    def is_tls(self) -> bool:
        return self.url.startswith("rediss://")

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis.from_url`` beyond the URL itself."""
        out: dict[str, Any] = {}
        if self.password_file:
            out["password"] = read_password(self.password_file)
        if self.is_tls:
            out["ssl_cert_reqs"] = "required"
            out["ssl_check_hostname"] = True
            if self.ca_file:
                out["ssl_ca_certs"] = self.ca_file
            if self.cert_file:
                out.update(ssl_certfile=self.cert_file, ssl_keyfile=self.key_file)
        return out


def read_password(path: str) -> str:
    """The first line of ``path``, stripped; ValueError for an empty file."""
    lines = Path(path).read_text().splitlines()
    password = lines[0].strip() if lines else ""
    if not password:
        raise ValueError(f"redis password file {path} is empty")
    return password


def create_client(endpoint: RedisEndpoint, timeout: float) -> redis.Redis:
    """A client whose every call is bounded by ``timeout`` and never retried (the tier's
    breaker decides when to try again)."""
    return redis.Redis.from_url(
        endpoint.url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(NoBackoff(), 0),
        **endpoint.client_options(),
    )


def redact_url(url: str) -> str:
    """``url`` with its password (in the authority or a ``password=`` query) shown as ``***``."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        host = parts.netloc.rpartition("@")[2]
        url = url.replace(parts.netloc, f"{parts.username or ''}:***@{host}", 1)
    return _QUERY_PASSWORD.sub(r"\1***", url)


class CircuitBreaker:
    """Closed / open / half-open state of one remote, shared by the loop and writer threads."""

    def __init__(self, label: str) -> None:
        self._label = label
        self._lock = threading.Lock()
        self._open_until = 0.0
        self._backoff = 0.0
        self._num_failures = 0  # in the current outage
        self.is_available = True

    def allows(self) -> bool:
        """Whether a call may try the remote now (closed, or open with the backoff elapsed)."""
        return time.monotonic() >= self._open_until

    def record_success(self) -> None:
        with self._lock:
            if not self.is_available:
                logger.info(
                    "redis tier %s is back after %d failed calls", self._label, self._num_failures
                )
            self.is_available = True
            self._open_until = 0.0
            self._backoff = 0.0
            self._num_failures = 0

    def record_failure(self, op: str, exc: BaseException) -> None:
        with self._lock:
            self._backoff = min(max(2 * self._backoff, BACKOFF_MIN_S), BACKOFF_MAX_S)
            self._open_until = time.monotonic() + self._backoff
            self._num_failures += 1
            if self.is_available:
                logger.warning(
                    "redis tier %s unavailable (%s: %s: %s); reads miss and writes drop until "
                    "it answers (retry after %.1f s, backoff up to %.0f s)",
                    self._label,
                    op,
                    type(exc).__name__,
                    exc,
                    self._backoff,
                    BACKOFF_MAX_S,
                )
            self.is_available = False
