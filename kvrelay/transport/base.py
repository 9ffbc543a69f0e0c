"""The KV transport interface: decode pulls a request's blocks from prefill's pool.

Contract of every ``KvTransport``:

- **Who owns what.** The caller (the decode worker) allocated ``dst_block_ids`` in its own
  pool before the pull and still owns them after it, success or failure. On any error it frees
  them: a failed pull may have written some of them, and nothing written by a failed pull is
  ever valid. The source (the prefill worker) owns ``spec.src_block_ids``; it keeps them
  unchanged under the lease until ``spec.lease_deadline`` or until decode acks, whichever comes
  first. A transport never frees or allocates blocks and never writes outside
  ``dst_block_ids``.
- **Validity.** ``pull`` returns only after the bytes in the destination blocks have been
  verified: fingerprint equal, layouts compatible (``KvLayout.compatible``), and the checksum
  of the destination blocks equal to ``spec.checksum`` (so a source that recycled its blocks
  mid-copy is caught). Anything else raises a ``TransferError`` subclass.
- **Time.** ``pull`` returns or raises within about ``timeout`` seconds; no wait is unbounded.
  ``SourceGone`` covers an expired lease, a dead or silent peer and a source that no longer
  knows the request: the caller falls back to recomputing the prompt.
- **Threads.** A transport instance is used from one thread (sockets and cached attachments
  are not locked). Use one instance per thread.
- **Resources.** A transport caches per-peer state (attachments, sockets); ``close()``
  releases all of it and may be called more than once.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from kvrelay.protocol.errors import (
    ChecksumMismatch,
    FingerprintMismatch,
    LayoutMismatch,
    SourceGone,
    VersionMismatch,
)
from kvrelay.protocol.messages import KV_HANDOFF_VERSION
from kvrelay.transport.blocks import pool_shape, torch_dtype, transfer_bytes

if TYPE_CHECKING:
    import torch

    from kvrelay.protocol.messages import KvLayout, KvReady, PeerInfo


@dataclasses.dataclass(frozen=True, slots=True)
class PullSpec:
    """What decode needs to pull one request's blocks (from prefill's ``KvReady``)."""

    request_id: str
    src: PeerInfo
    src_block_ids: list[int]
    checksum: int
    lease_deadline: float  # wall clock (time.time()); the source may reuse blocks after it

    @classmethod
    def from_ready(cls, ready: KvReady) -> PullSpec:
        return cls(
            ready.request_id, ready.src, list(ready.block_ids), ready.checksum, ready.lease_deadline
        )


class TransferStats(NamedTuple):
    num_bytes: int  # KV bytes moved into the destination blocks
    seconds: float  # wall time of the pull, verification included


class KvTransport(abc.ABC):
    """Moves whole blocks from a source pool into a destination pool; see the module doc.

    ``pull`` is the one verify-and-copy path every transport shares: the checks before any
    copy (``check_pull``, the lease where this side can see it), then the transport's own
    ``_copy``, then the checksum of what arrived, then ``_commit`` (a transport that stages
    bytes moves them into the destination only once they are verified).
    """

    name: str
    checks_lease: bool = True  # False where the source enforces the lease on its own clock

    def pull(
        self,
        spec: PullSpec,
        dst_pool: torch.Tensor,
        dst_block_ids: Sequence[int],
        dst_layout: KvLayout,
        fingerprint: bytes,
        timeout: float,
    ) -> TransferStats:
        """Copies ``spec.src_block_ids`` into ``dst_block_ids`` (same order) and verifies them.

        Raises:
            FingerprintMismatch, LayoutMismatch, VersionMismatch: before anything is copied.
            SourceGone: lease expired, peer dead, no answer within ``timeout``, unknown request.
            ChecksumMismatch: the copied bytes are not what the source checksummed.
            TransferError: any other failure (malformed reply from the peer).
            ValueError: the caller's own arguments are inconsistent (a bug, not the peer).
        """
        start = time.perf_counter()
        check_pull(spec, dst_pool, dst_block_ids, dst_layout, fingerprint)
        if self.checks_lease and time.time() >= spec.lease_deadline:
            raise SourceGone(f"{spec.request_id}: lease expired at {spec.lease_deadline:.3f}")
        actual = self._copy(spec, dst_pool, dst_block_ids, timeout)
        try:
            check_checksum(spec, actual)
        except ChecksumMismatch:
            self._on_mismatch(spec)
            raise
        self._commit(dst_pool, dst_block_ids)
        num_bytes = transfer_bytes(dst_layout, len(dst_block_ids))
        return TransferStats(num_bytes, time.perf_counter() - start)

    @abc.abstractmethod
    def _copy(
        self,
        spec: PullSpec,
        dst_pool: torch.Tensor,
        dst_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        """Moves the source blocks into ``dst_block_ids`` (or a staging buffer that
        ``_commit`` empties) and returns the KV checksum of the bytes as they arrived."""

    def _commit(self, dst_pool: torch.Tensor, dst_block_ids: Sequence[int]) -> None:
        """Called only after the checksum matched; moves staged bytes into the pool."""
        return None

    def _on_mismatch(self, spec: PullSpec) -> None:
        """Called when the checksum did not match, before ``ChecksumMismatch`` propagates."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Releases cached sockets and attachments; idempotent."""


