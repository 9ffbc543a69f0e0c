"""The KV handoff checksum: 64-bit xxh3 over blocks' raw bytes, in a defined order.

The byte stream is, for each layer, for K then V, each block's bytes in ``block_ids`` order::

    for l in layers: for kv in (K, V): for b in block_ids: bytes(pool[l, kv, b])

so the source (over its block ids) and the destination (over the ids it copied into) agree
whatever ids each side uses. A run of consecutive ids is fed as one slab (fewer calls; xxh3
streaming gives the same value however the stream is cut). It runs twice per handoff on the
critical path; xxh3 streams at about twice memcpy speed, blake2b at a sixth of it (measured in
``benchmarks/transfer.py``). The raw bytes are hashed, so every dtype (bfloat16 too) works.

``copy_and_checksum`` fuses the destination's copy with its checksum: each piece is hashed
right after it is written, while it is still in cache, instead of re-reading the whole
transfer from memory afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import xxhash

from kvrelay.transport.blocks import Run, block_runs, byte_view, split_runs

if TYPE_CHECKING:
    import numpy as np
    import torch

CHUNK_BYTES = 1 << 20  # copy+hash piece: fits in L2, so the hash reads what the copy wrote


def kv_checksum(pool: torch.Tensor, block_ids: Sequence[int]) -> int:
    """xxh3-64 of the blocks' bytes (layer, K/V, block in list order); see the module doc.

    A CUDA pool is hashed through host copies of each run (correct, not fast).
    """
    if pool.device.type != "cpu":
        return _device_checksum(pool, block_ids)
    return slabs_checksum(_slabs(byte_view(pool)), block_ids)


def slabs_checksum(slabs: Sequence[np.ndarray], block_ids: Sequence[int]) -> int:
    """Checksum over per-(layer, K/V) ``[num_blocks, block_bytes]`` arrays, in that order."""
    hasher = xxhash.xxh3_64()
    runs = block_runs(block_ids)
    for slab in slabs:
        for start, length in runs:
            hasher.update(slab[start : start + length])
    return hasher.intdigest()


def copy_and_checksum(
    src_slabs: Sequence[np.ndarray], dst_slabs: Sequence[np.ndarray], runs: Sequence[Run]
) -> int:
    """Copies ``runs`` from each source slab into its destination slab; returns the checksum.

    ``src_slabs[i]`` and ``dst_slabs[i]`` are the ``[blocks, block_bytes]`` arrays of the same
    (layer, K/V), in (layer, K/V) order. One copy, no intermediate buffer; the value equals
    ``slabs_checksum(dst_slabs, dst ids of runs)``.
    """
    if len(src_slabs) != len(dst_slabs):
        raise ValueError(f"{len(src_slabs)} source slabs but {len(dst_slabs)} destination slabs")
    if not dst_slabs:
        return xxhash.xxh3_64_intdigest(b"")
    slab_bytes = dst_slabs[0].shape[1]
    pieces = split_runs(runs, max(1, CHUNK_BYTES // max(1, slab_bytes)))
    spans = [
        (src * slab_bytes, (src + n) * slab_bytes, dst * slab_bytes, (dst + n) * slab_bytes)
        for src, dst, n in pieces
    ]
    hasher = xxhash.xxh3_64()
    for src_slab, dst_slab in zip(src_slabs, dst_slabs):
        # flat byte memoryviews: slicing and assigning them costs less than numpy's per call
        src_bytes, dst_bytes = memoryview(src_slab).cast("B"), memoryview(dst_slab).cast("B")
        for src_begin, src_end, dst_begin, dst_end in spans:
            out = dst_bytes[dst_begin:dst_end]
            out[:] = src_bytes[src_begin:src_end]
            hasher.update(out)
    return hasher.intdigest()


def pool_slabs(pool: torch.Tensor) -> list[np.ndarray]:
    """The ``[num_blocks, block_bytes]`` byte arrays of a CPU pool, in (layer, K/V) order."""
    return _slabs(byte_view(pool))


class SlabCache:
    """``pool_slabs`` of the last pool seen, reused while the same tensor comes back.

    The cached arrays keep that pool's memory alive until another pool is seen or ``clear``.
    """

    def __init__(self) -> None:
        self._key: tuple[object, ...] | None = None
        self._slabs: list[np.ndarray] = []

    def get(self, pool: torch.Tensor) -> list[np.ndarray]:
        key = (pool.data_ptr(), tuple(pool.shape), pool.stride(), pool.dtype, pool.device)
        if key != self._key:
            self._slabs = pool_slabs(pool)
            self._key = key
        return self._slabs

    def clear(self) -> None:
        self._key, self._slabs = None, []


def _slabs(view: np.ndarray) -> list[np.ndarray]:
    return [view[layer, kv] for layer in range(view.shape[0]) for kv in range(2)]


def _device_checksum(pool: torch.Tensor, block_ids: Sequence[int]) -> int:
    import torch

    hasher = xxhash.xxh3_64()
    runs = block_runs(block_ids)
    flat = pool.view(torch.uint8).view(pool.shape[0], 2, pool.shape[2], -1)
    for layer in range(pool.shape[0]):
        for kv in range(2):
            for start, length in runs:
                hasher.update(flat[layer, kv, start : start + length].cpu().numpy())
    return hasher.intdigest()
