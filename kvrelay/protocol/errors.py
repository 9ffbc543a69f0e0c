"""Errors that cross a process boundary: a malformed message, a failed KV transfer.

Raised on one side (a transport, the codec) and handled on another (the decode worker falls
back to recomputing, the router drops the message), so they live with the wire types.
"""

from __future__ import annotations


class ProtocolError(ValueError):
    """Bytes from a peer that are not a valid message."""


class TransferError(RuntimeError):
    """A KV transfer failed; the destination blocks hold nothing valid."""


class ChecksumMismatch(TransferError):
    """The bytes that arrived are not the bytes the source checksummed."""


class LayoutMismatch(TransferError):
    """Source and destination pools differ per block (layers, block size, heads, dtype)."""


class FingerprintMismatch(TransferError):
    """Source and destination serve different models."""


class VersionMismatch(TransferError):
    """Source and destination run different KV hand-off versions (checksum, framing)."""


class SourceGone(TransferError):
    """The source cannot deliver: lease expired, peer dead or silent, request unknown."""
