"""Who may talk to a kvrelay socket: ZMQ CURVE with the cluster's key pair, checked by ZAP.

Every control, peer and chain socket of a cluster is secured here, one way::

    server socket (router control ROUTER, worker peer ROUTER, chain server ROUTER)
        curve_server + the cluster key pair; a ZAP handler on its context admits a client
        only if it presents the cluster PUBLIC key (so it holds the cluster secret)
    client socket (worker DEALERs to routers and peers, tcp pulls, chain fetches)
        curve_client with the cluster key pair, the server key = the same public key

Every process derives the same key pair from the cluster secret
(``ClusterCredential.curve_keypair``). The server's public key is no secret (any client
learns it), so "any client that completes the handshake" would admit anyone: the ZAP check
against the one cluster key is what keeps out a process without the secret. A client
without CURVE, or with another key, fails the handshake; its messages never reach the
socket's owner. CURVE also encrypts the traffic (KV blocks, prompts, tokens).

``SocketSecurity(None)`` is the operator's explicit opt-out (``--insecure-no-auth``): the
sockets are plain ZMQ, open to anyone who can reach them.

Lifetime: the first ``server()`` on a context starts that context's ZAP thread; the owner
of the context calls ``stop(context)`` before ``context.term()`` (a running ZAP thread holds
a socket, so ``term`` would wait for it forever).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

import zmq
from zmq.auth.thread import ThreadAuthenticator

if TYPE_CHECKING:
    from kvrelay.protocol.credential import ClusterCredential

logger = logging.getLogger(__name__)

ZAP_DOMAIN = "kvrelay"
_LOGGED_DENIALS = frozenset((1, 10, 100))  # then every 1000th: a refused client reconnects


class _ClusterKeyOnly:
    """The ZAP credentials provider: admits exactly the cluster's public key."""

    def __init__(self, public_key: bytes) -> None:
        self._public_key = public_key
        self.num_denied = 0

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self._public_key:
            return True
        self.num_denied += 1
        if self.num_denied in _LOGGED_DENIALS or self.num_denied % 1000 == 0:  # ZMQ retries
            logger.warning(
                "refused a CURVE client with a foreign key (%d so far, domain %s)",
                self.num_denied,
                domain,
            )
        return False


class SocketSecurity:
    """Secures one process's ZMQ sockets; ``credential=None`` leaves them open (opt-out).

    Thread-safe: sockets may be secured from any thread; each socket still belongs to the
    thread that uses it, as ZMQ requires.
    """

    def __init__(self, credential: ClusterCredential | None) -> None:
        self.credential = credential
        self._public = self._secret = b""
        if credential is not None:
            if not zmq.has("curve"):
                raise RuntimeError("this libzmq has no CURVE support; cannot secure sockets")
            self._public, self._secret = credential.curve_keypair()
        self._provider = _ClusterKeyOnly(self._public)
        self._authenticators: dict[int, ThreadAuthenticator] = {}  # per libzmq context
        self._lock = threading.Lock()

    @property
    def is_secure(self) -> bool:
        return self.credential is not None

    @property
    def num_denied(self) -> int:
        """Clients refused by this process's ZAP handlers (a foreign key)."""
        return self._provider.num_denied

    def server(self, socket: zmq.Socket) -> None:
        """Makes ``socket`` (not yet bound) a CURVE server that admits only cluster members."""
        if not self.is_secure:
            return
        self._ensure_zap(socket.context)
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.zap_domain = ZAP_DOMAIN.encode()
        socket.curve_server = True

    def client(self, socket: zmq.Socket) -> None:
        """Makes ``socket`` (not yet connected) a CURVE client holding the cluster keys."""
        if not self.is_secure:
            return
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.curve_serverkey = self._public

    def stop(self, context: zmq.Context | None = None) -> None:
        """Stops the ZAP thread of ``context`` (default: of every context); before ``term``."""
        with self._lock:
            keys = list(self._authenticators) if context is None else [_key(context)]
            for key in keys:
                auth = self._authenticators.pop(key, None)
                if auth is not None:
                    auth.stop()

    def _ensure_zap(self, context: zmq.Context) -> None:
        with self._lock:
            if _key(context) in self._authenticators:
                return
            # a plain (thread) context over the same libzmq context: the ZAP endpoint is
            # per libzmq context, and an asyncio context's sockets cannot run in a thread
            auth = ThreadAuthenticator(zmq.Context.shadow(context.underlying), log=logger)
            auth.start()
            auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self._provider)
            self._authenticators[_key(context)] = auth


def _key(context: zmq.Context) -> int:
    return int(context.underlying)


def describe(security: SocketSecurity) -> str:
    """One log line saying how the sockets are secured (the credential's public id only)."""
    if security.credential is None:
        return "control, peer and chain sockets are OPEN (--insecure-no-auth)"
    return f"control, peer and chain sockets: CURVE, cluster key {security.credential.key_id}"
