"""The receiving end of a chain transfer: pull one object, failing over down a source list.

Decides which source a receiver pulls from and when it gives one up: the first-listed source
that answers the meta request, until it is silent, stalls or sends bad chunks; then the next
one, resuming from the first missing chunk.

A held request gets a ``W`` heartbeat every ``HEARTBEAT_S``: a hop that is stalled because
*its* source died keeps its receivers waiting while it fails over, so every failure is
handled once, at the hop where it happened. A receiver that hears nothing for ``timeout``
seconds, or gets bad chunks from the same source ``MAX_BAD_CHUNKS`` times, moves to the next
source in its list and resumes from its first missing chunk; so does one that delivers no new
chunk for ``STALL_TIMEOUTS`` timeouts, heartbeats or not, so no wait is unbounded. When no
source is left it raises ``ChainError``; the caller then loads from disk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgpack
import xxhash
import zmq

from kvrelay.transport.chain_server import ChainServer
from kvrelay.transport.chain_wire import (
    HEARTBEAT_S,
    MSG_CHUNK,
    MSG_ERROR,
    MSG_META,
    MSG_WAIT,
    U64,
    ChainError,
    ChainMeta,
    byte_view,
)
from kvrelay.transport.curve import SocketSecurity

if TYPE_CHECKING:
    from kvrelay.transport.chain_wire import BufferLike

logger = logging.getLogger(__name__)

MAX_BAD_CHUNKS = 3  # bad chunks one source may send before the receiver moves on
STALL_TIMEOUTS = 4  # timeouts without a new chunk, heartbeats or not, before moving on


class _SourceFailed(Exception):
    """The current source is dead, silent, refusing or corrupt: move to the next one."""


class FetchResult(NamedTuple):
    meta: ChainMeta
    server: ChainServer | None
    """The receiver's own server (``forward=True``), still serving; the caller closes it."""
    num_bytes: int
    seconds: float
    num_retries: int
    """Chunk requests sent more than once (bad checksum, or in flight when a source failed)."""
    sources_used: tuple[str, ...]
    """Sources pulled from, in order: more than one means a failover happened."""
    num_chunks_per_source: tuple[int, ...]
    """Verified chunks each of ``sources_used`` delivered."""


def fetch(
    sources: Sequence[str],
    make_buffer: Callable[[ChainMeta], BufferLike],
    *,
    forward: bool = True,
    timeout: float = 10.0,
    window: int = 4,
    bind: str = "tcp://127.0.0.1:0",
    on_serving: Callable[[ChainServer], None] | None = None,
    link_bytes_per_s: float = 0.0,
    security: SocketSecurity,
) -> FetchResult:
    """Pulls one object from the first source that answers, failing over down ``sources``.

    Args:
        sources: addresses in order of preference: in a chain, the previous hop, the hop
            before it, ..., the origin (``plan_chain``).
        make_buffer: allocates the destination (``meta.total_bytes`` writable contiguous
            bytes); called once, after the meta arrived. The caller owns it.
        forward: also serve the destination on ``bind`` while it fills, for the next hop.
        timeout: seconds of silence after which a source counts as dead; the first meta
            request waits this long in all (sources are asked at once, the first preferred).
        window: chunk requests in flight at once.
        on_serving: called with the new server before the first chunk is requested, e.g. to
            publish its ``addr`` to the next hop.
        link_bytes_per_s: the forwarding server's link rate (``ChainServer``; 0: unlimited).
        security: how the sources' and the forwarding server's sockets authenticate.

    Raises:
        ValueError: a malformed address, or a buffer of the wrong size.
        ChainError: no source delivered (the destination holds nothing valid; the server
            started here, if any, is closed). The caller loads from disk instead.
    """
    if timeout < 2 * HEARTBEAT_S or window < 1:
        raise ValueError(f"need timeout >= {2 * HEARTBEAT_S}s and window >= 1: {timeout}, {window}")
    context = zmq.Context()
    try:
        return _Fetch(list(sources), context, timeout, window, security).run(
            make_buffer, bind if forward else None, on_serving, link_bytes_per_s
        )
    finally:
        context.term()


