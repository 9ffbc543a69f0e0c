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
output).

Steps a decode graph cannot hold (prompt chunks, alone or beside decode tokens; decode batches
over the largest size) replay a graph per padded token count (``TOKEN_SIZES``) too: the whole
step (``StepGraphs``), attention inside, reading the step's metadata from static buffers whose
padding reads and writes nothing (its class docstring says how). A SmolLM2-135M mixed step on
an H200 launched ~580 kernels from Python eagerly, 19.5 ms; as one graph it is 5.0 ms
(BENCHMARKS "Prompt and mixed steps on a GPU"). With SDPA's prefill
(``KVRELAY_TRITON_PREFILL=0``: a launch per segment, which no graph holds) ``LayerGraphs``
captures the rest in pieces: the embedding and the first layer up to attention, then per
layer the part after its attention and the next layer's part before, and the last layer's
rest. A step copies its token ids and positions into static buffers and replays the pieces,
running each layer's attention eagerly between them over the real tokens only; padding rows
compute on stale ids and never reach attention or the pool (around Triton's prefill, pieces
took 6.3 ms). The pieces' intermediates live in a pool of their own, reused by every piece:
each piece copies what the next reads into the static buffers.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import gc
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvrelay.engine.models.llama import LlamaModel
from kvrelay.kernels.attention import AttentionMetadata, paged_attention
from kvrelay.kernels.cpu_attention import NativeDecode, table_width
from kvrelay.kernels.triton_attention import PrefillBatch

logger = logging.getLogger(__name__)

BATCH_SIZES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# padded token counts of ``LayerGraphs``: a step of more tokens than the largest size that
# ``max_num_batched_tokens`` needs runs eagerly; from 32 on, sizes grow by at most half
TOKEN_SIZES = (16, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1280, 1536, 1792, 2048,
               2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192)  # fmt: skip


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """Python's cyclic collector off for the block, back as it was after.

    ``torch.cuda.graph`` collects before its capture begins; a collection inside the capture
    (triggered by the capture's own Python allocations) can free an old engine's graphs, and
    destroying a graph is an operation a capture forbids: the capture is invalidated and fails
    at a later launch ("operation failed due to a previous error during capture", seen on an
    H200 with the engines of earlier tests awaiting collection)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _graph(graph: torch.cuda.CUDAGraph, pool: Any) -> contextlib.AbstractContextManager[Any]:
    """A capture into ``graph`` (``pool``: the memory pool it shares), ``thread_local``: a
    worker's transport threads keep copying KV on their own streams meanwhile."""
    return torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local")


def _record(
    call: Callable[[], Any], pool: Any, device: torch.device, warm: bool = True
) -> tuple[Any, Any]:
    """``(graph, output)`` of ``call`` captured into ``pool``; ``warm``: after one eager run
    on a side stream of ``device``, which compiles the kernels and makes cuBLAS's workspace."""
    if warm:
        _warm(device, call)
    graph = torch.cuda.CUDAGraph()
    with no_collection(), _graph(graph, pool):
        out = call()
    return graph, out


