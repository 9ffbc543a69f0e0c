"""Any-host transport over ZMQ: decode sends ``KvPull``, prefill answers with raw frames.

Wire (one multipart message each way; the source's ROUTER adds/strips the identity)::

    decode DEALER  --[encode(KvPull(request_id))]-->                      prefill ROUTER
    decode DEALER  <--[encode(KvData(request_id, ok, reason, num_frames)),
                       frame(layer 0, K), frame(layer 0, V), frame(layer 1, K), ...]--

Each frame holds the request's blocks of one (layer, K/V) back to back, in ``block_ids``
order: ``len(block_ids) * block_bytes`` bytes. ``ok=False`` carries no frames.

Copies: the source sends views of its pool when the blocks are one run and otherwise gathers
them in one pass (``copy=False`` either way); the destination scatters each frame into its own
blocks in one copy, hashing as it goes, on several threads (``copier.SlabCopier``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import zmq

from kvrelay.protocol.errors import ProtocolError, SourceGone, TransferError
from kvrelay.protocol.messages import KvData, KvPull, decode, encode
from kvrelay.transport.base import KvTransport, PullSpec
from kvrelay.transport.blocks import (
    PinnedStaging,
    Run,
    block_bytes,
    block_runs,
    byte_view,
    gather_device_blocks,
    paired_runs,
    scatter_device_blocks,
)
from kvrelay.transport.checksum import SlabCache
from kvrelay.transport.copier import SlabCopier
from kvrelay.transport.curve import SocketSecurity

if TYPE_CHECKING:
    import torch


logger = logging.getLogger(__name__)

Lookup = Callable[[str], "list[int] | None"]


class KvSource:
    """Prefill side: answers ``KvPull`` on the worker's peer ROUTER socket.

    The worker owns the socket and its event loop; for every ``[identity, payload]`` that
    decodes to a ``KvPull`` it calls ``reply(socket, identity, pull)``, from the thread that
    owns the socket. ``lookup(request_id)`` returns the block ids still leased to that request
    (in order), or None when it is unknown, released or its lease expired. The blocks must stay
    unchanged until decode acks or the lease ends: frames may reference the pool itself, and
    ZMQ sends them after ``reply`` returns.
    """

    def __init__(self, pool: torch.Tensor, lookup: Lookup) -> None:
        self._pool = pool
        self._view = byte_view(pool) if pool.device.type == "cpu" else None
        self._lookup = lookup

    def reply(self, socket: zmq.Socket, identity: bytes, pull: KvPull) -> int:
        """Sends the request's blocks (or ``ok=False``) to ``identity``; returns bytes queued.

        Never blocks: a reply ZMQ cannot queue is dropped and logged (decode then times out).
        """
        block_ids = self._lookup(pull.request_id)
        if block_ids is None:
            header = KvData(pull.request_id, ok=False, reason="unknown request or lease expired")
            self._send(socket, [identity, encode(header)])
            return 0
        frames = self._frames(block_ids)
        header = KvData(pull.request_id, ok=True, num_frames=len(frames))
        self._send(socket, [identity, encode(header), *frames])
        return sum(frame.nbytes for frame in frames)

    def _frames(self, block_ids: list[int]) -> list[np.ndarray]:
        if self._view is None:  # a GPU pool: one gather on the device, one copy to the host
            blocks = gather_device_blocks(self._pool, block_ids).numpy()
            return [blocks[layer, kv] for layer in range(blocks.shape[0]) for kv in range(2)]
        runs = block_runs(block_ids)
        if len(runs) == 1:
            start, length = runs[0]
            blocks = self._view[:, :, start : start + length]  # a view: zero-copy
        else:
            blocks = np.take(self._view, block_ids, axis=2)  # one gather: [L, 2, n, block_bytes]
        return [blocks[layer, kv] for layer in range(blocks.shape[0]) for kv in range(2)]

    @staticmethod
    def _send(socket: zmq.Socket, parts: list[bytes | np.ndarray]) -> None:
        frames = [part if isinstance(part, bytes) else part.data for part in parts]  # zero-copy
        try:
            socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            logger.warning("could not queue a KV reply: %s", e)


class TcpTransport(KvTransport):
    """Decode side: one DEALER per peer address, cached; CPU or GPU pools; one thread only.

    A pull that times out closes its socket, so a late reply to it can never be read as the
    answer to a later pull; replies are also matched on ``request_id`` and others dropped.
    The lease is enforced by the source (its ``lookup``), whose clock is the one that counts.
    """

    name = "tcp"
    checks_lease = False  # the source checks it (``lookup``) on its own clock

    def __init__(self, security: SocketSecurity, context: zmq.Context | None = None) -> None:
        self._security = security  # every pull socket is a CURVE client of the peer
        self._context = context if context is not None else zmq.Context()
        self._owns_context = context is None
        self._sockets: dict[str, zmq.Socket] = {}
        self._dst_slabs = SlabCache()
        self._copier = SlabCopier()
        self._staging = PinnedStaging()  # GPU destinations: frames are verified here first
        self._staged: np.ndarray | None = None  # this pull's verified-before-commit frames

    def _copy(
        self,
        spec: PullSpec,
        dst_pool: torch.Tensor,
        dst_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        frames = self._request(spec, timeout)
        src_slabs = _frame_slabs(spec, frames)
        if dst_pool.device.type == "cpu":
            runs = paired_runs(range(len(dst_block_ids)), dst_block_ids)
            return self._copier.copy_and_checksum(src_slabs, self._dst_slabs.get(dst_pool), runs)
        # a GPU pool: verified in host memory first, so nothing unverified reaches the device
        shape = (len(src_slabs), *src_slabs[0].shape)
        self._staged = self._staging.get(math.prod(shape)).numpy().reshape(shape)
        return self._copier.copy_and_checksum(
            src_slabs, self._staged, [Run(0, 0, len(dst_block_ids))]
        )

    def _commit(self, dst_pool: torch.Tensor, dst_block_ids: Sequence[int]) -> None:
        if self._staged is not None:
            staged, self._staged = self._staged, None
            scatter_device_blocks(dst_pool, dst_block_ids, staged)

    def _on_mismatch(self, spec: PullSpec) -> None:
        self._staged = None

    def close(self) -> None:
        for addr in list(self._sockets):
            self._drop(addr)
        self._dst_slabs.clear()
        self._copier.close()
        if self._owns_context and not self._context.closed:
            self._context.term()

    def _request(self, spec: PullSpec, timeout: float) -> list[zmq.Frame]:
        """Sends the pull and returns the matching reply's frames (header checked)."""
        addr = spec.src.peer_addr
        socket = self._socket(addr)
        try:
            socket.send(encode(KvPull(spec.request_id)), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._drop(addr)
            raise SourceGone(f"{spec.request_id}: cannot queue a pull to {addr}") from None
        deadline = time.monotonic() + timeout
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not remaining_ms or not socket.poll(remaining_ms, zmq.POLLIN):
                self._drop(addr)
                raise SourceGone(f"{spec.request_id}: no reply from {addr} within {timeout:g}s")
            parts = socket.recv_multipart(copy=False)
            header = self._header(addr, parts[0].bytes)
            if header.request_id != spec.request_id:
                logger.debug("dropping a stale reply for %s from %s", header.request_id, addr)
                continue
            if not header.ok:
                raise SourceGone(f"{spec.request_id}: {addr} refused: {header.reason}")
            if header.num_frames != len(parts) - 1:
                num_got = len(parts) - 1
                raise TransferError(
                    f"{spec.request_id}: header says {header.num_frames} frames, got {num_got}"
                )
            return parts[1:]

    def _header(self, addr: str, payload: bytes) -> KvData:
        try:
            return decode(payload, KvData)
        except ProtocolError as e:
            self._drop(addr)
            raise TransferError(f"malformed KV reply from {addr}: {e}") from e

    def _socket(self, addr: str) -> zmq.Socket:
        socket = self._sockets.get(addr)
        if socket is None:
            socket = self._context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            self._security.client(socket)
            socket.connect(addr)
            self._sockets[addr] = socket
        return socket

    def _drop(self, addr: str) -> None:
        socket = self._sockets.pop(addr, None)
        if socket is not None:
            socket.close(linger=0)


def _frame_slabs(spec: PullSpec, frames: list[zmq.Frame]) -> list[np.ndarray]:
    """Each frame as a ``[num_blocks, block_bytes]`` array; raises TransferError if misshapen."""
    layout = spec.src.layout
    num_blocks, slab_bytes = len(spec.src_block_ids), block_bytes(layout)
    if len(frames) != 2 * layout.num_layers:
        raise TransferError(
            f"{spec.request_id}: {len(frames)} frames, expected {2 * layout.num_layers}"
        )
    slabs = []
    for frame in frames:
        data = np.frombuffer(frame.buffer, dtype=np.uint8)
        if data.size != num_blocks * slab_bytes:
            raise TransferError(
                f"{spec.request_id}: frame of {data.size} bytes, expected {num_blocks * slab_bytes}"
            )
        slabs.append(data.reshape(num_blocks, slab_bytes))
    return slabs