def check_pull(
    spec: PullSpec,
    dst_pool: torch.Tensor,
    dst_block_ids: Sequence[int],
    dst_layout: KvLayout,
    fingerprint: bytes,
) -> None:
    """The checks every transport makes before copying anything (see ``KvTransport.pull``)."""
    if tuple(dst_pool.shape) != pool_shape(dst_layout) or dst_pool.dtype != torch_dtype(
        dst_layout.dtype
    ):
        raise ValueError(
            f"dst pool {tuple(dst_pool.shape)} {dst_pool.dtype} does not match {dst_layout}"
        )
    if len(dst_block_ids) != len(spec.src_block_ids):
        raise ValueError(
            f"{spec.request_id}: {len(spec.src_block_ids)} source blocks but "
            f"{len(dst_block_ids)} destination blocks"
        )
    bad_dst = [b for b in dst_block_ids if not 0 <= b < dst_layout.num_blocks]
    if bad_dst:
        raise ValueError(f"dst block ids out of range [0, {dst_layout.num_blocks}): {bad_dst[:8]}")
    if spec.src.kv_version != KV_HANDOFF_VERSION:
        raise VersionMismatch(
            f"{spec.request_id}: source {spec.src.instance_id} speaks KV hand-off version "
            f"{spec.src.kv_version}, this instance {KV_HANDOFF_VERSION}: upgrade both roles"
        )
    if spec.src.fingerprint != fingerprint:
        raise FingerprintMismatch(
            f"{spec.request_id}: source {spec.src.instance_id} serves model "
            f"{spec.src.fingerprint.hex()[:16]}, this instance {fingerprint.hex()[:16]}"
        )
    if not _compatible(spec.src.layout, dst_layout):
        raise LayoutMismatch(f"{spec.request_id}: source {spec.src.layout} vs dst {dst_layout}")
    num_src_blocks = spec.src.layout.num_blocks
    bad_src = [b for b in spec.src_block_ids if not 0 <= b < num_src_blocks]
    if bad_src:
        raise LayoutMismatch(
            f"{spec.request_id}: source block ids out of range [0, {num_src_blocks}): {bad_src[:8]}"
        )


@functools.lru_cache(maxsize=64)
def _compatible(src: KvLayout, dst: KvLayout) -> bool:
    return src.compatible(dst)


def check_checksum(spec: PullSpec, actual: int) -> None:
    if actual != spec.checksum:
        raise ChecksumMismatch(
            f"{spec.request_id}: checksum {actual:#018x} != expected {spec.checksum:#018x} "
            f"over {len(spec.src_block_ids)} blocks from {spec.src.instance_id}"
        )