def _warm(device: torch.device, *calls: Callable[[], Any]) -> None:
    """Runs ``calls`` once, eagerly, on a side stream of ``device``, before they are captured."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)


def _capture_each(
    sizes: tuple[int, ...], done: Any, capture: Callable[[int], Any], what: str
) -> None:
    """Captures every size of ``sizes`` not in ``done``, largest first (the pool grows once)."""
    started, todo = time.perf_counter(), [s for s in sizes if s not in done]
    for size in reversed(todo):
        capture(size)
    if todo:
        logger.info("captured %s for %d sizes (%d-%d) in %.2f s", what, len(todo), todo[0],
                    todo[-1], time.perf_counter() - started)  # fmt: skip


def padded(sizes: tuple[int, ...], n: int) -> int:
    """The smallest of the captured ``sizes`` that holds ``n`` (the caller checked one does)."""
    return sizes[bisect.bisect_left(sizes, n)]


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
        size = padded(self.sizes, n)
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
        self.slots.fill_(-1)
        self.ctx_lens.zero_()
        _capture_each(self.sizes, self.graphs, self._capture, "decode graphs")

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            native_decode=NativeDecode(self.rows[:size], self.tables[:size], self.ctx_lens[:size]),
            window=self.window,
        )
        args = (self.input_ids[:size], self.positions[:size], self.kv_cache, meta)
        forward = functools.partial(self.model.forward, *args)
        graph, self.outputs[size] = _record(forward, self.pool, self.kv_cache.device)
        self.pool = graph.pool()
        self.graphs[size] = graph
        logger.debug(
            "captured the decode step for %d sequences in %.0f ms",
            size,
            1000 * (time.perf_counter() - started),
        )
        return graph


def token_sizes(max_tokens: int) -> tuple[int, ...]:
    """``LayerGraphs``' sizes: every size up to the first that holds ``max_tokens`` (at most
    ``TOKEN_SIZES[-1]``)."""
    i = bisect.bisect_left(TOKEN_SIZES, max_tokens)
    return TOKEN_SIZES[: i + 1]


class LayerGraphs:
    """The forward around attention as CUDA graphs per padded token count (module docstring).

    ``capture=False`` runs the same pieces eagerly, through the same static buffers: the CPU
    test of what the graphs replay (a CUDA pool captures)."""

    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, max_tokens: int,
                 capture: bool = True) -> None:  # fmt: skip
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV pool, not one on {kv_cache.device}")
        self.model, self.kv_cache, self.capture = model, kv_cache, capture
        cfg = model.config
        self.sizes = token_sizes(max_tokens)
        size, device, dtype = self.sizes[-1], kv_cache.device, model.dtype
        hd = cfg.head_dim
        self.input_ids = torch.zeros(size, dtype=torch.long, device=device)
        self.positions = torch.zeros(size, dtype=torch.long, device=device)
        self.cos = torch.zeros(size, 1, hd // 2, dtype=dtype, device=device)
        self.sin = torch.zeros(size, 1, hd // 2, dtype=dtype, device=device)
        self.x = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)  # residual
        self.q = torch.zeros(size, cfg.num_heads, hd, dtype=dtype, device=device)
        self.k = torch.zeros(size, cfg.num_kv_heads, hd, dtype=dtype, device=device)
        self.v = torch.zeros(size, cfg.num_kv_heads, hd, dtype=dtype, device=device)
        self.attn = torch.zeros(size, cfg.num_heads, hd, dtype=dtype, device=device)
        self.out = torch.zeros(size, cfg.hidden_size, dtype=dtype, device=device)
        self.pieces: dict[int, list[Callable[[], Any]]] = {}  # size -> replays, in order
        self.pool: Any = None  # the pieces' shared memory pool (a handle from the first capture)
        self.replays = 0  # steps served by the pieces (tests, stats)

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a step of ``n`` tokens (``fits``), the pieces
        replayed and each layer's attention run between them.

        The rows are a view of a static buffer: read them before the next step runs."""
        n = input_ids.numel()
        size = padded(self.sizes, n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        pieces = self.pieces.get(size) or self._capture(size)
        model, q, k, v, attn = self.model, self.q[:n], self.k[:n], self.v[:n], self.attn[:n]
        pieces[0]()
        for i, piece in enumerate(pieces[1:]):
            paged_attention(q, k, v, self.kv_cache[i], meta, model.scale, out=attn)
            piece()
        self.replays += 1
        return self.out[:n]

    def capture_all(self) -> None:
        """Captures every size not captured yet, largest first."""
        _capture_each(self.sizes, self.pieces, self._capture, "the layers around attention")

    # the pieces: each reads the static buffers' first ``t`` rows and writes what the next
    # reads (attention's q, k, v; the residual x; after the last layer, ``out``)
    def _first(self, t: int) -> None:
        x, cos, sin = self.model.embed(self.input_ids[:t], self.positions[:t])
        self.cos[:t].copy_(cos)
        self.sin[:t].copy_(sin)
        self._enter(0, x, None, t)

    def _after(self, i: int, t: int) -> None:
        """Layer ``i`` after its attention, and the next layer up to its attention."""
        x, delta = self.model.layer_out(i, self.x[:t], self.attn[:t])
        if i + 1 < self.model.config.num_layers:
            self._enter(i + 1, x, delta, t)
        else:
            torch.add(x, delta, out=self.out[:t])

    def _enter(self, i: int, x: torch.Tensor, delta: torch.Tensor | None, t: int) -> None:
        x, q, k, v = self.model.layer_in(i, x, delta, self.cos[:t], self.sin[:t])
        for buf, value in ((self.x, x), (self.q, q), (self.k, k), (self.v, v)):
            if buf.data_ptr() != value.data_ptr():  # in place already on CPU's native path
                buf[:t].copy_(value)

    @torch.inference_mode()
    def _capture(self, size: int) -> list[Callable[[], Any]]:
        started = time.perf_counter()
        layers = self.model.config.num_layers
        steps: list[Callable[[], Any]] = [functools.partial(self._first, size)]
        steps += [functools.partial(self._after, i, size) for i in range(layers)]
        if not self.capture:
            self.pieces[size] = steps
            return steps
        _warm(self.kv_cache.device, *steps)  # in order: each reads what the last wrote
        replays = []
        for step in steps:
            graph, _ = _record(step, self.pool, self.kv_cache.device, warm=False)
            self.pool = graph.pool()
            replays.append(graph.replay)
        self.pieces[size] = replays
        logger.debug("captured %d pieces for %d tokens in %.0f ms", len(replays), size,
                     1000 * (time.perf_counter() - started))  # fmt: skip
        return replays


class StepGraphs:
    """Whole prompt and mixed steps as CUDA graphs, one per padded token count, attention
    inside (module docstring).

    A graph of ``T`` tokens runs ``T + 1`` rows; row ``T`` is scratch. Its attention reads the
    step's metadata from static buffers whose padding reads and writes nothing the step
    owns: padding tokens have slot -1 (the store skips them); padding decode rows have
    context 0 and point at the scratch row (they write zeros there, and nothing else);
    padding prefill tiles have no rows. Every launch's grid is fixed by ``T``: the decode
    kernel's ``T + 1`` rows and split count, and the prefill kernel's most tiles that ``T``
    tokens in at most ``max_num_seqs`` segments can make. Padding token rows are computed
    on stale inputs but are never attended to and never stored, and no op mixes rows.

    ``capture=False`` runs the same padded step eagerly (the CPU test of what the graphs
    replay; a CUDA pool captures)."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        max_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        tile_tokens: int,
        window: int | None,
        capture: bool = True,
    ) -> None:
        if capture and kv_cache.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA KV pool, not one on {kv_cache.device}")
        self.model, self.kv_cache, self.window, self.capture = model, kv_cache, window, capture
        self.sizes = token_sizes(max_tokens)
        self.max_num_seqs, self.tile_tokens = max_num_seqs, tile_tokens
        rows, device = self.sizes[-1] + 1, kv_cache.device
        self.width = table_width(max_blocks_per_seq)  # as eager's tables, a multiple of 16
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slots = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.rows = torch.zeros(rows, dtype=torch.long, device=device)  # decode rows
        self.ctx_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.tables = torch.zeros(rows, self.width, dtype=torch.int32, device=device)
        top = self.sizes[-1]
        self.tiles = torch.zeros(self.max_tiles(top), 4, dtype=torch.int32, device=device)
        self.prefill_tables = torch.zeros(self.max_segments(top), self.width, dtype=torch.int32,
                                          device=device)  # fmt: skip
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}  # None: eager (capture=False)
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool: Any = None
        self.replays = 0  # steps served by a graph (tests, stats)

    def max_segments(self, size: int) -> int:
        return min(size, self.max_num_seqs)

    def max_tiles(self, size: int) -> int:
        """Tiles of ``size`` tokens in at most ``max_segments`` segments: each segment's
        last tile may be partial."""
        return -(-size // self.tile_tokens) + self.max_segments(size)

    def fits(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """True when a graph can hold this step: at most the largest size's tokens, attention
        in the Triton kernels alone, and tables and tiles within the static buffers."""
        if num_tokens > self.sizes[-1] or meta.prefills or meta.decode:
            return False
        size = padded(self.sizes, num_tokens)
        batch, prefill = meta.native_decode, meta.native_prefill
        if batch is not None and batch.row_table is not None:  # CPU's prefill rows
            return False
        if batch is not None and batch.tables.shape[1] > self.width:
            return False
        if prefill is not None:
            if prefill.tile_tokens != self.tile_tokens or prefill.tables.shape[1] > self.width:
                return False
            if prefill.tiles.shape[0] > self.max_tiles(size):
                return False
            if prefill.tables.shape[0] > self.max_segments(size):
                return False
        return True

    @torch.inference_mode()
    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of a step that ``fits``, through its size's graph.

        The rows are a view of the graph's output: read them before the next step runs."""
        n = input_ids.numel()
        size = padded(self.sizes, n)
        if size not in self.graphs:
            self._capture(size)  # first: the capture leaves the buffers as padding
        end = size + 1
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.slots[n:end].fill_(-1)
        batch, decoded = meta.native_decode, 0
        if batch is not None:
            decoded = batch.rows.numel()
            self.rows[:decoded].copy_(batch.rows)
            self.ctx_lens[:decoded].copy_(batch.ctx_lens)
            self.tables[:decoded, : batch.tables.shape[1]].copy_(batch.tables)
        self.rows[decoded:end].fill_(size)  # the scratch row
        self.ctx_lens[decoded:end].zero_()
        prefill, tiles = meta.native_prefill, 0
        if prefill is not None:
            tiles, segments = prefill.tiles.shape[0], prefill.tables.shape[0]
            self.tiles[:tiles].copy_(prefill.tiles)
            self.prefill_tables[:segments, : prefill.tables.shape[1]].copy_(prefill.tables)
        self.tiles[tiles : self.max_tiles(size)].zero_()
        graph = self.graphs[size]
        if graph is None:
            self.outputs[size] = self.model.forward(*self._args(size))
        else:
            graph.replay()
        self.replays += 1
        return self.outputs[size][:n]

    def capture_all(self) -> None:
        """Captures every size not captured yet, largest first, on padding alone."""
        _capture_each(self.sizes, self.graphs, self._capture, "prompt and mixed steps")

    def _args(self, size: int) -> tuple[Any, ...]:
        """The forward's arguments for ``size`` tokens (and the scratch row), all static."""
        end = size + 1
        tiles, tables = self.tiles[: self.max_tiles(size)], self.prefill_tables
        meta = AttentionMetadata(
            slot_mapping=self.slots[:end],
            native_decode=NativeDecode(self.rows[:end], self.tables[:end], self.ctx_lens[:end]),
            native_prefill=PrefillBatch(tiles, tables[: self.max_segments(size)], self.tile_tokens),
            window=self.window,
        )
        return self.input_ids[:end], self.positions[:end], self.kv_cache, meta

    def _capture(self, size: int) -> None:
        """Captures ``size``'s graph on padding alone (slot -1, context 0, no tile rows):
        nothing is read from or written to any sequence's blocks."""
        end = size + 1
        self.slots[:end].fill_(-1)
        self.rows[:end].fill_(size)
        self.ctx_lens[:end].zero_()
        self.tiles[: self.max_tiles(size)].zero_()
        if not self.capture:
            self.graphs[size] = None
            return
        started, args = time.perf_counter(), self._args(size)
        forward = functools.partial(self.model.forward, *args)
        graph, self.outputs[size] = _record(forward, self.pool, self.kv_cache.device)
        self.pool = graph.pool()
        self.graphs[size] = graph
        logger.debug("captured the step of %d tokens in %.0f ms", size,
                     1000 * (time.perf_counter() - started))  # fmt: skip
