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
import logging
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from common import (
    add_model_args,
    command_line,
    fmt,
    machine_info,
    measure_memory_bandwidth,
    section_title,
    update_benchmarks_md,
    write_json,
)
from engine_throughput_report import markdown_body, print_report
from engine_throughput_systems import (
    create_llm,
    load_hf_model,
    run_hf_cb,
    run_hf_static,
    run_kvrelay,
    time_decode_step,
)
from engine_throughput_workload import (
    DecodeBound,
    Request,
    SystemResult,
    TimingPolicy,
    Workload,
    make_requests,
)

SECTION_TITLE = "Engine throughput (offline, CPU)"
STATIC_BATCH_SIZES = (8, 16, 32)


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(parser)
    parser.add_argument("--num-requests", type=int, help="default 64 (16 with --quick)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per system (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="short prompts and outputs")
    parser.add_argument(
        "--output-len", type=int, nargs=2, metavar=("LOW", "HIGH"),
        help="output lengths, inclusive (default 16 256; 16 64 with --quick)",
    )  # fmt: skip
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
    if args.output_len and not 1 <= args.output_len[0] <= args.output_len[1]:
        parser.error("--output-len needs 1 <= LOW <= HIGH")
    return args


def make_workload(args: argparse.Namespace) -> Workload:
    if args.quick:
        outputs = tuple(args.output_len or (16, 64))
        return Workload(args.num_requests or 16, (16, 128), outputs, args.seed)
    outputs = tuple(args.output_len or (16, 256))
    return Workload(args.num_requests or 64, (16, 512), outputs, args.seed)


def measure_kvrelay(
    args: argparse.Namespace, model_dir: Path, requests: list[Request], timing: TimingPolicy
) -> tuple[SystemResult, DecodeBound | None]:
    vocab = vocab_size(model_dir)
    llm = create_llm(model_dir, args.threads, args.dtype)
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
    model = load_hf_model(model_dir, args.dtype)
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
                "dtype": args.dtype,
                "results": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in results],
                "decode": None if bound is None else asdict(bound) | {"bound_s": bound.bound_s},
            },
        )
    if not args.no_write:
        body = markdown_body(args, workload, params, results, bound, info)
        title = section_title(SECTION_TITLE, args.model_dir, args.size, args.dtype)
        path = update_benchmarks_md(title, body, command_line())
        print(f"\nwrote section {title!r} of {path}")
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
