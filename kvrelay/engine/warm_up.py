"""The engine's warm-up: throwaway requests through every kind of step before it serves
(``LLMEngine.warm_up``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvrelay.kernels.gemv import MAX_ROWS as _GEMV_ROWS
from kvrelay.protocol.pooling import PoolingParams
from kvrelay.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvrelay.engine.engine import LLMEngine


def run_warm_up(engine: LLMEngine, prompt_len: int = 128, batch: int = _GEMV_ROWS + 2) -> float:
    """Runs throwaway requests through every kind of step before the engine serves, and
    returns the seconds it took.

    The first steps of a fresh process pay one-time costs: Triton compiles its kernels,
    cuBLAS and torch's allocator set up, MKL / oneDNN build kernels for each new shape.
    On a GPU it then compiles every variant of the Triton kernels an eager step may
    launch (``ModelRunner.compile_kernels``) and captures the CUDA graph of every decode
    batch size (``DecodeGraphs.capture_all``) and the graph of every padded token count
    of the other steps (``StepGraphs.capture_all``; ``LayerGraphs`` with SDPA's
    prefill). Serving workers run it on GPUs only: on CPUs, with packed weights and the
    native kernels, a fresh 1P+1D ``kvrelay up`` served its first requests as fast
    without it and was ready 1.1 s sooner (it once made a fresh kvrelay's first
    benchmark run 3x faster: TTFT p50 446 ms against 130 ms). One prompt of
    ``prompt_len`` tokens (capped by the context and the step budget) and ``batch - 1``
    short ones, a few greedy tokens each: a long prefill, a batched prefill, batched
    decode steps and then, the long one alone, lone decode steps. Nothing remains: the
    blocks are freed and dropped from the prefix cache (call it before serving: the
    whole cache is emptied) before any cache event leaves, the cache tiers are not
    consulted, and the prefix-cache counters are restored.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("warm_up needs an idle engine")
    started = time.perf_counter()
    bm, scheduler = engine.block_manager, engine.scheduler
    counters = (bm.num_query_tokens, bm.num_hit_tokens, scheduler.num_preemptions)
    loader, scheduler.prefix_loader = scheduler.prefix_loader, None
    vocab, max_len = engine.config.model_config.vocab_size, engine.max_model_len
    budget = engine.config.scheduler.max_num_batched_tokens
    lengths = [max(1, min(prompt_len, max_len - 4, budget))]
    lengths += [max(1, min(16, max_len - 4))] * (min(batch, scheduler.config.max_num_seqs) - 1)
    ids = [f"warm-up-{n}" for n in range(len(lengths))]
    try:
        for n, (request_id, length) in enumerate(zip(ids, lengths, strict=True)):
            tokens = [(n * 131 + t * 7919) % vocab for t in range(length)]
            # the long one outlives the others: its last steps are a lone decode
            params = SamplingParams(temperature=0.0, max_tokens=6 if n == 0 else 3, ignore_eos=True)
            # an embedding checkpoint pools instead (it has no head to sample with)
            pooling = None if engine.config.model_config.generates else PoolingParams()
            engine.add_request(request_id, tokens, params, pooling=pooling)
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        for request_id in ids:
            engine.abort_request(request_id)
        scheduler.prefix_loader = loader
        bm.reset_prefix_cache()
        bm.pop_events()  # the stores and the evictions the reset made: never sent
        bm.num_query_tokens, bm.num_hit_tokens, scheduler.num_preemptions = counters
    engine.runner.compile_kernels()  # GPU: the eager steps' kernel variants
    if engine.runner.graphs is not None:  # every decode batch size, before anything is served
        engine.runner.graphs.capture_all()
    if engine.runner.step_graphs is not None:  # and every token count of the other steps
        engine.runner.step_graphs.capture_all()
    if engine.runner.layer_graphs is not None:
        engine.runner.layer_graphs.capture_all()
    return time.perf_counter() - started
