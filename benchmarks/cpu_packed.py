"""CPU engines with and without ``KVRELAY_CPU_PACKED_WEIGHTS`` (oneDNN-packed weights).

Per dtype, two engines of the same model in one process, one packed and one plain, run the
offline workload of ``peers.py`` (64 requests, prompts 16-128, outputs 16-64) interleaved (A,
B, A, B) after one untimed run each, and a prefill of one long prompt; medians of
``--repeats``. Prefix caching is off (every timed run repeats the same prompts). Greedy tokens
of both are compared on the whole workload.

Usage: python benchmarks/cpu_packed.py --model DIR [--dtype float32 bfloat16] [--write]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, markdown_table, median, update_benchmarks_md
from peers import make_requests, model_vocab

TITLE = "CPU: oneDNN-packed weights (KVRELAY_CPU_PACKED_WEIGHTS)"


def build(model: str, dtype: str, threads: int, packed: bool) -> Any:
    from kvrelay import LLM

    os.environ["KVRELAY_CPU_PACKED_WEIGHTS"] = "1" if packed else "0"
    try:
        return LLM(
            model=model, dtype=dtype, seed=0, num_threads=threads, max_model_len=2048,
            enable_prefix_caching=False,  # timed runs repeat the same prompts
        )  # fmt: skip
    finally:
        del os.environ["KVRELAY_CPU_PACKED_WEIGHTS"]


def offline(llm: Any, requests: list[list[Any]]) -> tuple[float, list[list[int]]]:
    from kvrelay import SamplingParams

    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    return sum(map(len, tokens)) / seconds, tokens


def interleaved(
    engines: dict[str, Any],
    requests: list[list[Any]],
    repeats: int,
    each: Callable[[str, Any], None] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[list[int]]], str]:
    """One untimed offline run of each engine (first-run costs; its greedy tokens), then
    ``repeats`` rounds of them in turn, ``each(name, llm)`` after every timed run (another
    measurement on the same engine). Returns each engine's tok/s of its timed runs, its
    tokens, and the 1-minute load average's range over the runs."""
    tokens = {name: offline(llm, requests)[1] for name, llm in engines.items()}
    tok_s: dict[str, list[float]] = {name: [] for name in engines}
    loads = []
    for _ in range(repeats):
        for name, llm in engines.items():
            tok_s[name].append(offline(llm, requests)[0])
            if each is not None:
                each(name, llm)
            loads.append(os.getloadavg()[0])
    return tok_s, tokens, f"{min(loads):.1f}-{max(loads):.1f}"


def prefill_s(llm: Any, prompt: list[int]) -> float:
    from kvrelay import SamplingParams

    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], [SamplingParams(max_tokens=1, ignore_eos=True)])
    return time.perf_counter() - start


def measure(args: argparse.Namespace, dtype: str) -> tuple[list[list[str]], str]:
    """Table rows of one dtype and its greedy-identity sentence."""
    vocab = model_vocab(args.model)
    requests = make_requests(args.num_requests, vocab)
    long_prompt = make_requests(1, vocab, seed=1)[0][0] * (args.prefill_tokens // 16)
    long_prompt = long_prompt[: args.prefill_tokens]
    engines = {"plain": build(args.model, dtype, args.threads, False)}
    engines["packed"] = build(args.model, dtype, args.threads, True)
    assert engines["packed"].engine.runner.model.packed, "the packed engine packed nothing"
    pre_s: dict[str, list[float]] = {name: [] for name in engines}

    def prefill(name: str, llm: Any) -> None:
        pre_s[name].append(prefill_s(llm, long_prompt))

    tok_s, tokens, load = interleaved(engines, requests, args.repeats, prefill)
    same = sum(a == b for a, b in zip(tokens["plain"], tokens["packed"], strict=True))
    rows = [
        [dtype, name, f"{median(tok_s[name]):.1f}", f"{median(pre_s[name]) * 1e3:.0f}",
         " / ".join(f"{v:.1f}" for v in tok_s[name]), load]
        for name in engines
    ]  # fmt: skip
    rows.append([dtype, "packed / plain",
                 f"{median(tok_s['packed']) / median(tok_s['plain']):.2f}x",
                 f"{median(pre_s['packed']) / median(pre_s['plain']):.2f}x", "", ""])  # fmt: skip
    return rows, f"{dtype}: greedy tokens identical on {same} of {len(requests)} requests."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prefill-tokens", type=int, default=1024)
    p.add_argument("--write", action="store_true", help="replace the BENCHMARKS.md section")
    args = p.parse_args(argv)
    rows, same = [], []
    for dtype in args.dtype:
        dtype_rows, sentence = measure(args, dtype)
        rows += dtype_rows
        same.append(sentence)
    headers = ["dtype", "weights", "offline tok/s", "prefill ms", "runs tok/s", "load avg"]
    body = "\n".join([
        f"`{Path(args.model).name}`, {args.threads} threads, {cpu_model()}; "
        f"{args.num_requests} requests (prompts 16-128, outputs 16-64, ignore_eos), prefix "
        f"caching off, medians of {args.repeats} interleaved runs after one untimed run each; "
        f"prefill: one {args.prefill_tokens}-token prompt.",
        "",
        markdown_table(headers, rows),
        "",
        " ".join(same),
    ])  # fmt: skip
    print(body)
    if args.write:
        update_benchmarks_md(TITLE, body, " ".join(["python", *sys.argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
