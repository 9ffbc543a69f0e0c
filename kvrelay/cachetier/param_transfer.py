"""Parameter pools between hosts: serve a ready pool, or fill a new one from peers in a chain.

A host that has the weights serves its pool's data region (``ChainServer``); a new host
fetches it from the nearest peer while serving what it has received to the next host
(serial-forwarding multicast, ``transport/chain.py``), so N new hosts take about the time of
one transfer. Every 4 MiB chunk is checked against the source pool's checksums; a dead peer
makes the receiver resume from the one before it. If no peer delivers, the caller falls back
to the disk (``ParamPool.attach_or_create``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import NamedTuple

from kvrelay.cachetier.param_ops import pool_name
from kvrelay.cachetier.param_pool import ParamPool
from kvrelay.cachetier.param_segment import Manifest
from kvrelay.transport.chain_fetch import fetch
from kvrelay.transport.chain_server import ChainServer
from kvrelay.transport.chain_wire import ChainError, ChainMeta
from kvrelay.transport.curve import SocketSecurity

logger = logging.getLogger(__name__)


class PoolFetch(NamedTuple):
    pool: ParamPool
    server: ChainServer | None  # serving the pool onward (to the next host in the chain)
    num_bytes: int
    seconds: float
    sources_used: tuple[str, ...]


def chain_meta(pool: ParamPool) -> ChainMeta:
    return ChainMeta(
        pool.name, pool.header, pool.total_bytes, pool.chunk_bytes, tuple(pool.chunk_checksums)
    )


def serve_pool(
    pool: ParamPool,
    bind: str = "tcp://127.0.0.1:0",
    *,
    link_bytes_per_s: float = 0.0,
    security: SocketSecurity,
) -> ChainServer:
    """Serves a ready pool's data to peers (cluster members only: ``security``) until the
    server is closed, at most ``link_bytes_per_s`` (0: unlimited)."""
    return ChainServer(
        pool.buffer,
        chain_meta(pool),
        bind,
        complete=True,
        link_bytes_per_s=link_bytes_per_s,
        security=security,
    )


def fetch_pool(
    fingerprint: bytes,
    dtype: str,
    sources: Sequence[str],
    *,
    scope: str = "",
    forward_bind: str | None = None,
    timeout: float = 10.0,
    link_bytes_per_s: float = 0.0,
    security: SocketSecurity,
) -> PoolFetch:
    """Fills this host's pool for ``fingerprint``/``dtype`` from ``sources`` (nearest first).

    With ``forward_bind``, the pool is served onward while it fills, at most
    ``link_bytes_per_s`` (0: unlimited). Raises ``ChainError``
    when no source delivers (the half-filled pool is removed) and ``ValueError`` when a
    source holds another model (another identity or dtype: refused before anything is made).
    """
    name = pool_name(fingerprint, dtype, scope)
    filling: list[ParamPool] = []

    def make_buffer(meta: ChainMeta) -> memoryview:
        offered = Manifest.decode(meta.header)
        if (offered.fingerprint, offered.dtype) != (fingerprint, dtype):
            raise ValueError(
                f"a peer serves model {offered.fingerprint.hex()} {offered.dtype}, "
                f"not {fingerprint.hex()} {dtype}"
            )
        pool = ParamPool.open_for_fill(name, meta.header, meta.total_bytes)
        filling.append(pool)
        return pool.buffer

    try:
        result = fetch(
            list(sources),
            make_buffer,
            forward=forward_bind is not None,
            bind=forward_bind or "tcp://127.0.0.1:0",
            timeout=timeout,
            link_bytes_per_s=link_bytes_per_s,
            security=security,
        )
    except ChainError:
        for pool in filling:
            pool.close()  # removes the half-filled segment
        raise
    pool = filling[-1]
    pool.mark_ready()
    logger.info(
        "filled parameter pool %s from %s: %.1f MiB in %.2f s",
        name,
        ", ".join(result.sources_used),
        result.num_bytes / 2**20,
        result.seconds,
    )
    return PoolFetch(pool, result.server, result.num_bytes, result.seconds, result.sources_used)
