"""Connects the engine's device KV pool to the cache tiers below it.

Read side (``PrefixLoader`` for the scheduler): at admission, the blocks after the
device-cached prefix are fetched from the tiers and copied into freshly allocated blocks,
which then count as computed. Write side: blocks the block manager newly cached (full and
computed) are copied out and offered to the tiers, after the step's tokens were sent.

A stored block's payload is its ``[num_layers, 2, block_size, kv_heads, head_dim]`` bytes.

On a CUDA pool the tiers still live in host memory: a write stacks the fetched payloads and
copies them to the device in one copy (scattered into their blocks by ``index_copy_``); an
offload gathers the stored blocks on the device and copies them to the host in one copy.
"""

from __future__ import annotations

import numpy as np
import torch

from kvrelay.cachetier.base import BlockFormat
from kvrelay.cachetier.block_hash import BlockHash
from kvrelay.cachetier.manager import TieredCache
from kvrelay.engine.scheduler import ExternalPrefix
from kvrelay.transport.blocks import byte_view, gather_device_blocks, scatter_device_blocks

_RECENT_LOADS = 4096


def block_format(kv_cache: torch.Tensor, dtype: str) -> BlockFormat:
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return BlockFormat(num_layers, block_size, num_kv_heads, head_dim, dtype)


class TierConnector:
    def __init__(self, tiers: TieredCache, kv_cache: torch.Tensor, dtype: str) -> None:
        self.tiers = tiers
        self.format = block_format(kv_cache, dtype)
        self._pool = kv_cache
        self._block_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
        # [layers, 2, num_blocks, block_bytes] numpy view on CPU; None for a GPU pool
        self._view = byte_view(kv_cache) if kv_cache.device.type == "cpu" else None
        self._loaded: dict[BlockHash, None] = {}  # recently loaded from a tier: not offered back

    # ------------------------------------------------------------------ read
    def fetch(self, keys: list[BlockHash], start_block: int) -> ExternalPrefix | None:
        hit = self.tiers.fetch(keys)
        if not hit.payloads:
            return None
        for key in keys[: len(hit.payloads)]:
            self._remember(key)
        return ExternalPrefix(start_block, len(hit.payloads), hit.blocks_by_tier, hit.payloads)

    def write(self, prefix: ExternalPrefix, block_ids: list[int]) -> None:
        if self._view is None:
            n = min(len(block_ids), len(prefix.payloads))
            slabs = np.stack([p.reshape(-1, self._block_bytes) for p in prefix.payloads[:n]], 1)
            scatter_device_blocks(self._pool, block_ids[:n], slabs)  # [2L, n, block_bytes]
            return
        num_layers = self._view.shape[0]
        for block_id, payload in zip(block_ids, prefix.payloads):
            self._view[:, :, block_id] = payload.reshape(num_layers, 2, -1)

    # ------------------------------------------------------------------ write
    def offload(self, stored: list[tuple[BlockHash, int]]) -> int:
        """Offers newly cached device blocks to the tiers; returns how many were offered."""
        wanted = [(key, block_id) for key, block_id in stored if key not in self._loaded]
        if not wanted:
            return 0
        if self._view is None:
            gathered = gather_device_blocks(self._pool, [b for _, b in wanted]).numpy()
            blocks = [gathered[:, :, j] for j in range(len(wanted))]
        else:
            blocks = [self._view[:, :, block_id] for _, block_id in wanted]
        self.tiers.store(
            [(key, np.ascontiguousarray(b).reshape(-1)) for (key, _), b in zip(wanted, blocks)]
        )
        return len(wanted)

    def _remember(self, key: BlockHash) -> None:
        self._loaded[key] = None
        if len(self._loaded) > _RECENT_LOADS:
            del self._loaded[next(iter(self._loaded))]
