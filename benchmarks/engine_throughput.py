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
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from common import (
    command_line,
    fmt,
    machine_info,
    machine_markdown,
    markdown_table,
    measure_memory_bandwidth,
    median,
    text_table,
    timed,
    update_benchmarks_md,
    write_json,
)

SECTION_TITLE = "Engine throughput (offline, CPU)"
STATIC_BATCH_SIZES = (8, 16, 32)
MIN_TOKEN_ID = 3  # ids 0..2 are bos / eos / chat specials in make_tiny checkpoints
PAD_TOKEN_ID = 1
DECODE_PROMPT_LEN = 16
DECODE_OUTPUT_LEN = 128
DECODE_RUNS = 3
GOAL_VS_STATIC = 2.0

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


@dataclass(slots=True)
class SystemResult:
    name: str
    useful_tokens: int = 0  # output tokens the requests asked for
    computed_tokens: int = 0  # output tokens the system generated, waste included
    seconds: list[float] = field(default_factory=list)  # one per repeat
    note: str = ""
    error: str | None = None  # set when the system did not run

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


def run_kvrelay(llm: Any, requests: list[Request], repeats: int, vocab: int) -> SystemResult:
    result = SystemResult("kvrelay LLM.generate", note="all requests at once")
    kvrelay_generate(llm, warmup_requests(vocab))
    for _ in range(repeats):
        llm.engine.block_manager.reset_prefix_cache()  # repeats must not hit the last run's KV
        tokens, seconds = timed(lambda: kvrelay_generate(llm, requests))
        result.useful_tokens = result.computed_tokens = tokens
        result.seconds.append(seconds)
    return result


def measure_decode_step(llm: Any, vocab: int) -> float:
    """Median seconds per decode step of one sequence (the first token, prefill, excluded)."""
    from kvrelay import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_OUTPUT_LEN, ignore_eos=True)
    rng = random.Random(7)
    per_step = []
    for run in range(DECODE_RUNS + 1):  # run 0 warms up
        prompt = [rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(DECODE_PROMPT_LEN)]
        engine.add_request(f"decode-{run}", prompt, params)
        first_at, num_tokens = None, 0
        while engine.has_unfinished_requests():
            num_tokens += sum(len(o.new_token_ids) for o in engine.step())
            if first_at is None and num_tokens:
                first_at, first_tokens = time.perf_counter(), num_tokens
        elapsed = time.perf_counter() - first_at
        if run:
            per_step.append(elapsed / (num_tokens - first_tokens))
    return median(per_step)


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
    model: Any, requests: list[Request], batch_size: int, repeats: int, vocab: int
) -> SystemResult:
    batches = [requests[i : i + batch_size] for i in range(0, len(requests), batch_size)]
    result = SystemResult(
        f"transformers generate, static batch {batch_size}",
        note=f"{len(batches)} batches in arrival order",
    )
    hf_static_batch(model, warmup_requests(vocab))
    for _ in range(repeats):
        computed, seconds = timed(lambda: sum(hf_static_batch(model, b) for b in batches))
        result.computed_tokens = computed
        result.useful_tokens = sum(r.output_len for r in requests)
        result.seconds.append(seconds)
    return result


@contextlib.contextmanager
def hf_cb_manager(model: Any, requests: list[Request]) -> Iterator[Any]:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_ids) for r in requests),
        max_generated_length=max(r.output_len for r in requests),
        num_requests=len(requests),
    )
    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests), do_sample=False, eos_token_id=-1
    )
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=5, workload_hints=hints
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


def run_hf_cb(model: Any, requests: list[Request], repeats: int, vocab: int) -> SystemResult:
    result = SystemResult(
        "transformers continuous batching",
        note="generate_batch's manager, per-request max_new_tokens",
    )
    try:
        for _ in range(repeats):  # a fresh manager each time: no prefix sharing across repeats
            with hf_cb_manager(model, requests) as manager:
                hf_cb_generate(manager, warmup_requests(vocab))
                tokens, seconds = timed(lambda m=manager: hf_cb_generate(m, requests))
            result.useful_tokens = result.computed_tokens = tokens
            result.seconds.append(seconds)
    except (RuntimeError, ValueError, NotImplementedError, ImportError, AttributeError) as exc:
        result.error = f"did not run: {type(exc).__name__}: {exc}"
        logger.warning("transformers continuous batching %s", result.error)
    return result


# ---------------------------------------------------------------------------- report


def result_rows(results: list[SystemResult]) -> list[list[str]]:
    ours = results[0].tokens_per_s
    rows = []
    for r in results:
        rate = r.tokens_per_s
        if rate is None:
            rows.append([r.name, "-", "-", "-", "-", r.error or ""])
            continue
        ratio = f"{ours / rate:.2f}x" if ours else "-"
        tokens = f"{r.useful_tokens:,} / {r.computed_tokens:,}"
        rows.append([r.name, fmt(rate), f"{median(r.seconds):.1f}", tokens, ratio, r.note])
    return rows


