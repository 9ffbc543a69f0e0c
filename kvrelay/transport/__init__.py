"""KV movement between workers: one interface (``KvTransport``), three transports.

``shm`` (same host, CPU pools in shared memory), ``tcp`` (any host, ZMQ), ``cuda_ipc`` (same
host, GPU pools). Importing this package is light: it loads no transport, torch or zmq;
``create_transport`` imports the chosen one.
"""

from __future__ import annotations

from kvrelay.transport.base import (
    ChecksumMismatch,
    FingerprintMismatch,
    KvTransport,
    LayoutMismatch,
    PullSpec,
    SourceGone,
    TransferError,
    TransferStats,
)
from kvrelay.transport.registry import (
    TRANSPORT_NAMES,
    available_transports,
    choose_transport,
    create_transport,
)

__all__ = [
    "TRANSPORT_NAMES",
    "ChecksumMismatch",
    "FingerprintMismatch",
    "KvTransport",
    "LayoutMismatch",
    "PullSpec",
    "SourceGone",
    "TransferError",
    "TransferStats",
    "available_transports",
    "choose_transport",
    "create_transport",
]
