"""The cluster credential: one secret every kvrelay process of a cluster holds.

Everything that needs a key derives its own from the secret, by purpose, so no two uses
share a key and a key for one use reveals nothing about the others::

    secret (32 random bytes, hex in a file or a variable)
      |- derive_key("zmq-curve")   -> the CURVE key pair of every control / peer / chain socket
      |- derive_key("l2-mac")      -> the MAC key of blocks written to the global tier (Redis)
      `- derive_key("l2-aead")     -> the AEAD key of blocks encrypted for the global tier

Derivation is keyed BLAKE2b (``key=secret``, ``person`` = the purpose), the construction
BLAKE2 defines for keyed hashing; a purpose is at most 16 bytes.

The secret comes from, in order: ``--cluster-secret-file`` (or ``KVRELAY_CLUSTER_SECRET_FILE``),
then ``KVRELAY_CLUSTER_SECRET``. ``kvrelay up`` generates one per cluster and hands it to the
processes it starts through the environment. Without one, a process refuses to start unless
the operator opted out (``--insecure-no-auth``, for a trusted network only), and then says so
loudly in its log.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

SECRET_BYTES = 32
ENV_SECRET = "KVRELAY_CLUSTER_SECRET"
ENV_SECRET_FILE = "KVRELAY_CLUSTER_SECRET_FILE"


class CredentialError(ValueError):
    """A cluster secret that is missing, unreadable or malformed."""


@dataclasses.dataclass(frozen=True, slots=True, repr=False)
class ClusterCredential:
    """The cluster's shared secret; ``repr`` never shows it."""

    secret: bytes

    def __post_init__(self) -> None:
        if len(self.secret) != SECRET_BYTES:
            raise CredentialError(
                f"a cluster secret is {SECRET_BYTES} bytes ({2 * SECRET_BYTES} hex digits), "
                f"got {len(self.secret)}"
            )

    def __repr__(self) -> str:
        return f"ClusterCredential(id={self.key_id})"

    @classmethod
    def generate(cls) -> ClusterCredential:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, where: str = "the cluster secret") -> ClusterCredential:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise CredentialError(
                f"{where}: expected {2 * SECRET_BYTES} hex digits (`kvrelay secret` makes one)"
            ) from None

    @classmethod
    def from_file(cls, path: str | Path) -> ClusterCredential:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise CredentialError(f"cannot read the cluster secret file {path}: {e}") from None
        return cls.from_hex(text, str(path))

    @classmethod
    def load(cls, path: str | Path | None = None) -> ClusterCredential | None:
        """From ``path``, else ``KVRELAY_CLUSTER_SECRET_FILE``, else ``KVRELAY_CLUSTER_SECRET``;
        None when none is set (the caller decides whether that is allowed)."""
        path = path or os.environ.get(ENV_SECRET_FILE) or None
        if path:
            return cls.from_file(path)
        text = os.environ.get(ENV_SECRET, "")
        return cls.from_hex(text, ENV_SECRET) if text.strip() else None

    def hex(self) -> str:
        return self.secret.hex()

    @property
    def key_id(self) -> str:
        """A short public name of the secret (safe to log): which credential, not what."""
        return self.derive_key("key-id", 6).hex()

    def derive_key(self, purpose: str, size: int = 32) -> bytes:
        """A key for one ``purpose`` (at most 16 bytes of UTF-8), ``size`` bytes (<= 64)."""
        person = purpose.encode()
        if not 0 < len(person) <= 16:
            raise ValueError(f"purpose {purpose!r}: 1 to 16 bytes")
        return hashlib.blake2b(b"", digest_size=size, key=self.secret, person=person).digest()

    def curve_keypair(self) -> tuple[bytes, bytes]:
        """(public, secret) Z85-encoded CURVE keys every socket of the cluster uses.

        All processes share one key pair: holding the secret is what admits a process, so a
        server accepts exactly the clients whose public key is this one (a ZAP check).
        """
        import zmq
        from zmq.utils import z85

        secret_key = z85.encode(self.derive_key("zmq-curve"))
        return zmq.curve_public(secret_key), secret_key


ENV_INSECURE = "KVRELAY_INSECURE_NO_AUTH"


def child_environ(
    credential: ClusterCredential | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """``environ`` for a cluster process this one starts: the secret in
    ``KVRELAY_CLUSTER_SECRET`` (the environment, never argv, which any local user can read in
    /proc), or, with ``credential=None``, the explicit opt-out ``KVRELAY_INSECURE_NO_AUTH=1``."""
    out = {k: v for k, v in environ.items() if k not in (ENV_SECRET, ENV_SECRET_FILE, ENV_INSECURE)}
    if credential is None:
        out[ENV_INSECURE] = "1"
    else:
        out[ENV_SECRET] = credential.hex()
    return out