RESULT_HEADERS = (
    "system",
    "output tok/s",
    "time (s)",
    "useful / generated tokens",
    "kvrelay ÷ system",
    "note",
)


def goal_lines(results: list[SystemResult]) -> list[str]:
    ours = results[0].tokens_per_s
    static = [r.tokens_per_s for r in results if "static" in r.name and r.tokens_per_s]
    cb = next((r for r in results if "continuous" in r.name), None)
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


def decode_rows(bound: DecodeBound) -> list[list[str]]:
    return [
        [
            f"{bound.step_s * 1e3:.2f}",
            f"{bound.weight_bytes / 1e6:.1f}",
            f"{bound.bandwidth / 1e9:.2f}",
            f"{bound.bound_s * 1e3:.2f}",
            f"{bound.step_s / bound.bound_s:.2f}x",
        ]
    ]


DECODE_HEADERS = (
    "decode step (ms)",
    "weights read (MB)",
    "copy bandwidth (GB/s)",
    "bound (ms)",
    "step ÷ bound",
)


def describe(args: argparse.Namespace, workload: Workload, params: int) -> str:
    return (
        f"Model: make_tiny `{args.size}` llama ({params / 1e6:.1f}M parameters), float32, "
        f"{args.threads} threads. {workload.num_requests} requests, prompt lengths "
        f"{workload.prompt_lens[0]}-{workload.prompt_lens[1]}, output lengths "
        f"{workload.output_lens[0]}-{workload.output_lens[1]} (uniform, seed {workload.seed}); "
        "greedy, eos ignored, so every system produces the same number of output tokens, and "
        f"only those count. Median of {args.repeats} run(s) after a warm-up."
    )


def markdown_body(
    args: argparse.Namespace,
    workload: Workload,
    params: int,
    results: list[SystemResult],
    bound: DecodeBound | None,
    info: dict[str, Any],
) -> str:
    parts = [describe(args, workload, params), markdown_table(RESULT_HEADERS, result_rows(results))]
    parts.append("\n".join(f"- {line}" for line in goal_lines(results)))
    if bound is not None:
        parts.append(
            f"Decode step at batch 1 (kvrelay, prompt {DECODE_PROMPT_LEN}, "
            f"{DECODE_OUTPUT_LEN} output tokens, first excluded) against weight bytes / "
            f"copy bandwidth (`dst.copy_(src)` of 512 MB, read + written bytes):"
        )
        parts.append(markdown_table(DECODE_HEADERS, decode_rows(bound)))
    parts.append(machine_markdown(info))
    return "\n\n".join(p for p in parts if p)


def print_report(results: list[SystemResult], bound: DecodeBound | None) -> None:
    print()
    print(text_table(RESULT_HEADERS, result_rows(results)))
    print()
    for line in goal_lines(results):
        print(line)
    if bound is not None:
        print()
        print(text_table(DECODE_HEADERS, decode_rows(bound)))


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
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.threads < 1:
        parser.error("--repeats and --threads must be >= 1")
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    if args.quick:
        return Workload(args.num_requests or 16, (16, 128), (16, 64), args.seed)
    return Workload(args.num_requests or 64, (16, 512), (16, 256), args.seed)


def run_all(args: argparse.Namespace, model_dir: Path) -> int:
    from kvrelay.engine.config import ModelConfig
    from kvrelay.engine.make_tiny import param_count

    torch.set_num_threads(args.threads)
    workload = make_workload(args)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    requests = make_requests(workload, vocab)
    llm = create_llm(model_dir, args.threads)
    results = [run_kvrelay(llm, requests, args.repeats, vocab)]
    print(f"kvrelay: {fmt(results[0].tokens_per_s or 0)} tok/s", flush=True)
    bound = None
    if not args.skip_decode:
        step_s = measure_decode_step(llm, vocab)
        weight_bytes = decode_weight_bytes(llm)
        del llm  # frees the KV pool before the bandwidth test allocates 1 GB
        bound = DecodeBound(step_s, weight_bytes, measure_memory_bandwidth())
    else:
        del llm
    if not (args.skip_hf_static and args.skip_hf_cb):
        model = load_hf_model(model_dir)
        if not args.skip_hf_static:
            for size in STATIC_BATCH_SIZES:
                results.append(run_hf_static(model, requests, size, args.repeats, vocab))
                print(f"{results[-1].name}: {fmt(results[-1].tokens_per_s or 0)} tok/s", flush=True)
        if not args.skip_hf_cb:
            results.append(run_hf_cb(model, requests, args.repeats, vocab))
    print_report(results, bound)
    info = machine_info(args.threads)
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
