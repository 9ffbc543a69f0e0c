"""The destination's copy-and-verify of KV slabs, split across threads by slab.

Every (layer, K/V) slab has its own digest (``checksum.slab_digest``), so thread ``k`` of
``T`` owns the contiguous slab range ``[k*S//T, (k+1)*S//T)`` and returns its digests; the
calling thread does range 0 and the others run on a pool this object owns. A thread copies a
piece with ``np.copyto`` (which releases the GIL) and hashes it right after, while it is still
in its cache, instead of re-reading the transfer from memory afterwards. xxh3 holds the GIL,
but a piece's hash is a fraction of its copy, so one thread's copy overlaps another's hash::

    stacked slabs ([S, blocks, block_bytes] on both sides: the pools)
        piece = n blocks of every slab in the range, one strided copy, then one hash per slab;
        n = CHUNK_BYTES // (slabs in range * block_bytes), at least 1
    separate slabs (tcp frames)
        piece = n blocks of one slab; n = CHUNK_BYTES // block_bytes, at least 1

With scattered block ids (every block its own run) the stacked shape costs one copy call per
block per thread instead of one per block per slab. The result equals ``checksum.slabs_checksum``
of the destination slabs over the destination ids, whatever the number of threads.
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from kvrelay.transport.blocks import Run, split_runs
from kvrelay.transport.checksum import combine_digests

if TYPE_CHECKING:
    Slabs = np.ndarray | Sequence[np.ndarray]

CHUNK_BYTES = 1 << 20  # bytes a thread copies before hashing them: within its 1-2 MiB L2


class SlabCopier:
    """Copies runs of blocks slab to slab on ``num_threads`` threads and checksums the result.

    Args:
        num_threads: threads per copy, the caller's included; ``None``: ``torch.get_num_threads()``
            at each call, so the copy uses the cores the process gives torch.

    ``close()`` stops the pool's threads; a later call starts them again.
    """

    def __init__(self, num_threads: int | None = None) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._num_threads = num_threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._num_workers = 0

    def copy_and_checksum(self, src: Slabs, dst: Slabs, runs: Sequence[Run]) -> int:
        """Copies ``runs`` from each source slab into its destination slab; returns the checksum.

        ``src[i]`` and ``dst[i]`` are the ``[blocks, block_bytes]`` arrays of the same
        (layer, K/V), in (layer, K/V) order. One copy, no intermediate buffer.
        """
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source slabs but {len(dst)} destination slabs")
        num_slabs = len(dst)
        num_threads = max(1, min(self._threads(), num_slabs))
        bounds = [k * num_slabs // num_threads for k in range(num_threads + 1)]
        ranges = list(itertools.pairwise(bounds))
        futures = self._submit(src, dst, runs, ranges[1:])
        try:
            digests = _copy_range(src, dst, runs, *ranges[0])
        finally:
            concurrent.futures.wait(futures)  # they write into dst: never return before them
        for future in futures:
            digests += future.result()
        return combine_digests(digests)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor, self._num_workers = None, 0

    def _threads(self) -> int:
        if self._num_threads is not None:
            return self._num_threads
        import torch

        return torch.get_num_threads()

    def _submit(
        self, src: Slabs, dst: Slabs, runs: Sequence[Run], ranges: Sequence[tuple[int, int]]
    ) -> list[concurrent.futures.Future[list[int]]]:
        if not ranges:
            return []
        if self._executor is None or self._num_workers < len(ranges):
            self.close()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=len(ranges), thread_name_prefix="kv-copy"
            )
            self._num_workers = len(ranges)
        executor = self._executor
        return [executor.submit(_copy_range, src, dst, runs, lo, hi) for lo, hi in ranges]


def _copy_range(src: Slabs, dst: Slabs, runs: Sequence[Run], lo: int, hi: int) -> list[int]:
    """Copies slabs ``lo .. hi-1``; returns their digests in order."""
    if lo == hi:
        return []
    if isinstance(src, np.ndarray) and isinstance(dst, np.ndarray):
        return _copy_stacked(src[lo:hi], dst[lo:hi], runs)
    block_bytes = dst[lo].shape[1]
    pieces = split_runs(runs, max(1, CHUNK_BYTES // block_bytes))
    return [_copy_slab(src[i], dst[i], pieces) for i in range(lo, hi)]


def _copy_stacked(src: np.ndarray, dst: np.ndarray, runs: Sequence[Run]) -> list[int]:
    """A piece small enough is one strided copy over all the slabs, a larger one slab by slab."""
    num_slabs, _, block_bytes = dst.shape
    hashers = [xxhash.xxh3_64() for _ in range(num_slabs)]
    views = [(hasher.update, memoryview(slab).cast("B")) for hasher, slab in zip(hashers, dst)]
    for src_start, dst_start, length in split_runs(runs, max(1, CHUNK_BYTES // block_bytes)):
        begin, end = dst_start * block_bytes, (dst_start + length) * block_bytes
        if (end - begin) * num_slabs <= CHUNK_BYTES:
            np.copyto(
                dst[:, dst_start : dst_start + length], src[:, src_start : src_start + length]
            )
            for update, view in views:
                update(view[begin:end])
            continue
        for (update, view), src_slab, dst_slab in zip(views, src, dst):
            np.copyto(
                dst_slab[dst_start : dst_start + length], src_slab[src_start : src_start + length]
            )
            update(view[begin:end])
    return [hasher.intdigest() for hasher in hashers]


def _copy_slab(src: np.ndarray, dst: np.ndarray, pieces: Sequence[Run]) -> int:
    hasher = xxhash.xxh3_64()
    for src_start, dst_start, length in pieces:
        out = dst[dst_start : dst_start + length]
        np.copyto(out, src[src_start : src_start + length])
        hasher.update(out.data)
    return hasher.intdigest()
