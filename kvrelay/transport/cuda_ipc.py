"""Same-host GPU transport: decode copies device-to-device out of prefill's CUDA pool.

The source exports its device pool once (``export_cuda_pool``) and advertises the handle in
``PeerInfo.kv_segment`` as ``"cuda-ipc:" + base64(msgpack(fields))``, the fields being what
``torch.multiprocessing.reductions.reduce_tensor`` produces (the CUDA IPC memory handle of the
allocation, offsets, ref-counter and event handles). Plain fields, not a pickle: a peer's
bytes never name code to run. The destination opens each handle once (``import_cuda_pool``)
and keeps it for the transport's life; the pool then copies device to device, one run of
consecutive blocks (all layers at once) per copy.

Contract for the source: the pool must stay allocated while any peer may pull, and the
kernels that wrote a request's blocks must be complete before ``KvReady`` is sent (computing
the checksum, which reads the blocks on the host, does that). A handle cannot be opened in the
process that exported it. The checksum reads the destination blocks back to the host (one
gather on the device, one copy, then the host hash): on a GPU it costs far more than the
device-to-device copy (BENCHMARKS.md, GPU paths); a device-side hash is the next step.

``torch.cuda`` is imported only when this transport is constructed; without a CUDA device the
constructor raises ``TransferError("CUDA IPC needs a CUDA device")``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from kvrelay.protocol.errors import LayoutMismatch, TransferError
from kvrelay.transport.base import KvTransport, PullSpec
from kvrelay.transport.blocks import (
    PinnedStaging,
    paired_runs,
    pool_shape,
    torch_dtype,
)
from kvrelay.transport.checksum import kv_checksum
from kvrelay.transport.copier import SlabCopier

if TYPE_CHECKING:
    import torch

    from kvrelay.protocol.messages import KvLayout

CUDA_HANDLE_PREFIX = "cuda-ipc:"
_FIELDS = (
    "size",
    "stride",
    "offset",
    "dtype",
    "device",
    "handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)


def is_cuda_handle(kv_segment: str | None) -> bool:
    return kv_segment is not None and kv_segment.startswith(CUDA_HANDLE_PREFIX)


def export_cuda_pool(pool: torch.Tensor) -> str:
    """The handle string a peer passes to ``import_cuda_pool`` (put it in ``kv_segment``)."""
    from torch.multiprocessing.reductions import reduce_tensor

    if not pool.is_cuda:
        raise ValueError(f"export_cuda_pool needs a CUDA tensor, got {pool.device}")
    _, args = reduce_tensor(pool.detach())
    fields = dict(zip(_FIELDS, _export_values(args)))
    payload = msgpack.packb(fields)
    return CUDA_HANDLE_PREFIX + base64.b64encode(payload).decode("ascii")


def import_cuda_pool(kv_segment: str, layout: KvLayout) -> torch.Tensor:
    """Opens a peer's exported pool in this process; raises LayoutMismatch / TransferError."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fields = _parse_handle(kv_segment)
    if fields["dtype"] != layout.dtype or tuple(fields["size"]) != pool_shape(layout):
        raise LayoutMismatch(
            f"exported pool {fields['size']} {fields['dtype']} does not match {layout}"
        )
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(fields["size"]),
        tuple(fields["stride"]),
        fields["offset"],
        torch.storage.TypedStorage,
        torch_dtype(fields["dtype"]),
        fields["device"],
        fields["handle"],
        fields["storage_size_bytes"],
        fields["storage_offset_bytes"],
        False,
        fields["ref_counter_handle"],
        fields["ref_counter_offset"],
        fields["event_handle"],
        fields["event_sync_required"],
    )


class CudaIpcTransport(KvTransport):
    """Pulls from a same-host source's CUDA pool into a CUDA pool; one thread only."""

    name = "cuda_ipc"

    def __init__(self) -> None:
        import torch

        if not torch.cuda.is_available():
            raise TransferError("CUDA IPC needs a CUDA device")
        self._opened: dict[str, torch.Tensor] = {}
        self._staging = PinnedStaging()  # the checksum's device -> host copies
        self._copier = SlabCopier()  # and its hashing threads

    def _copy(
        self,
        spec: PullSpec,
        dst_pool: torch.Tensor,
        dst_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        import torch

        if not dst_pool.is_cuda:
            raise ValueError(f"cuda_ipc needs a CUDA destination pool, got {dst_pool.device}")
        segment = spec.src.kv_segment
        if segment is None or not is_cuda_handle(segment):
            raise TransferError(f"{spec.request_id}: {spec.src.instance_id} exports no CUDA pool")
        src_pool = self._open(segment, spec.src.layout)
        with torch.cuda.device(dst_pool.device):
            for src, dst, length in paired_runs(spec.src_block_ids, dst_block_ids):
                dst_pool[:, :, dst : dst + length].copy_(src_pool[:, :, src : src + length])
            torch.cuda.current_stream().synchronize()
        return kv_checksum(dst_pool, dst_block_ids, self._staging, self._copier)

    def close(self) -> None:
        self._opened.clear()
        self._copier.close()

    def _open(self, kv_segment: str, layout: KvLayout) -> torch.Tensor:
        pool = self._opened.get(kv_segment)
        if pool is None:
            pool = import_cuda_pool(kv_segment, layout)
            self._opened[kv_segment] = pool
        return pool


def _export_values(args: tuple[Any, ...]) -> list[Any]:
    """``reduce_tensor``'s rebuild args as plain values, in ``_FIELDS`` order."""
    (_, size, stride, offset, _, dtype, device, handle, storage_size, storage_offset, _) = args[:11]
    ref_counter_handle, ref_counter_offset, event_handle, event_sync_required = args[11:]
    return [
        list(size),
        list(stride),
        offset,
        str(dtype).removeprefix("torch."),
        device,
        handle,
        storage_size,
        storage_offset,
        ref_counter_handle,
        ref_counter_offset,
        event_handle,
        event_sync_required,
    ]


def _parse_handle(kv_segment: str) -> dict[str, Any]:
    if not is_cuda_handle(kv_segment):
        raise TransferError(f"not a CUDA IPC handle: {kv_segment[:32]!r}")
    try:
        payload = base64.b64decode(kv_segment[len(CUDA_HANDLE_PREFIX) :], validate=True)
        fields = msgpack.unpackb(payload)
    except (binascii.Error, ValueError, msgpack.UnpackException) as e:
        raise TransferError(f"malformed CUDA IPC handle: {e}") from e
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
        raise TransferError("malformed CUDA IPC handle: wrong fields")
    return fields
