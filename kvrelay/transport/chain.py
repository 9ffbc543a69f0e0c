"""Peer transfer of one large object (a host's weights) in a chain: serial-forwarding multicast.

An object is a header plus ``total_bytes`` of data cut into ``chunk_bytes`` chunks, each with
its xxh3-64 checksum (``ChainMeta``). A ``ChainServer`` serves it from a byte buffer that may
still be arriving: it knows how many leading chunks are complete and holds a request for a
later chunk until that chunk lands. ``fetch`` pulls an object into a new buffer while serving
that buffer itself, so several new hosts form a chain and each forwards chunks as they arrive::

    origin --c0 c1 c2 c3..--> B --c0 c1 c2..--> C --c0 c1..--> D
    time for N receivers ~ one transfer + (N - 1) chunk latencies, not N transfers

The pieces: ``chain_wire`` (``ChainMeta``, the message kinds, ``plan_chain``),
``chain_server`` (``ChainServer``: holding, heartbeats, pacing) and ``chain_fetch``
(``fetch``: failover down the source list). This module is their one import point.
"""

from __future__ import annotations

from kvrelay.transport.chain_fetch import (
    MAX_BAD_CHUNKS,
    STALL_TIMEOUTS,
    FetchResult,
    fetch,
)
from kvrelay.transport.chain_server import ChainServer, ServerStats
from kvrelay.transport.chain_wire import (
    DEFAULT_CHUNK_BYTES,
    HEARTBEAT_S,
    ChainError,
    ChainMeta,
    chunk_checksums,
    create_meta,
    plan_chain,
)

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "HEARTBEAT_S",
    "MAX_BAD_CHUNKS",
    "STALL_TIMEOUTS",
    "ChainError",
    "ChainMeta",
    "ChainServer",
    "FetchResult",
    "ServerStats",
    "chunk_checksums",
    "create_meta",
    "fetch",
    "plan_chain",
]
