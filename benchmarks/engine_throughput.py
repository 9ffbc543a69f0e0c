"""Offline engine throughput on CPU: kvrelay against transformers, on one request set.

The workload is ``--num-requests`` requests (64) with random prompt ids, prompt lengths
uniform in 16..512 and output lengths uniform in 16..256 (fixed seed). Every system decodes
greedily with eos disabled, so each request produces exactly its output length; only those
requested tokens count as output.

Systems, each warmed up on other prompts before it is timed:

- kvrelay ``LLM.generate`` with all requests at once (iteration-level scheduling).
- transformers ``generate`` with static batches of 8, 16 and 32 taken in arrival order,
  left-padded; a batch runs until its longest output, so padding and the tokens generated
  past a request's own length are computed but not counted (request-level batching).
- transformers continuous batching: the manager behind ``generate_batch``, with each
  request's own ``max_new_tokens`` (``generate_batch`` itself takes only one for all).

It also times kvrelay's decode step at batch 1 and compares it with the memory-bandwidth
bound: the weight bytes one step reads divided by the copy bandwidth measured in this run.

    python benchmarks/engine_throughput.py            # full run, writes BENCHMARKS.md
    python benchmarks/engine_throughput.py --quick --no-write
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import (
    TimedRun,
    command_line,
    fmt,
    machine_info,
    machine_markdown,
    markdown_table,
    measure_memory_bandwidth,
    median,
    text_table,
    timed_quiet,
    update_benchmarks_md,
    write_json,
)

SECTION_TITLE = "Engine throughput (offline, CPU)"
STATIC_BATCH_SIZES = (8, 16, 32)
MIN_TOKEN_ID = 3  # prompt ids are drawn from [3, vocab): 0..2 are make_tiny specials
PAD_TOKEN_ID = 1
DECODE_PROMPT_LEN = 16
DECODE_OUTPUT_LEN = 128
DECODE_RUNS = 3
GOAL_VS_STATIC = 2.0
STATIC_NAME = "transformers generate, static batch"
CB_NAME = "transformers continuous batching"

logger = logging.getLogger("engine_throughput")


@dataclass(frozen=True, slots=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]  # inclusive range
    output_lens: tuple[int, int]  # inclusive range
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Request:
    prompt_ids: list[int]
    output_len: int


@dataclass(frozen=True, slots=True)
class TimingPolicy:
    repeats: int = 1  # timed runs per system; the median counts
    max_others_cpu: float = 0.1  # time again while other processes used more of the CPUs
    attempts: int = 3  # runs at most per timed run, when other processes interfere
    max_wait_s: float = 300.0  # wait this long at most for quiet CPUs before each run

    def run(self, fn: Callable[[], Any], setup: Callable[[], object] | None = None) -> TimedRun:
        return timed_quiet(fn, setup, self.max_others_cpu, self.attempts, self.max_wait_s)


@dataclass(slots=True)
class SystemResult:
    name: str
    useful_tokens: int = 0  # output tokens the requests asked for
    computed_tokens: int = 0  # output tokens the system generated, waste included
    seconds: list[float] = field(default_factory=list)  # one per repeat
    others_cpu: list[float] = field(default_factory=list)  # CPU share others took, per repeat
    note: str = ""
    error: str | None = None  # set when the system did not run

    def add(self, run: TimedRun, useful_tokens: int) -> None:
        self.useful_tokens, self.computed_tokens = useful_tokens, run.value
        self.seconds.append(run.seconds)
        self.others_cpu.append(run.others_cpu)

    @property
    def tokens_per_s(self) -> float | None:
        if self.error is not None or not self.seconds:
            return None
        return self.useful_tokens / median(self.seconds)


@dataclass(frozen=True, slots=True)
class DecodeBound:
    step_s: float  # measured seconds per decode step at batch 1
    weight_bytes: int  # bytes of weights one decode step reads
    bandwidth: float  # measured copy bandwidth, bytes/s
    others_cpu: float  # largest CPU share other processes took while these were measured

    @property
    def bound_s(self) -> float:
        return self.weight_bytes / self.bandwidth


def make_requests(workload: Workload, vocab_size: int) -> list[Request]:
    rng = random.Random(workload.seed)
    requests = []
    for _ in range(workload.num_requests):
        prompt_len = rng.randint(*workload.prompt_lens)
        ids = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(prompt_len)]
        requests.append(Request(ids, rng.randint(*workload.output_lens)))
    return requests


def warmup_requests(vocab_size: int, num: int = 2) -> list[Request]:
    return make_requests(Workload(num, (16, 48), (4, 8), seed=12345), vocab_size)


# ---------------------------------------------------------------------------- kvrelay


def create_llm(model_dir: Path, threads: int) -> Any:
    from kvrelay import LLM

    return LLM(
        model=str(model_dir), dtype="float32", seed=0, skip_tokenizer_init=True, num_threads=threads
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


def load_hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
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


# ---------------------------------------------------------------------------- report

RESULT_HEADERS = (
    "system",
    "output tok/s",
    "time (s)",
    "useful / generated tokens",
    "kvrelay ÷ system",
    "note",
)
DECODE_HEADERS = (
    "decode step (ms)",
    "weights read (MB)",
    "copy bandwidth (GB/s)",
    "bound (ms)",
    "step ÷ bound",
)


def result_rows(results: list[SystemResult], max_others_cpu: float) -> list[list[str]]:
    ours = results[0].tokens_per_s
    rows = []
    for r in results:
        rate = r.tokens_per_s
        if rate is None:
            rows.append([r.name, "-", "-", "-", "-", r.error or ""])
            continue
        note = r.note
        if max(r.others_cpu, default=0.0) > max_others_cpu:
            note += f"; other processes took {max(r.others_cpu):.0%} of the CPUs"
        ratio = f"{ours / rate:.2f}x" if ours else "-"
        tokens = f"{r.useful_tokens:,} / {r.computed_tokens:,}"
        rows.append([r.name, fmt(rate), f"{median(r.seconds):.1f}", tokens, ratio, note])
    return rows


def goal_lines(results: list[SystemResult]) -> list[str]:
    ours = results[0].tokens_per_s
    static = [r.tokens_per_s for r in results if r.name.startswith(STATIC_NAME) and r.tokens_per_s]
    cb = next((r for r in results if r.name == CB_NAME), None)
    lines = []
    if ours and static:
        ratio = ours / max(static)
        verdict = "met" if ratio >= GOAL_VS_STATIC else "NOT met"
        lines.append(
            f"Goal 1, at least {GOAL_VS_STATIC:.0f}x the best static batch: {ratio:.2f}x "
            f"({fmt(ours)} vs {fmt(max(static))} tok/s) - {verdict}."
        )
    if ours and cb is not None:
        if cb.tokens_per_s:
            ratio = ours / cb.tokens_per_s
            verdict = "met" if ratio > 1 else "NOT met"
            lines.append(
                f"Goal 2, ahead of transformers continuous batching: {ratio:.2f}x "
                f"({fmt(ours)} vs {fmt(cb.tokens_per_s)} tok/s) - {verdict}."
            )
        else:
            lines.append(f"Goal 2, ahead of transformers continuous batching: {cb.error}.")
    return lines


def decode_rows(bound: DecodeBound, max_others_cpu: float) -> list[list[str]]:
    row = [
        f"{bound.step_s * 1e3:.2f}",
        f"{bound.weight_bytes / 1e6:.1f}",
        f"{bound.bandwidth / 1e9:.2f}",
        f"{bound.bound_s * 1e3:.2f}",
        f"{bound.step_s / bound.bound_s:.2f}x",
    ]
    if bound.others_cpu > max_others_cpu:
        row[-1] += f" (other processes took {bound.others_cpu:.0%} of the CPUs)"
    return [row]


def describe(args: argparse.Namespace, workload: Workload, params: int) -> str:
    model = f"`{args.model_dir.name}`" if args.model_dir else f"make_tiny `{args.size}` llama"
    return (
        f"Model: {model} ({params / 1e6:.1f}M parameters), float32, {args.threads} threads. "
        f"{workload.num_requests} requests, prompt lengths {workload.prompt_lens[0]}-"
        f"{workload.prompt_lens[1]}, output lengths {workload.output_lens[0]}-"
        f"{workload.output_lens[1]} (uniform, seed {workload.seed}); greedy with eos ignored, so "
        "each request gets exactly its output length in every system, and only those tokens "
        "count (a static batch runs to its longest output; the rest is computed, not counted). "
        f"Median of {args.repeats} timed run(s) per system after a warm-up, each on a quiet "
        "machine (a run is repeated while other processes take over "
        f"{args.max_others_cpu:.0%} of the CPUs)."
    )


def decode_text(bound: DecodeBound) -> str:
    return (
        f"Decode step at batch 1 (kvrelay; prompt {DECODE_PROMPT_LEN} tokens, "
        f"{DECODE_OUTPUT_LEN} output tokens, time per token after the first, median of "
        f"{DECODE_RUNS}) against its memory bound: weight bytes read per step (all weights but "
        "an untied embedding table) / copy bandwidth (`dst.copy_(src)` of 512 MB float32, "
        "bytes read + written, median of 7)."
    )


def markdown_body(
    args: argparse.Namespace,
    workload: Workload,
    params: int,
    results: list[SystemResult],
    bound: DecodeBound | None,
    info: dict[str, Any],
) -> str:
    rows = result_rows(results, args.max_others_cpu)
    parts = [describe(args, workload, params), markdown_table(RESULT_HEADERS, rows)]
    parts.append("\n".join(f"- {line}" for line in goal_lines(results)))
    if bound is not None:
        parts += [
            decode_text(bound),
            markdown_table(DECODE_HEADERS, decode_rows(bound, args.max_others_cpu)),
        ]
    parts.append(machine_markdown(info))
    return "\n\n".join(p for p in parts if p)


def print_report(
    results: list[SystemResult], bound: DecodeBound | None, max_others_cpu: float
) -> None:
    print()
    print(text_table(RESULT_HEADERS, result_rows(results, max_others_cpu)))
    print()
    for line in goal_lines(results):
        print(line)
    if bound is not None:
        print()
        print(text_table(DECODE_HEADERS, decode_rows(bound, max_others_cpu)))


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, help="checkpoint; default: make one (make_tiny)")
    parser.add_argument("--size", default="small", help="make_tiny size when no --model-dir")
    parser.add_argument("--num-requests", type=int, help="default 64 (16 with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per system (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs")
    parser.add_argument("--skip-hf-static", action="store_true")
    parser.add_argument("--skip-hf-cb", action="store_true")
    parser.add_argument("--skip-decode", action="store_true", help="skip the batch-1 decode bound")
    parser.add_argument(
        "--max-others-cpu",
        type=float,
        default=0.1,
        help="time a run again while other processes use more than this share of the CPUs",
    )
    parser.add_argument("--attempts", type=int, default=3, help="runs at most per timed run")
    parser.add_argument(
        "--max-wait-quiet",
        type=float,
        default=300.0,
        help="seconds to wait at most for quiet CPUs before each timed run",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if min(args.repeats, args.threads, args.attempts, args.num_requests or 1) < 1:
        parser.error("--repeats, --threads, --attempts and --num-requests must be >= 1")
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    if args.quick:
        return Workload(args.num_requests or 16, (16, 128), (16, 64), args.seed)
    return Workload(args.num_requests or 64, (16, 512), (16, 256), args.seed)


def measure_kvrelay(
    args: argparse.Namespace, model_dir: Path, requests: list[Request], timing: TimingPolicy
) -> tuple[SystemResult, DecodeBound | None]:
    vocab = vocab_size(model_dir)
    llm = create_llm(model_dir, args.threads)
    result = run_kvrelay(llm, requests, timing, vocab)
    print(f"{result.name}: {fmt(result.tokens_per_s or 0)} tok/s", flush=True)
    if args.skip_decode:
        return result, None
    step, weight_bytes = time_decode_step(llm, vocab, timing)
    del llm  # frees the KV pool before the bandwidth test allocates 1 GB
    bandwidth = timing.run(measure_memory_bandwidth)
    others_cpu = max(step.others_cpu, bandwidth.others_cpu)
    return result, DecodeBound(step.value, weight_bytes, bandwidth.value, others_cpu)


def measure_hf(
    args: argparse.Namespace, model_dir: Path, requests: list[Request], timing: TimingPolicy
) -> list[SystemResult]:
    if args.skip_hf_static and args.skip_hf_cb:
        return []
    vocab = vocab_size(model_dir)
    model = load_hf_model(model_dir)
    results = []
    if not args.skip_hf_static:
        for batch_size in STATIC_BATCH_SIZES:
            results.append(run_hf_static(model, requests, batch_size, timing, vocab))
            print(f"{results[-1].name}: {fmt(results[-1].tokens_per_s or 0)} tok/s", flush=True)
    if not args.skip_hf_cb:
        results.append(run_hf_cb(model, requests, timing, vocab))
        rate = results[-1].tokens_per_s
        print(f"{results[-1].name}: {fmt(rate) + ' tok/s' if rate else results[-1].error}")
    return results


def vocab_size(model_dir: Path) -> int:
    from kvrelay.engine.config import ModelConfig

    return ModelConfig.from_dir(model_dir).vocab_size


def run_all(args: argparse.Namespace, model_dir: Path) -> int:
    from kvrelay.engine.make_tiny import param_count

    torch.set_num_threads(args.threads)
    info = machine_info(args.threads)
    workload = make_workload(args)
    timing = TimingPolicy(args.repeats, args.max_others_cpu, args.attempts, args.max_wait_quiet)
    requests = make_requests(workload, vocab_size(model_dir))
    kvrelay, bound = measure_kvrelay(args, model_dir, requests, timing)
    results = [kvrelay, *measure_hf(args, model_dir, requests, timing)]
    print_report(results, bound, args.max_others_cpu)
    params = param_count(model_dir)
    if args.json:
        write_json(
            args.json,
            {
                "workload": asdict(workload),
                "machine": info,
                "parameters": params,
                "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
                "decode": None if bound is None else asdict(bound) | {"bound_s": bound.bound_s},
            },
        )
    if not args.no_write:
        body = markdown_body(args, workload, params, results, bound, info)
        path = update_benchmarks_md(SECTION_TITLE, body, command_line())
        print(f"\nwrote section {SECTION_TITLE!r} of {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.model_dir is not None:
        return run_all(args, args.model_dir)
    from kvrelay.engine.make_tiny import make_tiny

    with tempfile.TemporaryDirectory(prefix="kvrelay-bench-") as tmp:
        return run_all(args, make_tiny(Path(tmp) / args.size, arch="llama", size=args.size))


if __name__ == "__main__":
    sys.exit(main())
