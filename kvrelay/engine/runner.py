"""Runs one step: flattens the plan into one batch, runs the model, samples.

The runner owns the KV pool tensor ``[layers, 2, num_blocks, block_size, kv_heads,
head_dim]``; block ids come from the scheduler's plan and are never chosen here. The step's
metadata is built on the host and moved to the pool's device once per step (a no-op on CPU).

Threads on CPU: a step of at most ``model.native_rows`` tokens (decode) runs torch's ops on one
thread while the native matmul kernel streams the weights on all of the engine's threads;
larger steps (prefill) give torch all of them. The ops between a decode step's matmuls are
too small to gain from a second thread, and each of torch's parallel regions would wake its
OpenMP team (or find it spinning on the core the kernel's pool needs).

On a GPU, decode tokens attend in the Triton kernel (``kernels.triton_attention``) and decode-
only steps replay CUDA graphs (``engine.cuda_graphs``; ``KVRELAY_CUDA_GRAPHS=0``: eager); other
steps of up to ``max_num_batched_tokens`` replay graphs per padded token count, the whole step
(``StepGraphs``) or with SDPA's prefill the layers around attention (``LayerGraphs``;
``KVRELAY_MIXED_GRAPHS=0``: eager); a step's prefill segments become one ``PrefillBatch``
(query tiles, two int32 tensors) that each layer's attention takes in one launch, not a
``PrefillSegment`` (metadata copied and an SDPA launched per segment and layer;
``KVRELAY_TRITON_PREFILL=0`` keeps those).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvrelay import envs
from kvrelay.engine.config import ModelConfig
from kvrelay.engine.cuda_graphs import DecodeGraphs, LayerGraphs, StepGraphs
from kvrelay.engine.lora import LoRABatch
from kvrelay.engine.models.llama import LlamaModel
from kvrelay.engine.pooling import pool_step
from kvrelay.engine.sampling import Sampler, SampleRequest, create_generator, token_logprobs
from kvrelay.engine.scheduler import ScheduledSeq, StepPlan, StepResult
from kvrelay.engine.sequence import Sequence
from kvrelay.engine.spec_decode import accepted
from kvrelay.engine.structured import draft_masks
from kvrelay.kernels import cpu_attention, gemv, triton_attention
from kvrelay.kernels.attention import (
    AttentionMetadata,
    PrefillSegment,
    Workspace,
    causal_mask,
    decode_groups,
)

# rows of prompt logits computed at a time: 256 x SmolLM2's 49,152 in float32 is 50 MB
PROMPT_LOGPROB_ROWS = 256


def kv_cache_shape(config: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """``[layers, 2, num_blocks, block_size, kv_heads, head_dim]``."""
    return (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)


class ModelRunner:
    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.window = model.config.sliding_window
        self.workspace = Workspace()  # context-gather buffers, reused by every step
        heads = model.config.num_heads
        self.native_attention = cpu_attention.supports(kv_cache, heads) or (
            triton_attention.supports(kv_cache, heads)
            and bool(envs.get("KVRELAY_NATIVE_ATTENTION"))
        )
        # CPU: prefill segments of up to this many tokens attend in the native kernel too, one
        # row a token (cpu_attention.prefill_limit says why the limit); 0 elsewhere
        self.native_prefill_tokens = 0
        if self.native_attention and self.device.type == "cpu":
            self.native_prefill_tokens = cpu_attention.prefill_limit(kv_cache)
        # CUDA: the tokens of a prefill tile (triton_attention.prefill_tile_tokens); 0 elsewhere
        self.prefill_tile_tokens = 0
        on_cuda = self.native_attention and self.device.type == "cuda"
        if on_cuda and envs.get("KVRELAY_TRITON_PREFILL"):
            q_per_kv = heads // model.config.num_kv_heads
            self.prefill_tile_tokens = triton_attention.prefill_tile_tokens(q_per_kv)
        self.threads = torch.get_num_threads()
        # decode steps: torch on one thread, the native matmuls on all (module docstring)
        self.narrow_decode = self.device.type == "cpu" and self.threads > 1 and gemv.available()
        if self.narrow_decode:
            gemv.set_threads(self.threads)
        self.native_library = self.device.type == "cpu" and gemv.available()
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and self.native_attention and envs.get("KVRELAY_CUDA_GRAPHS"):
            max_len = max_model_len or model.config.max_position_embeddings
            max_blocks = min(kv_cache.shape[2], -(-max_len // block_size))
            self.graphs = DecodeGraphs(model, kv_cache, max_num_seqs, max_blocks, self.window)
        # prompt and mixed steps: whole-step graphs with Triton's prefill, else the layers
        # around attention (SDPA per segment cannot be captured)
        self.step_graphs: StepGraphs | None = None
        self.layer_graphs: LayerGraphs | None = None
        if self.graphs is not None and envs.get("KVRELAY_MIXED_GRAPHS"):
            if self.prefill_tile_tokens:
                self.step_graphs = StepGraphs(
                    model, kv_cache, max_num_batched_tokens, max_num_seqs, max_blocks,
                    self.prefill_tile_tokens, self.window,
                )  # fmt: skip
            else:
                self.layer_graphs = LayerGraphs(model, kv_cache, max_num_batched_tokens)

    def compile_kernels(self) -> None:
        """On a GPU, every variant of the Triton kernels an eager step may launch, compiled
        now rather than mid-serving (``triton_attention.compile_variants``)."""
        if self.device.type == "cuda" and self.native_attention:
            heads = self.model.config.num_heads
            triton_attention.compile_variants(self.kv_cache[0], heads, self.window)

    def run(self, plan: StepPlan) -> StepResult:
        if all(item.seq.lora is None for item in plan.scheduled):
            return self._run_plan(plan, None)  # the base alone
        order = _by_adapter(plan)
        if order is None:
            return self._run_plan(plan, _lora_batch(plan))
        # each adapter's rows one span (LoRABatch); the results go back in the plan's order
        plan = replace(plan, scheduled=tuple(plan.scheduled[i] for i in order))
        result = self._run_plan(plan, _lora_batch(plan))
        token_ids: list[list[int]] = [[] for _ in order]
        logprobs: list[list] = [[] for _ in order]
        for j, i in enumerate(order):
            token_ids[i], logprobs[i] = result.token_ids[j], result.logprobs[j]
        return StepResult(token_ids, logprobs)

    def _run_plan(self, plan: StepPlan, lora: LoRABatch | None) -> StepResult:
        input_ids, positions, meta, sample_rows = self._prepare(plan.scheduled)
        narrow = self.narrow_decode and input_ids.numel() <= self.model.native_rows
        if self.native_library:  # its jobs share torch's OpenMP team where torch runs wide
            gemv.use_openmp(not narrow)
        if narrow:
            torch.set_num_threads(1)
        try:
            return self._run(plan, input_ids, positions, meta, sample_rows, lora)
        finally:
            if narrow:
                torch.set_num_threads(self.threads)

    def _run(
        self,
        plan: StepPlan,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        sample_rows: torch.Tensor,
        lora: LoRABatch | None,
    ) -> StepResult:
        n = input_ids.numel()
        if lora is not None:  # the graphs hold the base weights only
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta, lora)
        elif self.graphs is not None and self.graphs.fits(n, meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        elif self.step_graphs is not None and self.step_graphs.fits(n, meta):
            hidden = self.step_graphs.run(input_ids, positions, meta)
        elif self.layer_graphs is not None and self.layer_graphs.fits(n):
            hidden = self.layer_graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model.forward(input_ids, positions, self.kv_cache, meta)
        if any(item.seq.params.prompt_logprobs is not None for item in plan.scheduled):
            self._prompt_logprobs(plan, hidden)
        if any(item.seq.pool is not None for item in plan.scheduled):
            pool_step(self.model, plan, hidden)
        token_ids: list[list[int]] = [[] for _ in plan.scheduled]
        logprobs: list[list] = [[] for _ in plan.scheduled]
        if sample_rows.numel():
            logits = self.model.compute_logits(hidden[sample_rows])
            requests = [
                request
                for item in plan.scheduled
                if item.needs_sample
                for request in self._sample_requests(item)
            ]
            out = self.sampler(logits, requests)
            j = 0
            for i, item in enumerate(plan.scheduled):
                if not item.needs_sample:
                    continue
                rows = len(item.draft) + 1
                keep = accepted(item.draft, out.token_ids[j : j + rows]) if item.draft else 1
                token_ids[i] = out.token_ids[j : j + keep]
                logprobs[i] = out.logprobs[j : j + keep]
                for token_id in token_ids[i]:
                    _advance_grammar(item.seq, token_id)
                j += rows
        return StepResult(token_ids, logprobs)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """Appends to each sequence that asks for prompt logprobs those of the prompt tokens
        this step's chunk predicts (position p predicts token p + 1), from the raw logits,
        ``PROMPT_LOGPROB_ROWS`` rows of logits at a time. A chunk computed again (after a
        preemption) adds nothing twice."""
        row = 0
        for item in plan.scheduled:
            seq, n, k = item.seq, item.num_new_tokens, item.seq.params.prompt_logprobs
            if k is not None:
                if seq.prompt_logprobs is None:
                    seq.prompt_logprobs = [None]  # the first prompt token has none
                first = max(item.start, len(seq.prompt_logprobs) - 1)
                end = min(item.start + n, seq.num_prompt_tokens - 1)
                shift = row - item.start  # position p's row in hidden
                for a in range(first, end, PROMPT_LOGPROB_ROWS):
                    b = min(end, a + PROMPT_LOGPROB_ROWS)
                    logits = self.model.compute_logits(hidden[a + shift : b + shift])
                    targets = torch.tensor(seq.prompt_token_ids[a + 1 : b + 1], device=self.device)
                    seq.prompt_logprobs.extend(token_logprobs(logits, targets, [k] * (b - a)))
            row += n

    def compute_logits_for(self, plan: StepPlan) -> torch.Tensor:
        """Runs a step and returns the float32 logits of its sampled rows (for tests)."""
        input_ids, positions, meta, sample_rows = self._prepare(plan.scheduled)
        hidden = self.model.forward(input_ids, positions, self.kv_cache, meta, _lora_batch(plan))
        return self.model.compute_logits(hidden[sample_rows])

    # ------------------------------------------------------------------ batch
    def _prepare(
        self, scheduled: tuple[ScheduledSeq, ...]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's flat inputs and attention metadata, on the device.

        Built in Python lists and turned into tensors once each: per-sequence tensor ops
        (a position range, a block table, the slot arithmetic) cost ~25 us a sequence in
        dispatch alone, 0.9 ms of a 32-sequence decode step (a GPU step is ~3.5 ms)."""
        bs = self.block_size
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        prefills: list[PrefillSegment] = []
        # CUDA: each prefill segment's row, start, tokens and table, for Triton's kernel
        segments: list[tuple[int, int, int, list[int]]] = []
        sample_rows: list[int] = []
        # rows attending in the native kernel: decode tokens, and on CPU the tokens of
        # prefill segments short enough for it; each row's table is its sequence's
        rows: list[int] = []
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        row_table: list[int] = []
        prefill_rows = self.native_prefill_tokens if self.native_attention else 0
        decode_items = 0
        for item in scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            row = len(tokens)
            block_ids = seq.block_ids
            if n == 1:
                tokens.append(seq.token_ids[start])
                positions.append(start)
                slots.append(block_ids[start // bs] * bs + start % bs)
                row_table.append(len(tables))
                rows.append(row)
                ctx_lens.append(start + 1)
                tables.append(block_ids)
                decode_items += 1
            elif item.draft:  # the last token and the draft: decode rows, each its own table
                tokens.append(seq.token_ids[start])
                tokens.extend(item.draft)
                positions.extend(range(start, start + n))
                _extend_slots(slots, block_ids, start, n, bs)
                row_table.extend(range(len(tables), len(tables) + n))
                rows.extend(range(row, row + n))
                ctx_lens.extend(range(start + 1, start + n + 1))
                tables.extend([block_ids] * n)
                decode_items += n
            else:
                tokens.extend(seq.token_ids[start : start + n])
                positions.extend(range(start, start + n))
                _extend_slots(slots, block_ids, start, n, bs)
                if n <= prefill_rows:
                    row_table.extend([len(tables)] * n)
                    rows.extend(range(row, row + n))
                    ctx_lens.extend(range(start + 1, start + n + 1))
                    tables.append(block_ids[: -(-(start + n) // bs)])
                elif self.prefill_tile_tokens:
                    segments.append((row, start, n, block_ids[: -(-(start + n) // bs)]))
                else:
                    prefills.append(self._prefill_segment(row, start, n, block_ids))
            if item.draft:
                sample_rows.extend(range(row, row + n))
            elif item.needs_sample:
                sample_rows.append(row + n - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            prefills=prefills,
            workspace=self.workspace,
            window=self.window,
        )
        if segments:
            meta.native_prefill = triton_attention.make_prefill(segments, self.prefill_tile_tokens)
        if rows and self.native_attention:
            shared = len(rows) != decode_items  # prefill rows share their sequence's table
            meta.native_decode = cpu_attention.make_decode(
                rows, ctx_lens, tables, row_table if shared else None
            )
        elif rows:
            meta.decode = decode_groups(rows, ctx_lens, tables, self.block_size, self.window)
        device = self.device
        return (
            torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True),
            torch.tensor(positions, dtype=torch.long).to(device, non_blocking=True),
            meta.to(device),
            torch.tensor(sample_rows, dtype=torch.long).to(device, non_blocking=True),
        )

    def _prefill_segment(
        self, row: int, start: int, n: int, block_ids: list[int]
    ) -> PrefillSegment:
        ctx_len = start + n
        blocks = None
        if start:
            blocks = torch.tensor(block_ids[: -(-ctx_len // self.block_size)], dtype=torch.long)
        mask = causal_mask(start, n, ctx_len, self.window)
        return PrefillSegment(row, n, blocks, ctx_len, mask)

    # ------------------------------------------------------------------ sampling
    def _sample_requests(self, item: ScheduledSeq) -> list[SampleRequest]:
        """The sampled rows' requests: one, or with a draft one a row, each with the draft's
        tokens before it as part of its history (penalties, min_tokens, bad words)."""
        seq = item.seq
        if seq.generator is None:
            # None without a seed; a request that comes with tokens skips their draws
            seq.generator = create_generator(seq.params, self.device, len(seq.output_token_ids))
        output = seq.output_token_ids
        if not item.draft:
            return [
                SampleRequest(seq.params, seq.prompt_token_ids, output, seq.generator, seq.matcher)
            ]
        history = [output + list(item.draft[:j]) for j in range(len(item.draft) + 1)]
        masks: list = [None] * len(history)
        if seq.matcher is not None:  # each row masked by the grammar after the draft before it
            masks = draft_masks(seq.matcher, item.draft, self.model.config.vocab_size)
        return [
            SampleRequest(seq.params, seq.prompt_token_ids, h, seq.generator, mask)
            for h, mask in zip(history, masks, strict=True)
        ]


def _by_adapter(plan: StepPlan) -> list[int] | None:
    """The order of the plan's sequences with each LoRA adapter's adjacent (the base's first,
    otherwise as planned); None when they already are."""
    names = [None if item.seq.lora is None else item.seq.lora.name for item in plan.scheduled]
    order = sorted(range(len(names)), key=lambda i: names[i] or "")
    return None if order == list(range(len(names))) else order


def _lora_batch(plan: StepPlan) -> LoRABatch | None:
    """The step's LoRA adapters and their rows; None when no sequence has one."""
    return LoRABatch.build([(item.seq.lora, item.num_new_tokens) for item in plan.scheduled])


def _advance_grammar(seq: Sequence, token_id: int) -> None:
    """Moves the sequence's matcher past the token the sampler chose under its mask."""
    if seq.matcher is not None and not seq.matcher.accept_token(token_id):
        raise AssertionError(f"{seq.seq_id}: token {token_id} was sampled outside its grammar")


def _extend_slots(slots: list[int], block_ids: list[int], start: int, n: int, bs: int) -> None:
    """Appends the pool slots of positions ``start .. start + n - 1``: a run per block."""
    pos, end = start, start + n
    while pos < end:
        block, offset = divmod(pos, bs)
        take = min(bs - offset, end - pos)
        first = block_ids[block] * bs + offset
        slots.extend(range(first, first + take))
        pos += take
