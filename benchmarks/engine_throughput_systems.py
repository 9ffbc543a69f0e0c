"""Engine throughput benchmark, systems: how each one is run and timed on the request set
(kvrelay ``LLM.generate`` and its batch-1 decode step; transformers static batches and
continuous batching)."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from common import TimedRun, median
from engine_throughput_workload import (
    MIN_TOKEN_ID,
    Request,
    SystemResult,
    TimingPolicy,
    warmup_requests,
)

PAD_TOKEN_ID = 1
DECODE_PROMPT_LEN = 16
DECODE_OUTPUT_LEN = 128
DECODE_RUNS = 3
STATIC_NAME = "transformers generate, static batch"
CB_NAME = "transformers continuous batching"

logger = logging.getLogger("engine_throughput")


# ---------------------------------------------------------------------------- kvrelay


def create_llm(model_dir: Path, threads: int, dtype: str = "float32") -> Any:
    from kvrelay import LLM

    return LLM(
        model=str(model_dir), dtype=dtype, seed=0, skip_tokenizer_init=True, num_threads=threads
    )


def kvrelay_generate(llm: Any, requests: Sequence[Request]) -> int:
    """Runs all requests in one ``generate`` call; returns the output tokens produced."""
    from kvrelay import SamplingParams

    prompts = [{"prompt_token_ids": r.prompt_ids} for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests
    ]
    outs = llm.generate(prompts, params)
    produced = [len(o.outputs[0].token_ids) for o in outs]
    wanted = [r.output_len for r in requests]
    if produced != wanted:
        raise RuntimeError(f"kvrelay produced {sum(produced)} tokens, wanted {sum(wanted)}")
    return sum(produced)


def run_kvrelay(
    llm: Any, requests: list[Request], timing: TimingPolicy, vocab: int
) -> SystemResult:
    result = SystemResult("kvrelay LLM.generate", note="all requests at once")
    kvrelay_generate(llm, warmup_requests(vocab))
    reset = llm.engine.block_manager.reset_prefix_cache  # a repeat must not hit the last run's KV
    for _ in range(timing.repeats):
        run = timing.run(lambda: kvrelay_generate(llm, requests), setup=reset)
        result.add(run, run.value)
    return result


def measure_decode_step(llm: Any, vocab: int) -> float:
    """Median seconds per decode step of one sequence (the first token, prefill, excluded)."""
    rng = random.Random(7)
    prompts = [
        [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(DECODE_PROMPT_LEN)]
        for _ in range(DECODE_RUNS + 1)
    ]
    decode_one(llm.engine, "decode-warmup", prompts[0])
    return median([decode_one(llm.engine, f"decode-{i}", p) for i, p in enumerate(prompts[1:])])


def time_decode_step(llm: Any, vocab: int, timing: TimingPolicy) -> tuple[TimedRun, int]:
    """The timed batch-1 decode step and the weight bytes such a step reads."""
    reset = llm.engine.block_manager.reset_prefix_cache
    step = timing.run(lambda: measure_decode_step(llm, vocab), setup=reset)
    return step, decode_weight_bytes(llm)


def decode_one(engine: Any, request_id: str, prompt: list[int]) -> float:
    """Seconds per step after the first token of one request running alone."""
    from kvrelay import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=DECODE_OUTPUT_LEN, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    while not engine.step():  # prefill, until the first token comes out
        pass
    start = time.perf_counter()
    num_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
    return (time.perf_counter() - start) / num_steps


def decode_weight_bytes(llm: Any) -> int:
    """Weight bytes one decode step reads: all of them, except an untied embedding table
    (a lookup reads one row of it)."""
    weights = llm.engine.runner.model.weights
    total = sum(t.numel() * t.element_size() for t in weights.values())
    if "lm_head" in weights:
        total -= weights["embed"].numel() * weights["embed"].element_size()
    return total


# ---------------------------------------------------------------------------- transformers


def load_hf_model(model_dir: Path, dtype: str = "float32") -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="sdpa"
    )
    return model.eval()


def hf_static_batch(model: Any, batch: Sequence[Request]) -> int:
    """Generates one left-padded batch to its longest output; returns tokens generated."""
    from transformers import GenerationConfig

    max_len = max(len(r.prompt_ids) for r in batch)
    max_new = max(r.output_len for r in batch)
    ids = [[PAD_TOKEN_ID] * (max_len - len(r.prompt_ids)) + r.prompt_ids for r in batch]
    mask = [[0] * (max_len - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch]
    config = GenerationConfig(
        max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=PAD_TOKEN_ID
    )
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), generation_config=config
        )
    generated = out.shape[1] - max_len
    if generated != max_new:
        raise RuntimeError(f"transformers generated {generated} tokens per row, wanted {max_new}")
    return generated * len(batch)


def run_hf_static(
    model: Any, requests: list[Request], batch_size: int, timing: TimingPolicy, vocab: int
) -> SystemResult:
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    result = SystemResult(
        f"{STATIC_NAME} {batch_size}",
        note=f"{len(batches)} batches in arrival order",
    )
    hf_static_batch(model, warmup_requests(vocab))
    for _ in range(timing.repeats):
        # Batch by batch, so a batch that other processes disturbed is timed again alone.
        runs = [timing.run(lambda b=batch: hf_static_batch(model, b)) for batch in batches]
        total = TimedRun(
            sum(r.value for r in runs),
            sum(r.seconds for r in runs),
            max(r.others_cpu for r in runs),
        )
        result.add(total, sum(r.output_len for r in requests))
    return result


@contextlib.contextmanager
def hf_cb_manager(model: Any, requests: list[Request]) -> Iterator[Any]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_ids) for r in requests),
        max_generated_length=max(r.output_len for r in requests),
        num_requests=len(requests),
    )
    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests), do_sample=False, eos_token_id=-1
    )
    # Block sharing (its prefix cache) off: these prompts share no prefix, and a repeat or a
    # retried run must not reuse the KV of the run before.
    cb_config = ContinuousBatchingConfig(allow_block_sharing=False)
    with model.continuous_batching_context_manager(
        generation_config=config,
        block=True,
        timeout=5,
        continuous_batching_config=cb_config,
        workload_hints=hints,
    ) as manager:
        yield manager


def hf_cb_generate(manager: Any, requests: Sequence[Request]) -> int:
    """Submits every request with its own max_new_tokens and waits for all of them."""
    ids = {
        manager.add_request(r.prompt_ids, max_new_tokens=r.output_len, eos_token_id=-1): r
        for r in requests
    }
    done: dict[str, int] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("the continuous batching thread stopped early")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error}")
            done[out.request_id] = len(out.generated_tokens)
    wanted = {rid: r.output_len for rid, r in ids.items()}
    if done != wanted:
        raise RuntimeError(f"produced {sum(done.values())} tokens, wanted {sum(wanted.values())}")
    return sum(done.values())


def run_hf_cb(
    model: Any, requests: list[Request], timing: TimingPolicy, vocab: int
) -> SystemResult:
    result = SystemResult(
        CB_NAME,
        note="generate_batch's manager, per-request max_new_tokens",
    )
    try:
        with hf_cb_manager(model, requests) as manager:
            hf_cb_generate(manager, warmup_requests(vocab))
            for _ in range(timing.repeats):
                run = timing.run(lambda: hf_cb_generate(manager, requests))
                result.add(run, run.value)
    except (RuntimeError, ValueError, NotImplementedError, ImportError, AttributeError) as exc:
        result.error = f"did not run: {type(exc).__name__}: {exc}"
        logger.warning("transformers continuous batching %s", result.error)
    return result
