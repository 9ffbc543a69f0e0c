"""Copy-and-verify of KV slabs, and the checksum alone, split across threads by slab.

Every (layer, K/V) slab has its own digest (``slabhash.SlabJob``), so the slabs are cut into
up to ``TASKS_PER_THREAD`` contiguous ranges per thread, which the threads (the caller's and
those of a pool this object owns) take from a queue until none is left: a thread slowed by
another process on its core takes fewer ranges instead of holding up the rest. A range is one
call into the native ``kvcopy`` library (ctypes releases the GIL for it), which copies each
run of blocks and hashes it in the same pass, 32 bytes at a time from registers: the threads
run in parallel, nothing is read twice, and scattered ids cost one loop iteration per block,
not a Python call. The thread count is capped by the slabs and by ``min_bytes_per_thread``:
below about 1 MiB a thread hand-off costs more than it saves.

The result equals ``checksum.slabs_checksum`` of the destination slabs over the destination
ids, whatever the number of threads or the path (native or the numpy + xxhash fallback).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.transport.slabhash import SlabJob, combine_digests

if TYPE_CHECKING:
    import numpy as np

    from kvrelay.transport.blocks import Run

    Slabs = np.ndarray | Sequence[np.ndarray]

MIN_BYTES_PER_THREAD = 1 << 20
TASKS_PER_THREAD = 4  # slab ranges per thread, taken from a queue: a slowed thread takes fewer


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
        if num_threads == 1:
            return combine_digests(job.digests(0, job.num_slabs))
        num_tasks = min(job.num_slabs, TASKS_PER_THREAD * num_threads)
        bounds = [k * job.num_slabs // num_tasks for k in range(num_tasks + 1)]
        tasks: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
        for task in itertools.pairwise(bounds):
            tasks.put(task)
        digests = [0] * job.num_slabs
        futures = self._submit(job, tasks, digests, num_threads - 1)
        try:
            _drain(job, tasks, digests)
        finally:
            concurrent.futures.wait(futures)  # they write into dst: never return before them
        for future in futures:
            future.result()
        return combine_digests(digests)

    def _threads(self) -> int:
        if self._num_threads is not None:
            return self._num_threads
        import torch

        return torch.get_num_threads()

    def _submit(
        self, job: SlabJob, tasks: queue.SimpleQueue[tuple[int, int]], digests: list[int], n: int
    ) -> list[concurrent.futures.Future[None]]:
        if self._executor is None or self._num_workers < n:
            self.close()
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=n, thread_name_prefix="kv-copy"
            )
            self._num_workers = n
        executor = self._executor
        return [executor.submit(_drain, job, tasks, digests) for _ in range(n)]


def _drain(job: SlabJob, tasks: queue.SimpleQueue[tuple[int, int]], digests: list[int]) -> None:
    """Runs slab ranges from ``tasks`` until none is left, each digest into its slot."""
    while True:
        try:
            lo, hi = tasks.get_nowait()
        except queue.Empty:
            return
        digests[lo:hi] = job.digests(lo, hi)
