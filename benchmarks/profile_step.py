"""Where one kvrelay engine step spends its time: torch.profiler over decode steps of a lone
request and over one prefill, grouped by op, plus the wall time outside torch ops (Python,
scheduling, step metadata, sampling).

    python benchmarks/profile_step.py --model DIR [--dtype float32] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--rows", type=int, default=12, help="ops shown per table")
    return parser.parse_args()


def generate(llm: object, prompt: list[int], max_tokens: int) -> float:
    from kvrelay import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params)  # type: ignore[attr-defined]
    return time.perf_counter() - start


def show(title: str, prof: profile, wall_s: float, rows: int) -> None:
    events = prof.key_averages()
    total_us = sum(e.self_cpu_time_total for e in events)
    print(
        f"\n## {title}: wall {wall_s * 1e3:.1f} ms, self time in torch ops {total_us / 1e3:.1f} ms"
    )
    print("| op | calls | self ms | share of wall |\n|---|---|---|---|")
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:rows]:
        share = e.self_cpu_time_total / 1e6 / wall_s
        print(f"| {e.key} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} | {share:.0%} |")
    outside = wall_s - total_us / 1e6
    print(
        f"| (outside torch ops: Python, scheduler, metadata) | | {outside * 1e3:.1f} | "
        f"{outside / wall_s:.0%} |"
    )


def main() -> int:
    args = parse_args()
    from kvrelay import LLM

    # prefix caching off: the profiled prefill repeats the warm-up's prompt, which would
    # otherwise come from the cache (a gather of 1,008 cached tokens, not a prefill)
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        skip_tokenizer_init=True,
        enable_prefix_caching=False,
    )
    rng = random.Random(0)
    vocab = llm.engine.config.model_config.vocab_size  # type: ignore[attr-defined]
    prompt = [rng.randrange(3, vocab) for _ in range(args.prefill_len)]
    short = prompt[:16]
    for _ in range(2):  # warm-up
        generate(llm, short, 4)
        generate(llm, prompt, 1)
    one = min(generate(llm, short, 1) for _ in range(3))
    many = min(generate(llm, short, 1 + args.decode_steps) for _ in range(3))
    print(
        f"decode step (lone request, {args.dtype}, {args.threads} threads): "
        f"{(many - one) / args.decode_steps * 1e3:.2f} ms"
    )
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = generate(llm, short, 1 + args.decode_steps) - one
    show(f"{args.decode_steps} decode steps", prof, wall, args.rows)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = generate(llm, prompt, 1)
    show(f"prefill of {args.prefill_len} tokens", prof, wall, args.rows)
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    raise SystemExit(main())
