"""How the L2 tier reaches Redis: the address, who it is (AUTH / ACL user) and TLS.

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
import urllib.parse
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

HEALTH_CHECK_INTERVAL_S = 30


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