class _Fetch:
    """One fetch's state: the destination, which chunks landed, the failover position."""

    def __init__(
        self,
        sources: list[str],
        context: zmq.Context,
        timeout: float,
        window: int,
        security: SocketSecurity,
    ):
        self._sources, self._context, self._security = sources, context, security
        self._timeout, self._window = timeout, window
        self._num_retries = 0
        self._sources_used: list[str] = []
        self._num_chunks_per_source: list[int] = []
        self._server: ChainServer | None = None
        self._in_flight: set[int] = set()  # chunk requests sent to the current source

    def run(
        self,
        make_buffer: Callable[[ChainMeta], BufferLike],
        bind: str | None,
        on_serving: Callable[[ChainServer], None] | None,
        link_bytes_per_s: float,
    ) -> FetchResult:
        start = time.perf_counter()
        found = _probe(self._context, self._security, self._sources, self._timeout, None)
        if found is None:
            raise ChainError(f"no source answered within {self._timeout:g}s: {self._sources}")
        position, self._meta, socket = found
        try:
            self._view = byte_view(make_buffer(self._meta), self._meta.total_bytes, writable=True)
            self._done = bytearray(self._meta.num_chunks)
            self._num_complete = 0  # leading chunks landed and verified
            if bind is not None:
                self._server = ChainServer(
                    self._view,
                    self._meta,
                    bind,
                    link_bytes_per_s=link_bytes_per_s,
                    security=self._security,
                )
                if on_serving is not None:
                    on_serving(self._server)
            self._pull_all(position, socket)
        except BaseException:
            socket.close(linger=0)
            if self._server is not None:
                self._server.close()
            raise
        seconds = time.perf_counter() - start
        return FetchResult(
            self._meta,
            self._server,
            self._meta.total_bytes,
            seconds,
            self._num_retries,
            tuple(self._sources_used),
            tuple(self._num_chunks_per_source),
        )

    def _pull_all(self, position: int, socket: zmq.Socket) -> None:
        while True:
            addr = self._sources[position]
            self._sources_used.append(addr)
            self._num_chunks_per_source.append(0)
            try:
                self._pull(socket, addr)
                return
            except _SourceFailed as e:
                self._num_retries += len(self._in_flight)  # each will be asked again
                logger.warning(
                    "chain source %s failed at chunk %d: %s", addr, self._num_complete, e
                )
            finally:
                socket.close(linger=0)
            rest = self._sources[position + 1 :]
            found = _probe(self._context, self._security, rest, self._timeout, self._meta)
            if found is None:
                raise ChainError(f"{self._meta.name}: every source failed: {self._sources}")
            offset, _, socket = found
            position += 1 + offset

    def _pull(self, socket: zmq.Socket, addr: str) -> None:
        """Pulls every missing chunk from one source, ``window`` requests in flight."""
        num_chunks = self._meta.num_chunks
        in_flight: set[int] = set()
        self._in_flight = in_flight
        num_bad = 0
        next_index = self._num_complete
        stall_deadline = time.monotonic() + STALL_TIMEOUTS * self._timeout
        while self._num_complete < num_chunks:
            while len(in_flight) < self._window and next_index < num_chunks:
                if not self._done[next_index]:
                    _request_chunk(socket, next_index)
                    in_flight.add(next_index)
                next_index += 1
            wait = min(self._timeout, stall_deadline - time.monotonic())
            if wait <= 0 or not socket.poll(int(wait * 1000), zmq.POLLIN):
                raise _SourceFailed(f"silent for {self._timeout:g}s or stalled")
            index = self._receive(socket, in_flight)
            if index is None:
                continue
            if self._verify(index):
                stall_deadline = time.monotonic() + STALL_TIMEOUTS * self._timeout
            else:
                num_bad += 1
                self._num_retries += 1
                if num_bad >= MAX_BAD_CHUNKS:
                    raise _SourceFailed(f"{num_bad} chunks failed their checksum")
                logger.warning("chunk %d from %s failed its checksum; re-requesting", index, addr)
                _request_chunk(socket, index)
                in_flight.add(index)

    def _receive(self, socket: zmq.Socket, in_flight: set[int]) -> int | None:
        """Reads one reply; returns the chunk index it wrote into the destination, if any."""
        kind = socket.recv()
        if kind == MSG_WAIT:
            _drain(socket)
            return None
        if kind != MSG_CHUNK or not socket.getsockopt(zmq.RCVMORE):
            reason = _drain(socket)
            raise _SourceFailed(
                f"refused: {reason!r}" if kind == MSG_ERROR else f"bad reply {kind!r}"
            )
        index_bytes = socket.recv()
        index = U64.unpack(index_bytes)[0] if len(index_bytes) == U64.size else -1
        if index not in in_flight or not socket.getsockopt(zmq.RCVMORE):
            _drain(socket)  # a duplicate or stray chunk: never write over a landed one
            return None
        start, stop = self._meta.chunk_span(index)
        num_received = socket.recv_into(self._view[start:stop])
        if num_received != stop - start or socket.getsockopt(zmq.RCVMORE):
            _drain(socket)
            raise _SourceFailed(f"chunk {index}: {num_received} bytes, expected {stop - start}")
        in_flight.remove(index)
        return index

    def _verify(self, index: int) -> bool:
        """Checks a landed chunk; on success advances the complete prefix (and the server)."""
        start, stop = self._meta.chunk_span(index)
        if xxhash.xxh3_64_intdigest(self._view[start:stop]) != self._meta.checksums[index]:
            return False
        self._done[index] = 1
        self._num_chunks_per_source[-1] += 1
        num_chunks = self._meta.num_chunks
        while self._num_complete < num_chunks and self._done[self._num_complete]:
            self._num_complete += 1
        if self._server is not None:
            self._server.mark_available(self._num_complete)
        return True


