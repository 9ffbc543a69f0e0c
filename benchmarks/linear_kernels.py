"""The projection GEMMs of SmolLM2-135M through each CPU linear kernel torch 2.13 offers:
``torch.mm`` on an ``[in, out]`` weight (kvrelay's layout), ``F.linear`` on ``[out, in]``, MKL's
packed sgemm (``torch.ops.mkl._mkl_linear``, weight packed once) and oneDNN with a prepacked
weight (``torch.ops.mkldnn._linear_pointwise``). Fastest of N runs per cell (ms), so that a
shared machine's stalls fall out.

    python benchmarks/linear_kernels.py [--threads 1] [--runs 30]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))  # (in, out)


def fastest_ms(fn: Callable[[], object], runs: int) -> float:
    fn()
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def kernels(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    rows = x.shape[0]
    wt = w.t().contiguous()
    mkl_w = torch.ops.mkl._mkl_reorder_linear_weight(w, rows)
    dnnl_w = torch.ops.mkldnn._reorder_linear_weight(w, None)
    return {
        "mm [in,out]": lambda: torch.mm(x, wt),
        "F.linear": lambda: F.linear(x, w),
        "MKL packed": lambda: torch.ops.mkl._mkl_linear(x, mkl_w, w, None, rows),
        "oneDNN packed": lambda: torch.ops.mkldnn._linear_pointwise(
            x, dnnl_w, None, "none", [], ""
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 128])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = None
    for rows in args.rows:
        for k, n in SHAPES:
            fns = kernels(torch.randn(rows, k), torch.randn(n, k))
            if names is None:
                names = list(fns)
                print("| rows | in x out | " + " | ".join(names) + " |")
                print("|---" * (2 + len(names)) + "|")
            cells = [f"{fastest_ms(f, args.runs):.3f}" for f in fns.values()]
            print(f"| {rows} | {k} x {n} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
