"""A worker's peer sockets: where other workers reach it, and how it reaches them.

Decides how workers message each other (KV hand-off: ``KvReady``, ``KvAck``, ``KvPull``). Each
worker binds one ROUTER socket that peers send to (``--peer-port``, or any free port) and keeps
one DEALER per peer address it sends to, made on first use. Sends never block: a peer that takes
no messages loses them, with a warning, and the hand-off's lease and timeouts clean up.
"""

from __future__ import annotations

import logging
from typing import Any

import zmq

from kvrelay.protocol.messages import encode
from kvrelay.transport.curve import SocketSecurity

logger = logging.getLogger(__name__)


class PeerLinks:
    """The bound peer socket of one worker and its cached links to other workers."""

    def __init__(
        self, ctx: zmq.Context, instance_id: str, host: str, port: int, security: SocketSecurity
    ) -> None:
        self.instance_id = instance_id
        self._ctx = ctx
        self._security = security
        self.socket = ctx.socket(zmq.ROUTER)
        security.server(self.socket)  # only cluster members may pull KV or announce it
        self.socket.setsockopt(zmq.LINGER, 0)
        addr = f"tcp://{host}"
        if port:
            self.socket.bind(f"{addr}:{port}")
            self.port = port
        else:
            self.port = self.socket.bind_to_random_port(addr)
        self._links: dict[str, zmq.Socket] = {}

    def send(self, addr: str, msg: Any) -> None:
        """Sends to another worker's peer socket (one cached DEALER per address)."""
        link = self._links.get(addr)
        if link is None:
            link = self._ctx.socket(zmq.DEALER)
            link.setsockopt(zmq.LINGER, 0)
            link.setsockopt(zmq.SNDHWM, 10000)
            self._security.client(link)
            link.connect(addr)
            self._links[addr] = link
        try:
            link.send(encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            logger.warning(
                "%s: peer %s not taking messages; dropped %s",
                self.instance_id,
                addr,
                type(msg).__name__,
            )

    def reply(self, identity: bytes, msg: Any) -> None:
        """Answers the peer whose message arrived with ``identity``."""
        self.socket.send_multipart([identity, encode(msg)])

    def close(self) -> None:
        for link in self._links.values():
            link.close(0)
        self.socket.close(0)
