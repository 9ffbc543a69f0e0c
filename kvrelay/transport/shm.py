"""Same-host transport: decode copies straight out of prefill's shared-memory pool.

One copy, no intermediate buffer: for each (layer, K/V), each run of blocks consecutive on
both sides is one slab-to-slab copy, hashed in the same pass as it is written (the native
``kvcopy`` library), the slabs split across ``torch.get_num_threads()`` threads
(``copier.SlabCopier``). The checksum is over the destination, so a source that reused its
blocks during the copy is caught, not trusted.

The source's segment is attached once per name (``SharedKvPool.attach``: untracked, so this
process exiting never unlinks it) and cached until a checksum mismatch or ``close()``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvrelay.protocol.errors import SourceGone, TransferError
from kvrelay.transport.base import KvTransport, PullSpec
from kvrelay.transport.blocks import paired_runs
from kvrelay.transport.checksum import SlabCache, pool_slabs
from kvrelay.transport.copier import SlabCopier
from kvrelay.transport.shm_pool import SharedKvPool

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvrelay.protocol.messages import KvLayout

logger = logging.getLogger(__name__)


class ShmTransport(KvTransport):
    """Pulls from a same-host source's ``SharedKvPool`` (``PeerInfo.kv_segment``); CPU pools.

    ``timeout`` bounds nothing here beyond the lease: the copy is local and finite.
    """

    name = "shm"

    def __init__(self) -> None:
        self._attached: dict[str, tuple[SharedKvPool, np.ndarray]] = {}
        self._dst_slabs = SlabCache()
        self._copier = SlabCopier()

    def _copy(
        self,
        spec: PullSpec,
        dst_pool: torch.Tensor,
        dst_block_ids: Sequence[int],
        timeout: float,
    ) -> int:
        segment = spec.src.kv_segment
        if not segment:
            raise TransferError(f"{spec.request_id}: {spec.src.instance_id} shares no KV segment")
        src_slabs = self._source_slabs(segment, spec.src.layout)
        runs = paired_runs(spec.src_block_ids, dst_block_ids)
        return self._copier.copy_and_checksum(src_slabs, self._dst_slabs.get(dst_pool), runs)

    def _on_mismatch(self, spec: PullSpec) -> None:
        if spec.src.kv_segment:
            self._forget(spec.src.kv_segment)  # a restarted peer may have replaced the segment

    def close(self) -> None:
        for segment in list(self._attached):
            self._forget(segment)
        self._dst_slabs.clear()
        self._copier.close()

    def _source_slabs(self, segment: str, layout: KvLayout) -> np.ndarray:
        cached = self._attached.get(segment)
        if cached is not None and cached[0].layout == layout:
            return cached[1]
        if cached is not None:
            self._forget(segment)
        try:
            pool = SharedKvPool.attach(segment, layout)
        except FileNotFoundError:
            raise SourceGone(f"segment {segment} no longer exists") from None
        slabs = pool_slabs(pool.tensor)
        self._attached[segment] = (pool, slabs)
        logger.debug("attached %s", segment)
        return slabs

    def _forget(self, segment: str) -> None:
        cached = self._attached.pop(segment, None)
        if cached is not None:
            cached[0].close()
