"""A worker's KV pool, allocated where same-host peers can read it.

The engine asks for its pool through ``KvExport.allocate``: a shared-memory segment on CPU
(``transport.shm_pool``; a same-host peer pulls blocks with one copy), the allocation's CUDA
IPC handle on a GPU (``transport.cuda_ipc``), private memory where the cluster's transport is
tcp. ``segment`` is what ``PeerInfo.kv_segment`` carries; ``close`` unlinks the segment.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvrelay.engine.device import allocate_local
from kvrelay.worker.config import layout_from_shape

logger = logging.getLogger(__name__)


class KvExport:
    def __init__(self, cluster_id: str, instance_id: str, transport: str) -> None:
        self.cluster_id = cluster_id
        self.instance_id = instance_id
        self.transport = transport
        self.segment: str | None = None  # the shm segment's name or the CUDA IPC handle
        self._shared: Any = None  # SharedKvPool

    def allocate(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """The engine's ``kv_allocator``: the pool, shared as the transport allows."""
        if self.transport == "tcp":
            return allocate_local(shape, dtype, device)
        if device.type == "cuda":
            from kvrelay.transport.cuda_ipc import export_cuda_pool

            pool = torch.zeros(shape, dtype=dtype, device=device)
            self.segment = export_cuda_pool(pool)
            return pool
        from kvrelay.transport.shm_pool import SharedKvPool, cleanup_segments, segment_name

        name = segment_name(self.cluster_id, self.instance_id, "kv")
        layout = layout_from_shape(shape, dtype)
        try:
            self._shared = SharedKvPool.create(name, layout)
        except FileExistsError:
            # our own name: left by an earlier run of this instance that was killed
            logger.warning("%s: reclaiming stale KV segment %s", self.instance_id, name)
            cleanup_segments(name)  # the name ends in "-kv": matches only itself
            self._shared = SharedKvPool.create(name, layout)
        self.segment = name
        return self._shared.tensor

    def close(self) -> None:
        """Unlinks the shared-memory segment, if there is one."""
        if self._shared is not None:
            self._shared.close(unlink=True)
            self._shared = None
