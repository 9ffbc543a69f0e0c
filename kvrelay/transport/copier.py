"""Copy-and-verify of KV slabs, and the checksum alone, split across threads by slab.

Every (layer, K/V) slab has its own digest (``slabhash.SlabJob``), so thread ``k`` of ``T``
owns the contiguous slab range ``[k*S//T, (k+1)*S//T)`` and returns its digests; the calling
thread does range 0 and the others run on a pool this object owns. A range is one call into
the native ``kvcopy`` library (ctypes releases the GIL for it), which copies each run of
blocks and hashes it in the same pass, 32 bytes at a time from registers: the threads run in
parallel, nothing is read twice, and scattered ids cost one loop iteration per block, not a
Python call. ``T`` is capped by the slabs and by ``min_bytes_per_thread``: below about 1 MiB
a thread hand-off costs more than it saves.

The result equals ``checksum.slabs_checksum`` of the destination slabs over the destination
ids, whatever the number of threads or the path (native or the numpy + xxhash fallback).
"""

from __future__ import annotations

import concurrent.futures
import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.transport.slabhash import SlabJob, combine_digests

if TYPE_CHECKING:
    import numpy as np

    from kvrelay.transport.blocks import Run

    Slabs = np.ndarray | Sequence[np.ndarray]

MIN_BYTES_PER_THREAD = 1 << 20


class SlabCopier:
    """Copies runs of blocks slab to slab on ``num_threads`` threads and checksums the result.

    Args:
        num_threads: threads per copy, the caller's included; ``None``: ``torch.get_num_threads()``
            at each call, so the copy uses the cores the process gives torch.
        min_bytes_per_thread: a job of fewer bytes per thread runs on fewer threads.

    ``close()`` stops the pool's threads; a later call starts them again.
    """

    def __init__(
        self, num_threads: int | None = None, min_bytes_per_thread: int = MIN_BYTES_PER_THREAD
    ) -> None:
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self._num_threads = num_threads
        self._min_bytes_per_thread = min_bytes_per_thread
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._num_workers = 0

    def copy_and_checksum(self, src: Slabs, dst: Slabs, runs: Sequence[Run]) -> int:
        """Copies ``runs`` from each source slab into its destination slab; returns the checksum.

        ``src[i]`` and ``dst[i]`` are the ``[blocks, block_bytes]`` arrays of the same
        (layer, K/V), in (layer, K/V) order. One copy, no intermediate buffer.
        """
        return self._run(SlabJob(src, dst, runs))

    def checksum(self, slabs: Slabs, runs: Sequence[Run]) -> int:
        """The checksum of ``runs`` (their ``src_start`` and ``length``) of ``slabs``."""
        return self._run(SlabJob(slabs, None, runs))

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
        self._executor, self._num_workers = None, 0

    def _run(self, job: SlabJob) -> int:
        num_threads = min(self._threads(), job.num_slabs)
        if self._min_bytes_per_thread > 0:
            num_threads = min(num_threads, job.num_bytes // self._min_bytes_per_thread)
        num_threads = max(1, num_threads)
        bounds = [k * job.num_slabs // num_threads for k in range(num_threads + 1)]
        ranges = list(itertools.pairwise(bounds))
        futures = self._submit(job, ranges[1:])
        try:
            digests = job.digests(*ranges[0])
        finally:
            concurrent.futures.wait(futures)  # they write into dst: never return before them
        for future in futures:
            digests += future.result()
        return combine_digests(digests)

    def _threads(self) -> int:
        if self._num_threads is not None:
            return self._num_threads
        import torch

        return torch.get_num_threads()

    def _submit(
        self, job: SlabJob, ranges: Sequence[tuple[int, int]]
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
        return [executor.submit(job.digests, lo, hi) for lo, hi in ranges]
