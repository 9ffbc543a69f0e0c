"""The serving end of a chain transfer: one object from a buffer that may still be filling.

Decides when a requested chunk goes out: at once if it is available, else held (with a ``W``
heartbeat every ``HEARTBEAT_S``) until ``mark_available`` covers it, and, when paced, no
faster than the link rate.

A server may pace its chunks to a link rate (``link_bytes_per_s``, a ``TokenBucket`` shared
by all its receivers, as one NIC is): chunks wait in a FIFO, and the next one's tokens are
taken only once the previous one went out, so however late the server thread runs, chunk
``k`` leaves at least ``bytes(k) / rate`` after chunk ``k - 1``. Paced chunks count as held
for heartbeats. This is how one machine models hosts whose links, not CPUs, are the limit.
"""

from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import logging
import math
import os
import threading
import time
from typing import TYPE_CHECKING, NamedTuple

import msgpack
import zmq

from kvrelay.transport.chain_wire import (
    HEARTBEAT_S,
    MSG_CHUNK,
    MSG_ERROR,
    MSG_META,
    MSG_WAIT,
    U64,
    ChainMeta,
    byte_view,
)
from kvrelay.transport.curve import SocketSecurity
from kvrelay.transport.rate_limit import TokenBucket

if TYPE_CHECKING:
    from kvrelay.transport.chain_wire import BufferLike

logger = logging.getLogger(__name__)


class ServerStats(NamedTuple):
    num_chunks_served: int
    num_bytes_served: int
    available_at_first_serve: int | None
    """Chunks this server had when it first sent one: below ``num_chunks`` = it forwarded."""


