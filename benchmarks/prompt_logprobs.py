"""Prompt logprobs (completions' ``echo`` with ``logprobs``): their cost and their agreement
with transformers.

The offline engine runs one prompt of each ``--lengths`` (prefix caching off, one token out)
plainly and with ``prompt_logprobs=K``, in turns (plain, with, with, plain...), and prints the
median times and their ratio: the price of a logits row per prompt token. Then, with
``--check``, the prompt logprobs of the longest prompt against transformers' log-softmax over
one forward of the same tokens (float32 recommended): the largest and mean difference, and
how often the top K ids agree.

    python benchmarks/prompt_logprobs.py --model DIR [--dtype bfloat16] [--lengths 256 1024]
        [--check]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--top", type=int, default=1, help="K: top alternatives per token")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="compare with transformers")
    return parser.parse_args(argv)


def timed(llm: Any, prompt: list[int], params: Any) -> float:
    start = time.perf_counter()
    llm.generate({"prompt_token_ids": prompt}, params)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvrelay import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)
    llm.engine.runner.model.wait_packed()
    vocab = llm.engine.config.model_config.vocab_size
    rng = random.Random(0)
    plain = SamplingParams(temperature=0, max_tokens=1)
    wanted = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=args.top)
    print(f"{args.model}, {args.dtype}, {args.threads} threads, prompt_logprobs={args.top}")
    print("| prompt tokens | plain ms | with prompt logprobs ms | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    prompts = {n: [rng.randrange(100, vocab) for _ in range(n)] for n in args.lengths}
    for n, prompt in prompts.items():
        times: dict[str, list[float]] = {"plain": [], "with": []}
        timed(llm, prompt, plain)  # warm-up
        for i in range(args.rounds):
            order = ("plain", "with") if i % 2 == 0 else ("with", "plain")
            for name in order:
                times[name].append(timed(llm, prompt, plain if name == "plain" else wanted))
        a, b = (statistics.median(times[k]) * 1000 for k in ("plain", "with"))
        print(f"| {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x |")
    if args.check:
        check(args, llm, prompts[max(prompts)], wanted)
    return 0


def check(args: argparse.Namespace, llm: Any, prompt: list[int], params: Any) -> None:
    import torch
    import transformers

    out = llm.generate({"prompt_token_ids": prompt}, params)[0]
    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
    with torch.no_grad():
        reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(dim=-1)
    diffs, same_top = [], 0
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = reference[position - 1]
        diffs.append(abs(entry.logprob - row[prompt[position]].item()))
        same_top += [t for t, _ in entry.top] == row.topk(args.top).indices.tolist()
    print(
        f"against transformers ({len(diffs)} prompt tokens): max |logprob difference| "
        f"{max(diffs):.2e}, mean {statistics.fmean(diffs):.2e}; top-{args.top} ids the same "
        f"on {same_top} of {len(diffs)}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
