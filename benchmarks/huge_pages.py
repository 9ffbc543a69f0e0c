"""The CPU KV pool on 2 MiB pages or on 4 KiB pages: a lone request's decode step at a few
context lengths. Two engines in this one process, one made with ``KVRELAY_HUGE_PAGES=1`` and
one with ``0`` (the variable is read as each engine allocates its pool), run in turns (A, B,
B, A, ...); each run generates ``--steps`` tokens after a prompt of the given length and takes
the median of its decode steps' times (the engine's ``step``, timed around it; the prompt's
steps are left out). Reported: the medians of the runs and the median of the paired ratios.

    python benchmarks/huge_pages.py --model DIR [--dtype bfloat16] [--contexts 16 2000]
        [--rounds 8] [--write]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import command_line, cpu_model, markdown_table, update_benchmarks_md

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SECTION = "Huge pages under the KV pool"
CHURN_PROMPT = 256  # the longest prompt of the requests served first
ABOUT = """\
A lone request's decode step, the CPU KV pool on transparent huge pages (`kernels/hugepages.py`,
`KVRELAY_HUGE_PAGES=1`, the default) against 4 KiB pages (`0`): two engines in one process,
runs in turns, each the median of its decode steps; "paired" is the median of each round's
ratio. A step reads every block of its sequence, and the blocks lie anywhere in the pool: with
4 KiB pages each block of each kv head is a TLB miss and a page walk, two in a VM."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--contexts", type=int, nargs="+", default=[16, 2000], help="prompt tokens")
    p.add_argument("--steps", type=int, default=64, help="decode steps a run")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument(
        "--churn", type=int, default=64,
        help="requests of mixed lengths each engine serves first, so that its free blocks are "
        "in the order a busy server leaves them (0: a fresh pool, blocks in order)",
    )  # fmt: skip
    p.add_argument("--write", action="store_true", help="replace the BENCHMARKS.md section")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from kvrelay import LLM, SamplingParams
    from kvrelay.engine import engine as engine_module

    durations: list[float] = []
    step = engine_module.LLMEngine.step

    def timed_step(self: Any) -> Any:
        start = time.perf_counter()
        out = step(self)
        durations.append(time.perf_counter() - start)
        return out

    engine_module.LLMEngine.step = timed_step  # type: ignore[method-assign]
    engines = {}
    for huge in ("1", "0"):
        os.environ["KVRELAY_HUGE_PAGES"] = huge  # read as the engine allocates its pool
        engines[huge] = LLM(
            model=args.model, dtype=args.dtype, seed=0, num_threads=args.threads,
            enable_prefix_caching=False,
            max_model_len=max(max(args.contexts) + args.steps, CHURN_PROMPT + 64) + 16,
        )  # fmt: skip
    os.environ.pop("KVRELAY_HUGE_PAGES")
    vocab = engines["1"].engine.config.model_config.vocab_size
    params = SamplingParams(max_tokens=args.steps + 1, ignore_eos=True, temperature=0)

    def decode_ms(llm: Any, prompt: list[int]) -> float:
        durations.clear()
        llm.generate([{"prompt_token_ids": prompt}], [params])
        return statistics.median(durations[-args.steps :]) * 1e3

    rng = random.Random(0)
    churn = [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(16, CHURN_PROMPT))],
            rng.randint(1, 64),
        )
        for _ in range(args.churn)
    ]
    for llm in engines.values():  # requests that end at different steps free their blocks
        llm.generate(  # interleaved: a later sequence's blocks lie anywhere in the pool
            [{"prompt_token_ids": p} for p, _ in churn],
            [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0) for _, n in churn],
        )
    rows = []
    for context in args.contexts:
        prompt = [(7 * i) % (vocab - 100) + 100 for i in range(context)]
        runs: dict[str, list[float]] = {"1": [], "0": []}
        for llm in engines.values():
            decode_ms(llm, prompt)  # untimed: the first run's pool pages
        for r in range(args.rounds):
            for huge in ("1", "0") if r % 2 == 0 else ("0", "1"):
                runs[huge].append(decode_ms(engines[huge], prompt))
        paired = statistics.median(a / b for a, b in zip(runs["1"], runs["0"]))
        rows.append([
            context, f"{statistics.median(runs['1']):.2f}", f"{statistics.median(runs['0']):.2f}",
            f"{paired:.2f}x", " / ".join(f"{a / b:.2f}" for a, b in zip(runs["1"], runs["0"])),
        ])  # fmt: skip
        print(f"context {context}: 2 MiB {runs['1']}, 4 KiB {runs['0']}", file=sys.stderr)
    headers = ["context", "2 MiB pages ms", "4 KiB pages ms", "paired", "rounds"]
    table = markdown_table(headers, rows)
    model = Path(args.model).name
    print(table)
    if args.write:
        body = (
            f"{ABOUT}\n\n{cpu_model()}, {args.threads} threads, `{model}` {args.dtype}, "
            f"{args.steps} decode steps a run, {args.rounds} rounds, after {args.churn} "
            f"requests of mixed lengths:\n\n{table}"
        )
        update_benchmarks_md(SECTION, body, command_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
