"""Peer transfer of one large object (a host's weights) in a chain: serial-forwarding multicast.

An object is a header plus ``total_bytes`` of data cut into ``chunk_bytes`` chunks, each with
its xxh3-64 checksum (``ChainMeta``). A ``ChainServer`` serves it from a byte buffer that may
still be arriving: it knows how many leading chunks are complete and holds a request for a
later chunk until that chunk lands. ``fetch`` pulls an object into a new buffer while serving
that buffer itself, so several new hosts form a chain and each forwards chunks as they arrive::

    origin --c0 c1 c2 c3..--> B --c0 c1 c2..--> C --c0 c1..--> D
    time for N receivers ~ one transfer + (N - 1) chunk latencies, not N transfers

Wire (ZMQ; the receiver's DEALER talks to the server's ROUTER, which adds/strips identity)::

    DEALER [b"M"]              -->  ROUTER   <--  [b"M", msgpack(meta fields)]
    DEALER [b"C", u64 index]   -->  ROUTER   <--  [b"C", u64 index, chunk bytes]
                                             <--  [b"W", u64 available]  (while held; heartbeat)
                                             <--  [b"E", reason]

A held request gets a ``W`` heartbeat every ``HEARTBEAT_S``: a hop that is stalled because
*its* source died keeps its receivers waiting while it fails over, so every failure is
handled once, at the hop where it happened. A receiver that hears nothing for ``timeout``
seconds, or gets bad chunks from the same source ``MAX_BAD_CHUNKS`` times, moves to the next
source in its list and resumes from its first missing chunk; so does one that delivers no new
chunk for ``STALL_TIMEOUTS`` timeouts, heartbeats or not, so no wait is unbounded. When no
source is left it raises ``ChainError``; the caller then loads from disk.

A server may pace its chunks to a link rate (``link_bytes_per_s``, a ``TokenBucket`` shared
by all its receivers, as one NIC is): chunks wait in a FIFO, and the next one's tokens are
taken only once the previous one went out, so however late the server thread runs, chunk
``k`` leaves at least ``bytes(k) / rate`` after chunk ``k - 1``. Paced chunks count as held
for heartbeats. This is how one machine models hosts whose links, not CPUs, are the limit.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import heapq
import itertools
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import msgpack
import xxhash
import zmq

from kvrelay.transport.base import TransferError
from kvrelay.transport.rate_limit import TokenBucket

if TYPE_CHECKING:
    from typing import TypeAlias

    import numpy as np

    BufferLike: TypeAlias = "memoryview | np.ndarray | bytearray"

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 4 << 20
HEARTBEAT_S = 0.25  # a server's W interval; a receiver's timeout must be well above it
MAX_BAD_CHUNKS = 3  # bad chunks one source may send before the receiver moves on
STALL_TIMEOUTS = 4  # timeouts without a new chunk, heartbeats or not, before moving on

_META, _CHUNK, _WAIT, _ERROR = b"M", b"C", b"W", b"E"
_U64 = struct.Struct("<Q")


class ChainError(TransferError):
    """No source could deliver the object; the destination buffer holds nothing valid."""


class _SourceFailed(Exception):
    """The current source is dead, silent, refusing or corrupt: move to the next one."""


@dataclasses.dataclass(frozen=True)
class ChainMeta:
    """What a receiver needs before the data: identity, sizes and per-chunk checksums."""

    name: str
    """Object name, e.g. the model fingerprint."""
    header: bytes
    """Opaque bytes the owner needs to use the data (e.g. the pool's tensor table)."""
    total_bytes: int
    """Data size; the last chunk may be short."""
    chunk_bytes: int
    """Bytes per chunk (the unit of forwarding and of checksums)."""
    checksums: Sequence[int]
    """xxh3-64 of each chunk, in order (stored as a tuple)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "checksums", tuple(self.checksums))
        if not isinstance(self.name, str) or not isinstance(self.header, bytes):
            raise ValueError(f"name must be str and header bytes, got {self.name!r}")
        if self.chunk_bytes <= 0 or self.total_bytes < 0:
            raise ValueError(f"bad sizes: total {self.total_bytes}, chunk {self.chunk_bytes}")
        if len(self.checksums) != self.num_chunks:
            raise ValueError(f"{len(self.checksums)} checksums for {self.num_chunks} chunks")

    @property
    def num_chunks(self) -> int:
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_span(self, index: int) -> tuple[int, int]:
        """Byte range ``[start, stop)`` of chunk ``index``."""
        start = index * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)


class ServerStats(NamedTuple):
    num_chunks_served: int
    num_bytes_served: int
    available_at_first_serve: int | None
    """Chunks this server had when it first sent one: below ``num_chunks`` = it forwarded."""


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


def chunk_checksums(buffer: memoryview | np.ndarray | bytes, chunk_bytes: int) -> list[int]:
    """xxh3-64 of each ``chunk_bytes`` piece of ``buffer``."""
    view = memoryview(buffer).cast("B")  # type: ignore[arg-type]  # numpy arrays are buffers
    return [
        xxhash.xxh3_64_intdigest(view[start : start + chunk_bytes])
        for start in range(0, view.nbytes, chunk_bytes)
    ]


def create_meta(
    name: str,
    header: bytes,
    buffer: memoryview | np.ndarray | bytes,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> ChainMeta:
    """The ``ChainMeta`` of a complete buffer (checksums computed here)."""
    total_bytes = memoryview(buffer).nbytes  # type: ignore[arg-type]  # numpy arrays are buffers
    return ChainMeta(name, header, total_bytes, chunk_bytes, chunk_checksums(buffer, chunk_bytes))


def plan_chain(origin: str, receivers: Sequence[str]) -> dict[str, list[str]]:
    """Sources for each receiver: its predecessor first, then earlier hops, the origin last.

    ``plan_chain("A", ["B", "C", "D"])["D"] == ["C", "B", "A"]``.
    """
    hops = [origin, *receivers]
    if len(set(hops)) != len(hops):
        raise ValueError(f"addresses must be distinct: {hops}")
    return {hops[k]: hops[k - 1 :: -1] for k in range(1, len(hops))}


class ChainServer:
    """Serves one object from ``buffer`` on a ROUTER socket, in a background thread.

    ``buffer`` (``total_bytes`` contiguous bytes) is read, never written, and must stay
    mapped until ``close()`` returns: chunks are sent zero-copy. A chunk is served only once
    it is marked available; chunks ``< num_available`` must not change after that. With
    ``link_bytes_per_s > 0`` chunk data leaves at most that fast (0: as fast as it can).
    ``mark_available`` may be called from any one thread; everything else is internal to
    the server thread. ``addr`` is the bound endpoint with the real port.
    """

    def __init__(
        self,
        buffer: BufferLike,
        meta: ChainMeta,
        bind: str = "tcp://127.0.0.1:0",
        *,
        complete: bool = False,
        link_bytes_per_s: float = 0.0,
    ) -> None:
        if link_bytes_per_s < 0:
            raise ValueError(f"link_bytes_per_s must be >= 0 (0: off), got {link_bytes_per_s}")
        self.meta = meta
        self._view = _byte_view(buffer, meta.total_bytes, writable=False)
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
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        try:
            self._socket.bind(bind)
        except zmq.ZMQError:
            self._socket.close()
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
            if request == [_META]:
                self._send([identity, _META, self._meta_reply])
            elif len(request) == 2 and request[0] == _CHUNK and len(request[1]) == _U64.size:
                self._on_chunk_request(identity, _U64.unpack(request[1])[0])
            else:
                self._send([identity, _ERROR, b"malformed request"])

    def _on_chunk_request(self, identity: bytes, index: int) -> None:
        if index >= self.meta.num_chunks:
            self._send([identity, _ERROR, f"no chunk {index}".encode()])
        elif index < self._num_available:
            self._send_chunk(identity, index)
        else:
            heapq.heappush(self._held, (index, next(self._arrivals), identity))

    def _serve_held(self) -> None:
        while self._held and self._held[0][0] < self._num_available:
            index, _, identity = heapq.heappop(self._held)
            self._send_chunk(identity, index)

    def _heartbeat(self) -> None:
        have = _U64.pack(self._num_available)
        waiting = {identity for _, _, identity in self._held}
        for identity in waiting | {identity for identity, _, _ in self._paced}:
            self._send([identity, _WAIT, have])

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
        self._send([identity, _CHUNK, _U64.pack(index), payload])
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

    Raises:
        ValueError: a malformed address, or a buffer of the wrong size.
        ChainError: no source delivered (the destination holds nothing valid; the server
            started here, if any, is closed). The caller loads from disk instead.
    """
    if timeout < 2 * HEARTBEAT_S or window < 1:
        raise ValueError(f"need timeout >= {2 * HEARTBEAT_S}s and window >= 1: {timeout}, {window}")
    context = zmq.Context()
    try:
        return _Fetch(list(sources), context, timeout, window).run(
            make_buffer, bind if forward else None, on_serving, link_bytes_per_s
        )
    finally:
        context.term()


class _Fetch:
    """One fetch's state: the destination, which chunks landed, the failover position."""

    def __init__(self, sources: list[str], context: zmq.Context, timeout: float, window: int):
        self._sources, self._context = sources, context
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
        found = _probe(self._context, self._sources, self._timeout, None)
        if found is None:
            raise ChainError(f"no source answered within {self._timeout:g}s: {self._sources}")
        position, self._meta, socket = found
        self._view = _byte_view(make_buffer(self._meta), self._meta.total_bytes, writable=True)
        self._done = bytearray(self._meta.num_chunks)
        self._num_complete = 0  # leading chunks landed and verified
        try:
            if bind is not None:
                self._server = ChainServer(
                    self._view, self._meta, bind, link_bytes_per_s=link_bytes_per_s
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
            found = _probe(self._context, rest, self._timeout, self._meta)
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
        if kind == _WAIT:
            _drain(socket)
            return None
        if kind != _CHUNK or not socket.getsockopt(zmq.RCVMORE):
            reason = _drain(socket)
            raise _SourceFailed(f"refused: {reason!r}" if kind == _ERROR else f"bad reply {kind!r}")
        index_bytes = socket.recv()
        index = _U64.unpack(index_bytes)[0] if len(index_bytes) == _U64.size else -1
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
    context: zmq.Context, addrs: list[str], timeout: float, expected: ChainMeta | None
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
            sockets.append(_dealer(context, addr))
            sockets[-1].send(_META, flags=zmq.NOBLOCK)  # queued until connected
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
    if len(parts) != 2 or parts[0] != _META:
        logger.warning("bad meta reply from %s: %r", addr, parts[:1])
        return None
    try:
        name, header, total_bytes, chunk_bytes, checksums = msgpack.unpackb(parts[1])
        return ChainMeta(name, header, total_bytes, chunk_bytes, checksums)
    except (ValueError, TypeError) as e:
        logger.warning("malformed meta from %s: %s", addr, e)
        return None


def _dealer(context: zmq.Context, addr: str) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        socket.connect(addr)
    except zmq.ZMQError as e:
        socket.close(linger=0)
        raise ValueError(f"bad source address {addr!r}: {e}") from e
    return socket


def _request_chunk(socket: zmq.Socket, index: int) -> None:
    try:
        socket.send_multipart([_CHUNK, _U64.pack(index)], flags=zmq.NOBLOCK)
    except zmq.Again:
        raise _SourceFailed(f"cannot queue a request for chunk {index}") from None


def _drain(socket: zmq.Socket) -> bytes:
    """Reads and drops the rest of a multipart message; returns its first remaining part."""
    first = b""
    while socket.getsockopt(zmq.RCVMORE):
        part = socket.recv()
        first = first or part
    return first


def _byte_view(buffer: BufferLike, nbytes: int, writable: bool) -> memoryview:
    view = memoryview(buffer)  # type: ignore[arg-type]  # numpy arrays are buffers
    if not view.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    view = view.cast("B")
    if view.nbytes != nbytes:
        raise ValueError(f"buffer of {view.nbytes} bytes, the object has {nbytes}")
    if writable and view.readonly:
        raise ValueError("the destination buffer is read-only")
    return view