class ChainServer:
    """Serves one object from ``buffer`` on a ROUTER socket, in a background thread.

    ``buffer`` (``total_bytes`` contiguous bytes) is read, never written, and must stay
    mapped until ``close()`` returns: chunks are sent zero-copy. A chunk is served only once
    it is marked available; chunks ``< num_available`` must not change after that. With
    ``link_bytes_per_s > 0`` chunk data leaves at most that fast (0: as fast as it can).
    ``mark_available`` may be called from any one thread; everything else is internal to
    the server thread. ``addr`` is the bound endpoint with the real port. ``security``
    decides who may fetch (``SocketSecurity``: CURVE clients with the cluster key).
    """

    def __init__(
        self,
        buffer: BufferLike,
        meta: ChainMeta,
        bind: str = "tcp://127.0.0.1:0",
        *,
        complete: bool = False,
        link_bytes_per_s: float = 0.0,
        security: SocketSecurity,
    ) -> None:
        if link_bytes_per_s < 0:
            raise ValueError(f"link_bytes_per_s must be >= 0 (0: off), got {link_bytes_per_s}")
        self.meta = meta
        self._view = byte_view(buffer, meta.total_bytes, writable=False)
        self._meta_reply = msgpack.packb(
            [meta.name, meta.header, meta.total_bytes, meta.chunk_bytes, list(meta.checksums)]
        )
        self._num_available = meta.num_chunks if complete else 0
        self._held: list[tuple[int, int, bytes]] = []  # heap of (chunk, arrival, identity)
        self._arrivals = itertools.count()  # tie-break: same chunk, first asked first served
        self._num_served = self._bytes_served = 0
        self._link = TokenBucket(link_bytes_per_s) if link_bytes_per_s else None
        self._paced: collections.deque[tuple[bytes, int, memoryview]] = collections.deque()
        self._paced_ready: float | None = None  # when the head of _paced may go (tokens taken)
        self._available_at_first_serve: int | None = None
        self._context = zmq.Context()
        self._security = security
        self._socket = self._context.socket(zmq.ROUTER)
        security.server(self._socket)  # only cluster members may fetch the weights
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError:
            self._socket.close()
            security.stop(self._context)
            self._context.term()
            raise
        self.addr: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._is_closing = self._is_closed = False
        self._thread = threading.Thread(target=self._run, name=f"chain-server {self.addr}")
        self._thread.daemon = True
        self._thread.start()

    @property
    def num_available(self) -> int:
        return self._num_available

    def mark_available(self, num_chunks: int) -> None:
        """Chunks ``[0, num_chunks)`` are complete and final; held requests for them go out."""
        if not 0 <= num_chunks <= self.meta.num_chunks:
            raise ValueError(f"num_chunks {num_chunks} outside [0, {self.meta.num_chunks}]")
        if num_chunks > self._num_available:
            self._num_available = num_chunks  # one int store: atomic under the GIL
            self._wake()

    def stats(self) -> ServerStats:
        return ServerStats(self._num_served, self._bytes_served, self._available_at_first_serve)

    def close(self) -> None:
        """Stops the thread and releases the socket; may be called more than once."""
        if self._is_closed:
            return
        self._is_closing = True
        self._wake()
        self._thread.join(timeout=5)
        if self._thread.is_alive():
            logger.error("chain server %s did not stop within 5s", self.addr)
            return
        self._is_closed = True
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._security.stop(self._context)
        self._context.term()

    def __enter__(self) -> ChainServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe: a wake-up is pending anyway
            os.write(self._wake_w, b"\0")

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_beat = time.monotonic() + HEARTBEAT_S
        try:
            while not self._is_closing:
                deadline = next_beat if self._paced_ready is None else self._paced_ready
                wait_ms = max(0, math.ceil((min(next_beat, deadline) - time.monotonic()) * 1000))
                events = dict(poller.poll(wait_ms))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                if self._socket in events:
                    self._drain_requests()
                self._serve_held()
                self._release_paced()
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + HEARTBEAT_S
        finally:
            self._socket.close(linger=0)

    def _drain_requests(self) -> None:
        for _ in range(1000):  # bounded, so held chunks and heartbeats are not starved
            try:
                parts = self._socket.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, request = parts[0], parts[1:]
            if request == [MSG_META]:
                self._send([identity, MSG_META, self._meta_reply])
            elif len(request) == 2 and request[0] == MSG_CHUNK and len(request[1]) == U64.size:
                self._on_chunk_request(identity, U64.unpack(request[1])[0])
            else:
                self._send([identity, MSG_ERROR, b"malformed request"])

    def _on_chunk_request(self, identity: bytes, index: int) -> None:
        if index >= self.meta.num_chunks:
            self._send([identity, MSG_ERROR, f"no chunk {index}".encode()])
        elif index < self._num_available:
            self._send_chunk(identity, index)
        else:
            heapq.heappush(self._held, (index, next(self._arrivals), identity))

    def _serve_held(self) -> None:
        while self._held and self._held[0][0] < self._num_available:
            index, _, identity = heapq.heappop(self._held)
            self._send_chunk(identity, index)

    def _heartbeat(self) -> None:
        have = U64.pack(self._num_available)
        waiting = {identity for _, _, identity in self._held}
        for identity in waiting | {identity for identity, _, _ in self._paced}:
            self._send([identity, MSG_WAIT, have])

    def _send_chunk(self, identity: bytes, index: int) -> None:
        if self._available_at_first_serve is None:
            self._available_at_first_serve = self._num_available
        payload = self._payload(index)
        if self._link is None:
            self._put_chunk(identity, index, payload)
        else:
            self._paced.append((identity, index, payload))
            self._release_paced()

    def _release_paced(self) -> None:
        """Sends paced chunks whose time has come; takes the next one's tokens after each."""
        while self._paced:
            if self._paced_ready is None:
                assert self._link is not None
                self._paced_ready = self._link.reserve(len(self._paced[0][2]))
            if time.monotonic() < self._paced_ready:
                return
            self._paced_ready = None
            self._put_chunk(*self._paced.popleft())

    def _put_chunk(self, identity: bytes, index: int, payload: memoryview) -> None:
        self._send([identity, MSG_CHUNK, U64.pack(index), payload])
        self._num_served += 1
        self._bytes_served += len(payload)

    def _payload(self, index: int) -> memoryview:
        start, stop = self.meta.chunk_span(index)
        return self._view[start:stop]

    def _send(self, parts: list) -> None:
        try:
            self._socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:  # a full or gone peer: it times out and fails over
            logger.warning("chain server %s could not queue a reply: %s", self.addr, e)
