"""CUDA graphs for decode-only steps on a GPU.

A decode step of a small model is hundreds of short kernels (a few per layer for norms,
rotary, the projections, attention and the MLP); launched one by one from Python, the launches
take longer than the kernels. A CUDA graph records the whole forward once and replays it with
one launch. Graphs need fixed shapes and addresses, so a step's inputs are copied into static
buffers sized for the largest batch, and the batch is padded up to the nearest captured size
(``BATCH_SIZES``): padding rows have context length 0 (attention reads nothing and writes
zeros) and slot -1 (their K/V are not stored), so they touch no sequence's blocks. Attention
is the Triton kernel (``kernels.triton_attention``), whose launch shape depends only on the
batch size, and block tables are padded to the longest a sequence can have.

The engine's warm-up captures every size, largest first, on padding rows alone (context 0,
slot -1: nothing is read or written) before the engine serves (``capture_all``); a size not
yet captured (an engine that skipped its warm-up) is captured on its first step. Each capture
follows one eager run of the same inputs that compiles the Triton kernels and sets up cuBLAS.
Captures use ``thread_local`` error mode: a worker's transport threads keep copying KV on
their own streams meanwhile, and only this thread's calls must be capture-safe. All graphs
share one memory pool: safe because replays never overlap and a step reads its output before
the next replay (a later graph may reuse an earlier one's intermediate memory, never a live
output). Prefill and mixed steps stay eager.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import torch

from kvrelay.engine.models.llama import LlamaModel
from kvrelay.kernels.attention import AttentionMetadata
from kvrelay.kernels.cpu_attention import NativeDecode, table_width

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The captured sizes: every size up to the first that holds ``max_num_seqs``."""
    i = bisect.bisect_left(BATCH_SIZES, max_num_seqs)
    if i < len(BATCH_SIZES):
        return BATCH_SIZES[: i + 1]
    return (*BATCH_SIZES, max_num_seqs)


class DecodeGraphs:
    """One CUDA graph of the model's forward per padded decode batch size."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        window: int | None,
    ) -> None:
        if kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV pool, not one on {kv_cache.device}")
        self.model = model
        self.kv_cache = kv_cache
        self.window = window
        self.sizes = batch_sizes(max_num_seqs)
        size, device = self.sizes[-1], kv_cache.device
        self.max_blocks = max_blocks_per_seq = table_width(max_blocks_per_seq)  # as eager's
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.slots = torch.full((size,), -1, dtype=torch.long, device=device)
        self.rows = torch.arange(size, dtype=torch.long, device=device)
        self.tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.ctx_lens = torch.zeros(size, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None  # the graphs' shared memory pool (a handle from the first capture)
        self.replays = 0  # steps served by a graph (tests, stats)

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """True when this step is decode tokens only and a graph can hold it."""
        batch = meta.native_decode
        return (
            batch is not None
            and not meta.prefills
            and meta.native_prefill is None
            and not meta.decode
            and batch.rows.numel() == num_tokens
            and num_tokens <= self.sizes[-1]
            and batch.tables.shape[1] <= self.max_blocks
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a decode-only step (``fits``), through a graph.

        The rows are a view of the graph's output: read them before the next step runs."""
        batch = meta.native_decode
        assert batch is not None
        n = input_ids.numel()
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:size].fill_(-1)
        self.ctx_lens[:n].copy_(batch.ctx_lens)
        self.ctx_lens[n:size].zero_()
        self.tables[:n, : batch.tables.shape[1]].copy_(batch.tables)
        graph = self.graphs.get(size)
        if graph is None:
            graph = self._capture(size)
        graph.replay()
        self.replays += 1
        return self.outputs[size][:n]

    def capture_all(self) -> None:
        """Captures every size not captured yet, largest first, on padding rows alone."""
        started, todo = time.perf_counter(), [s for s in self.sizes if s not in self.graphs]
        self.slots.fill_(-1)
        self.ctx_lens.zero_()
        for size in reversed(todo):
            self._capture(size)
        if todo:
            logger.info(
                "captured %d decode graphs (batch sizes %d-%d) in %.2f s",
                len(todo), todo[0], todo[-1], time.perf_counter() - started,
            )  # fmt: skip

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            native_decode=NativeDecode(self.rows[:size], self.tables[:size], self.ctx_lens[:size]),
            window=self.window,
        )
        args = (self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        # one eager run off the capture: compiles the kernels, makes cuBLAS's workspace
        side = torch.cuda.Stream(self.kv_cache.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.model.forward(*args)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self.outputs[size] = self.model.forward(*args)
        self.pool = graph.pool()
        self.graphs[size] = graph
        logger.debug(
            "captured the decode step for %d sequences in %.0f ms",
            size,
            1000 * (time.perf_counter() - started),
        )
        return graph
