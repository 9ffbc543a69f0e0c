"""``kvrelay secret`` and the cluster credential of the commands that open cluster sockets.

Decides, for ``serve`` and ``pool serve/fetch``, how a process gets its ``SocketSecurity``:
the cluster secret (``--cluster-secret-file``, ``KVRELAY_CLUSTER_SECRET_FILE``,
``KVRELAY_CLUSTER_SECRET``), or the explicit opt-out ``--insecure-no-auth``, loudly logged;
with neither, the command refuses to start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from kvrelay import envs
from kvrelay.protocol.credential import ClusterCredential, CredentialError

logger = logging.getLogger(__name__)

NO_SECRET = (
    "no cluster secret: make one with `kvrelay secret --out cluster.key` and pass "
    "--cluster-secret-file cluster.key (or KVRELAY_CLUSTER_SECRET_FILE) to every process of "
    "the cluster; or, on a trusted isolated network only, --insecure-no-auth"
)


def add_secret_parser(sub: Any) -> None:
    secret = sub.add_parser(
        "secret", help="make a new cluster secret (64 hex digits) for --cluster-secret-file"
    )
    secret.add_argument(
        "--out", default=None, help="write it to this new file (mode 0600) instead of stdout"
    )


def add_auth_options(p: argparse.ArgumentParser) -> None:
    """``--cluster-secret-file`` and ``--insecure-no-auth`` (each also from its variable)."""
    envs.add_option(p, "KVRELAY_CLUSTER_SECRET_FILE")
    envs.add_option(p, "KVRELAY_INSECURE_NO_AUTH")


def cmd_secret(args: argparse.Namespace) -> int:
    text = ClusterCredential.generate().hex() + "\n"
    if args.out is None:
        sys.stdout.write(text)
        return 0
    parent = os.path.dirname(args.out)
    try:
        if parent:
            os.makedirs(parent, mode=0o700, exist_ok=True)
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ValueError(f"cannot create {args.out}: {e}") from None
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return 0


def load_credential(args: argparse.Namespace, what: str) -> ClusterCredential | None:
    """The credential ``args`` and the environment name; None with ``--insecure-no-auth``
    (after a warning naming what ``what`` leaves open). Raises ValueError with neither, with
    both, or for an unreadable or malformed secret."""
    insecure = args.insecure_no_auth
    if insecure is None:
        insecure = envs.get("KVRELAY_INSECURE_NO_AUTH")
    try:
        credential = ClusterCredential.load(args.cluster_secret_file or None)
    except CredentialError as e:
        raise ValueError(str(e)) from None
    if credential is not None and insecure:
        raise ValueError("both a cluster secret and --insecure-no-auth: choose one")
    if credential is None and not insecure:
        raise ValueError(NO_SECRET)
    if credential is None:
        logger.warning(
            "--insecure-no-auth: %s take(s) ANY connection, unauthenticated and unencrypted: "
            "whoever reaches them can join the cluster, read prompts and KV, and inject tokens",
            what,
        )
    return credential
