"""The packed copies' two kernels on this CPU: kvrelay's panels (``csrc/panels.c``) against
oneDNN's blocked layout (``KVRELAY_CPU_PACKED_KERNEL``).

1. Products: SmolLM2-135M's four projection shapes in 30 layers of distinct random float32
   weights (425 MB: every call reads its weight from memory, as an engine step does), x of
   ``--rows`` rows; per row count the two kernels alternate, median of ``--repeats``.
2. Engines: two engines of ``--model`` in one process, packed with each kernel, run the offline
   workload of ``peers.py`` (64 requests, prompts 16-128, outputs 16-64) interleaved (A, B, A,
   B) after one untimed run each; medians of ``--repeats``; prefix caching off. Greedy tokens
   of both are compared on the whole workload.

Usage: python benchmarks/cpu_panels.py --model DIR [--dtype float32 bfloat16] [--write]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_model, markdown_table, median, update_benchmarks_md
from cpu_packed import interleaved
from peers import make_requests, model_vocab

TITLE = "Packed panels: the copies of steps of many rows on an AVX2 CPU"
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out), SmolLM2-135M
LAYERS = 30


def products(rows: list[int], repeats: int, layers: int = LAYERS) -> list[list[str]]:
    from kvrelay.kernels import cpu_packed, cpu_panels

    plain = [[torch.randn(i, o) for i, o in SHAPES] for _ in range(layers)]  # [in, out]
    copies = {}
    for kind in ("panels", "onednn"):
        cpu_packed.kernel = lambda kind=kind: kind  # type: ignore[assignment]
        copies[kind] = [[cpu_packed.pack(w, transposed=True) for w in ws] for ws in plain]
    del plain
    out = []
    flops_per_row = 2 * layers * sum(i * o for i, o in SHAPES)
    for m in rows:
        xs = {i: torch.randn(m, i) for i, _ in SHAPES}
        times: dict[str, list[float]] = {kind: [] for kind in copies}
        for _ in range(repeats):
            for kind, layers in copies.items():
                start = time.perf_counter()
                for ws in layers:
                    for (i, _), w in zip(SHAPES, ws, strict=True):
                        cpu_packed.linear(xs[i], w)
                times[kind].append(time.perf_counter() - start)
        p, d = statistics.median(times["panels"]), statistics.median(times["onednn"])
        rate = [f"{m * flops_per_row / t / 1e9:.0f}" for t in (p, d)]
        out.append([str(m), f"{p * 1e3:.1f}", rate[0], f"{d * 1e3:.1f}", rate[1], f"{d / p:.2f}x"])
    assert cpu_panels.PANEL == 16
    return out


def build(model: str, dtype: str, threads: int, kind: str) -> Any:
    from kvrelay import LLM
    from kvrelay.kernels import cpu_packed

    cpu_packed.kernel = lambda: kind  # type: ignore[assignment]  # packing reads it
    os.environ["KVRELAY_CPU_PACKED_WEIGHTS"] = "1"  # packed before the engine starts
    try:
        llm = LLM(
            model=model, dtype=dtype, seed=0, num_threads=threads, max_model_len=2048,
            enable_prefix_caching=False,  # timed runs repeat the same prompts
        )  # fmt: skip
    finally:
        del os.environ["KVRELAY_CPU_PACKED_WEIGHTS"]
    packed = llm.engine.runner.model.packed
    assert packed and all(isinstance(w, cpu_packed.Panels) == (kind == "panels")
                          for w in packed.values())  # fmt: skip
    return llm


def engines(args: argparse.Namespace, dtype: str) -> tuple[list[list[str]], str]:
    requests = make_requests(args.num_requests, model_vocab(args.model))
    llms = {kind: build(args.model, dtype, args.threads, kind) for kind in ("panels", "onednn")}
    tok_s, tokens, load = interleaved(llms, requests, args.repeats)
    same = sum(a == b for a, b in zip(tokens["panels"], tokens["onednn"], strict=True))
    rows = [[dtype, kind, f"{median(tok_s[kind]):.1f}",
             " / ".join(f"{v:.1f}" for v in tok_s[kind]), load] for kind in llms]  # fmt: skip
    ratio = median(tok_s["panels"]) / median(tok_s["onednn"])
    rows.append([dtype, "panels / oneDNN", f"{ratio:.2f}x", "", ""])
    return rows, f"{dtype}: greedy tokens identical on {same} of {len(requests)} requests."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 2048])
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--layers", type=int, default=LAYERS, help="distinct layers of weights")
    p.add_argument("--write", action="store_true", help="replace the BENCHMARKS.md section")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from kvrelay.kernels import gemv

    gemv.set_threads(args.threads)
    gemv.use_openmp(True)  # as the engine's batched steps run the library's jobs
    product_rows = products(args.rows, args.repeats, args.layers)
    gemv.use_openmp(False)
    engine_rows, same = [], []
    for dtype in args.dtype:
        dtype_rows, sentence = engines(args, dtype)
        engine_rows += dtype_rows
        same.append(sentence)
    product_headers = ["rows", "panels ms", "panels GFLOP/s", "oneDNN ms", "oneDNN GFLOP/s",
                       "oneDNN / panels"]  # fmt: skip
    engine_headers = ["dtype", "packed kernel", "offline tok/s", "runs tok/s", "load avg"]
    body = "\n".join(
        [
            f"{cpu_model()}, {args.threads} threads. Products: SmolLM2-135M's projections, "
            f"{LAYERS} layers of distinct float32 weights (every call reads its weight from "
            f"memory), medians of {args.repeats} alternating runs:",
            "",
            markdown_table(product_headers, product_rows),
            "",
            f"Engines: `{Path(args.model).name}`, {args.num_requests} requests (prompts 16-128, "
            f"outputs 16-64, ignore_eos), prefix caching off, medians of {args.repeats} "
            "interleaved runs after one untimed run each:",
            "",
            markdown_table(engine_headers, engine_rows),
            "",
            " ".join(same),
        ]
    )
    print(body)
    if args.write:
        update_benchmarks_md(TITLE, body, " ".join(["python", *sys.argv]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