def _probe(
    context: zmq.Context,
    security: SocketSecurity,
    addrs: list[str],
    timeout: float,
    expected: ChainMeta | None,
) -> tuple[int, ChainMeta, zmq.Socket] | None:
    """Asks every address for the meta at once; returns the first-listed that answered.

    Waits up to ``timeout`` for an answer from the first address not yet ruled out (no answer,
    a malformed one, or one that differs from ``expected``). Returns ``(position, meta,
    socket)``, the socket connected to that source; every other socket is closed.
    """
    sockets: list[zmq.Socket] = []
    chosen: int | None = None
    try:
        for addr in addrs:
            sockets.append(_dealer(context, security, addr))
            sockets[-1].send(MSG_META, flags=zmq.NOBLOCK)  # queued until connected
        answers = _collect_metas(sockets, addrs, time.monotonic() + timeout, expected)
        chosen = min(answers, default=None)
        return None if chosen is None else (chosen, answers[chosen], sockets[chosen])
    finally:
        for position, socket in enumerate(sockets):
            if position != chosen:
                socket.close(linger=0)


def _collect_metas(
    sockets: list[zmq.Socket], addrs: list[str], deadline: float, expected: ChainMeta | None
) -> dict[int, ChainMeta]:
    """Good meta answers by position, gathered until the first one not ruled out answered."""
    answers: dict[int, ChainMeta] = {}
    ruled_out: set[int] = set()
    poller = zmq.Poller()
    for socket in sockets:
        poller.register(socket, zmq.POLLIN)
    while not _has_preferred(len(sockets), answers, ruled_out):
        wait_ms = int((deadline - time.monotonic()) * 1000)
        if wait_ms <= 0:
            break
        for socket, _ in poller.poll(wait_ms):
            position = sockets.index(socket)
            poller.unregister(socket)
            meta = _read_meta(socket, addrs[position])
            if meta is None or (expected is not None and meta != expected):
                ruled_out.add(position)
            else:
                answers[position] = meta
    return answers


def _has_preferred(num_addrs: int, answers: dict[int, ChainMeta], ruled_out: set[int]) -> bool:
    """True once nothing listed before the best answer may still answer (or all are out)."""
    for position in range(num_addrs):
        if position in answers:
            return True
        if position not in ruled_out:
            return False
    return True


def _read_meta(socket: zmq.Socket, addr: str) -> ChainMeta | None:
    parts = socket.recv_multipart()
    if len(parts) != 2 or parts[0] != MSG_META:
        logger.warning("bad meta reply from %s: %r", addr, parts[:1])
        return None
    try:
        name, header, total_bytes, chunk_bytes, checksums = msgpack.unpackb(parts[1])
        return ChainMeta(name, header, total_bytes, chunk_bytes, checksums)
    except (ValueError, TypeError) as e:
        logger.warning("malformed meta from %s: %s", addr, e)
        return None


def _dealer(context: zmq.Context, security: SocketSecurity, addr: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    security.client(socket)
    try:
        socket.connect(addr)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise ValueError(f"bad source address {addr!r}: {e}") from e
    return socket


def _request_chunk(socket: zmq.Socket, index: int) -> None:
    try:
        socket.send_multipart([MSG_CHUNK, U64.pack(index)], flags=zmq.NOBLOCK)
    except zmq.Again:
        raise _SourceFailed(f"cannot queue a request for chunk {index}") from None


def _drain(socket: zmq.Socket) -> bytes:
    """Reads and drops the rest of a multipart message; returns its first remaining part."""
    first = b""
    while socket.getsockopt(zmq.RCVMORE):
        part = socket.recv()
        first = first or part
    return first
