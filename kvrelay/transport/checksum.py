"""The KV handoff checksum: two levels of XXH64 over blocks' raw bytes, in a defined order.

Each (layer, K/V) slab has its own digest over its blocks in ``block_ids`` order, and the
checksum is XXH64 of those digests in (layer, K/V) order, as little-endian u64s (seed 0)::

    digest[l, kv] = xxh64(for b in block_ids: bytes(pool[l, kv, b]))
    checksum      = xxh64(digest[0, K], digest[0, V], digest[1, K], ...)

so the source (over its block ids) and the destination (over the ids it copied into) agree
whatever ids each side uses, a reordered block list changes the value, and every dtype
(bfloat16 too) works: the raw bytes are hashed. A run of consecutive ids is fed as one piece
(XXH64 streaming gives the same digest however a slab's stream is cut).

Why two levels: one streaming hash over the whole transfer can only run on one thread, and it
runs twice per handoff on the critical path (prefill at lease time, decode after its copy).
Independent slab digests let both sides hash slabs on several threads at once
(``copier.SlabCopier``). Why XXH64: it is computed by a small C library of ours
(``kvrelay/csrc/kvcopy.c``, ``slabhash``) that copies and hashes in one pass with the GIL
released, and python-xxhash's ``xxh64`` is the bit-exact reference and the fallback where no
compiler built the library. xxh3 is faster per byte but its binding holds the GIL, which
serialised the threads. Numbers: DESIGN.md (Transport) and BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.transport.blocks import Run, block_runs, byte_view, gather_device_blocks
from kvrelay.transport.copier import SlabCopier

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvrelay.transport.blocks import PinnedStaging


def kv_checksum(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    staging: PinnedStaging | None = None,
    copier: SlabCopier | None = None,
) -> int:
    """The checksum of the blocks ``block_ids`` of ``pool``; see the module doc.

    A CUDA pool is gathered on the device and copied to the host once (into ``staging``'s
    pinned buffer when given), then hashed there. ``copier``: the caller's long-lived
    threads (a worker checksums every hand-off); None starts and stops threads for this call.
    """
    if pool.device.type != "cpu":
        return _device_checksum(pool, block_ids, staging, copier)
    return slabs_checksum(pool_slabs(pool), block_ids, copier)


def slabs_checksum(
    slabs: Sequence[np.ndarray] | np.ndarray,
    block_ids: Sequence[int],
    copier: SlabCopier | None = None,
) -> int:
    """Checksum over per-(layer, K/V) ``[num_blocks, block_bytes]`` arrays, in that order.

    Runs on ``copier``'s threads, or on ``torch.get_num_threads()`` threads (fewer for a small
    transfer) started and stopped by this call.
    """
    runs = [Run(start, start, length) for start, length in block_runs(block_ids)]
    if copier is not None:
        return copier.checksum(slabs, runs)
    own = SlabCopier()
    try:
        return own.checksum(slabs, runs)
    finally:
        own.close()


def pool_slabs(pool: torch.Tensor) -> np.ndarray:
    """``[num_layers * 2, num_blocks, block_bytes]`` byte view of a CPU pool: its slabs in order."""
    view = byte_view(pool)
    return view.reshape(view.shape[0] * 2, view.shape[2], view.shape[3])


class SlabCache:
    """``pool_slabs`` of the last pool seen, reused while the same tensor comes back.

    The cached view keeps that pool's memory alive until another pool is seen or ``clear``.
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._slabs: np.ndarray | None = None

    def get(self, pool: torch.Tensor) -> np.ndarray:
        key = (pool.data_ptr(), tuple(pool.shape), pool.stride(), pool.dtype, pool.device)
        if key != self._key or self._slabs is None:
            self._slabs = pool_slabs(pool)
            self._key = key
        return self._slabs

    def clear(self) -> None:
        self._key, self._slabs = None, None


def _device_checksum(
    pool: torch.Tensor,
    block_ids: Sequence[int],
    staging: PinnedStaging | None = None,
    copier: SlabCopier | None = None,
) -> int:
    """One gather on the device and one copy to the host (into ``staging`` when given; it
    waits for the kernels that wrote the blocks), then the host hash over the copy, whose ids
    are ``0 .. n-1``."""
    host = gather_device_blocks(pool, block_ids, staging).numpy()  # [L, 2, n, block_bytes]
    num_layers, _, n, row = host.shape
    return slabs_checksum(host.reshape(num_layers * 2, n, row), range(n), copier)
