"""KV pool geometry: shapes, dtypes, byte views and runs of consecutive block ids.

A pool is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``; block ``b`` of
layer ``l``, K (0) or V (1), is the contiguous slab ``pool[l, kv, b]``, and a run of
consecutive ids ``b .. b+n-1`` is one contiguous slab ``pool[l, kv, b:b+n]``::

    byte view [L, 2, num_blocks, block_bytes]      (block_bytes = block_size*heads*dim*elsize)
    ids [7, 8, 9, 2, 3]  ->  runs [(7, 3), (2, 2)]
    src [7, 8, 9, 2, 3] / dst [0, 1, 5, 6, 7]  ->  copies [(7, 0, 2), (9, 5, 1), (2, 6, 2)]
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvrelay.protocol.messages import KvLayout

DTYPE_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}

logger = logging.getLogger(__name__)


class Run(NamedTuple):
    """``length`` consecutive blocks from ``src_start`` copied to ``dst_start`` onward."""

    src_start: int
    dst_start: int
    length: int


def pool_shape(layout: KvLayout) -> tuple[int, int, int, int, int, int]:
    return (
        layout.num_layers,
        2,
        layout.num_blocks,
        layout.block_size,
        layout.num_kv_heads,
        layout.head_dim,
    )


def block_bytes(layout: KvLayout) -> int:
    """Bytes of one block of one layer, K or V."""
    return layout.block_size * layout.num_kv_heads * layout.head_dim * dtype_size(layout.dtype)


def pool_bytes(layout: KvLayout) -> int:
    return layout.num_layers * 2 * layout.num_blocks * block_bytes(layout)


def transfer_bytes(layout: KvLayout, num_blocks: int) -> int:
    """Bytes a transfer of ``num_blocks`` blocks moves (every layer, K and V)."""
    return layout.num_layers * 2 * num_blocks * block_bytes(layout)


def dtype_size(dtype: str) -> int:
    try:
        return DTYPE_SIZES[dtype]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {dtype!r}; choose one of {sorted(DTYPE_SIZES)}"
        ) from None


def torch_dtype(dtype: str) -> torch.dtype:
    import torch

    dtype_size(dtype)
    return getattr(torch, dtype)


def layout_of(pool: torch.Tensor) -> KvLayout:
    """The layout of an existing pool tensor."""
    from kvrelay.protocol.messages import KvLayout

    num_layers, two, num_blocks, block_size, num_kv_heads, head_dim = pool.shape
    if two != 2:
        raise ValueError(f"pool dim 1 must be 2 (K, V), got shape {tuple(pool.shape)}")
    dtype = str(pool.dtype).removeprefix("torch.")
    return KvLayout(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype)


def byte_view(pool: torch.Tensor) -> np.ndarray:
    """``[L, 2, num_blocks, block_bytes]`` uint8 numpy view sharing the CPU pool's memory."""
    import torch

    if pool.device.type != "cpu" or not pool.is_contiguous():
        raise ValueError(
            f"need a contiguous CPU pool, got {pool.device} contiguous={pool.is_contiguous()}"
        )
    num_layers, _, num_blocks = pool.shape[:3]
    return pool.view(torch.uint8).view(num_layers, 2, num_blocks, -1).numpy()


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, length)`` of each maximal run of consecutive ids, in list order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[Run]:
    """Maximal runs consecutive on both sides: each is one slab-to-slab copy, in list order."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
    runs: list[Run] = []
    start = 0
    for end in range(1, len(src_ids) + 1):
        if (
            end == len(src_ids)
            or src_ids[end] != src_ids[end - 1] + 1
            or dst_ids[end] != dst_ids[end - 1] + 1
        ):
            runs.append(Run(src_ids[start], dst_ids[start], end - start))
            start = end
    return runs


def split_runs(runs: Sequence[Run], max_blocks: int) -> list[Run]:
    """The same copies cut into pieces of at most ``max_blocks`` blocks (cache-sized chunks)."""
    pieces: list[Run] = []
    for run in runs:
        for offset in range(0, run.length, max_blocks):
            length = min(max_blocks, run.length - offset)
            pieces.append(Run(run.src_start + offset, run.dst_start + offset, length))
    return pieces


class PinnedStaging:
    """A reusable page-locked host buffer for device -> host copies of KV blocks.

    Copies from a GPU into pageable memory go through the driver's own bounce buffer and run
    at a fraction of the link's rate; into page-locked memory they are one DMA. Allocating
    page-locked memory is slow, so the buffer is kept and grows to the largest copy asked
    for. What ``get`` returns is valid until the next ``get``: callers use it synchronously.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, num_bytes: int) -> torch.Tensor:
        """A uint8 host tensor of ``num_bytes`` (pinned where CUDA allows, else pageable)."""
        import torch

        if self._buffer is None or self._buffer.numel() < num_bytes:
            self._buffer = None  # the old buffer is freed before the larger one is allocated
            try:
                self._buffer = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:  # no CUDA here, or no page-locked memory left
                logger.warning("staging %d bytes in pageable memory: %s", num_bytes, e)
                self._buffer = torch.empty(num_bytes, dtype=torch.uint8)
        return self._buffer[:num_bytes]


def gather_device_blocks(
    pool: torch.Tensor, block_ids: Sequence[int], staging: PinnedStaging | None = None
) -> torch.Tensor:
    """``[L, 2, n, block_bytes]`` uint8 host copy of a device pool's blocks, in ``block_ids``
    order: one gather on the device, one copy to the host (which waits for the kernels that
    wrote them). With ``staging`` the copy lands in its pinned buffer (valid until its next
    use); without, in a new tensor the caller owns."""
    import torch

    num_layers, _, num_blocks = pool.shape[:3]
    view = pool.view(torch.uint8).view(num_layers, 2, num_blocks, -1)
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    gathered = view.index_select(2, ids)
    if staging is None:
        return gathered.cpu()
    out = staging.get(gathered.numel()).view(gathered.shape)
    out.copy_(gathered)
    return out


def scatter_device_blocks(pool: torch.Tensor, block_ids: Sequence[int], slabs: np.ndarray) -> None:
    """Copies ``slabs`` (``[2L, n, block_bytes]`` uint8, host) into a device pool's blocks
    ``block_ids``: one copy to the device, one scatter there; returns once it is done."""
    import torch

    num_layers, _, num_blocks = pool.shape[:3]
    view = pool.view(torch.uint8).view(num_layers, 2, num_blocks, -1)
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=pool.device)
    src = torch.from_numpy(slabs).view(num_layers, 2, len(block_ids), -1).to(pool.device)
    view.index_copy_(2, ids, src)
    if pool.is_cuda:
        torch.cuda.current_stream(pool.device).synchronize()
