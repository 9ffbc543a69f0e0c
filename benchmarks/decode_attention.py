"""kvrelay's native CPU decode attention (``csrc/attention.c``) over a pool whose blocks are
scattered, as in a server after some churn, and its tied-LM-head product (``gemv_nk`` in
``csrc/gemv.c``) at a few rows; optionally against the kernels at another commit.

Each case is a batch of sequences of one context length attending over 30 layers' pools (a
pool per layer, so that a layer's keys come from memory, not from the cache the layer before
left warm), every sequence's blocks drawn at random from the pool. The pools are allocated as the
engine's KV pool is (``kernels.hugepages``: on huge pages where the host allows;
``KVRELAY_HUGE_PAGES=0`` for 4 KiB pages). Reported: the median time
of the 30 layers and the K/V bytes read per second. An ``lm:dtype:rows`` case multiplies
``rows`` rows by SmolLM2's tied embedding (49,152 x 576, stored [vocab, hidden]) on the
library's own pool, as a decode step of that many sequences does; GB/s = the table's bytes.
With ``--base REV`` the library is built at that commit in a git worktree
(``engine_ab.base_tree``) and the two are timed in turns, in separate processes (A, B, B,
A...), with their outputs' sums printed beside the times.

    python benchmarks/decode_attention.py [--base REV] [--cases f32:32:260 bf16:64:300]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LAYERS, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, Q_HEADS = 30, 1456, 16, 3, 64, 9  # SmolLM2
DEFAULT_CASES = ["f32:32:260", "bf16:64:300", "f32:16:1000", "f32:1:1024", "bf16:1:1024"]
DEFAULT_CASES += ["lm:f32:4", "lm:f32:8", "lm:bf16:4", "lm:bf16:8"]
VOCAB, HIDDEN = 49152, 576


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=DEFAULT_CASES, help="dtype:seqs:context or lm:dtype:rows"
    )
    parser.add_argument("--base", default=None, help="a commit whose kernel is timed beside")
    parser.add_argument("--worktree", default="/tmp/kvrelay-attn-base", help="where it is built")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each build per case")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=15)
    parser.add_argument(
        "--pool-blocks",
        type=int,
        default=NUM_BLOCKS,
        help="blocks in each layer's pool, which the cases' blocks are drawn from",
    )
    parser.add_argument("--library", default=None, help=argparse.SUPPRESS)  # one measurement
    return parser.parse_args(argv)


def library_path(root: Path) -> Path:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = root / "kvrelay" / "kernels" / f"_gemv{suffix}"
        if path.exists():
            return path
    raise FileNotFoundError(f"no built native library under {root} (setup.py build_ext)")


def median_ms(run: Callable[[], None], iters: int) -> float:
    """Median milliseconds of ``iters`` calls of ``run`` after three warm-up calls."""
    for _ in range(3):
        run()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def measure(
    library: str, case: str, threads: int, iters: int, pool_blocks: int = NUM_BLOCKS
) -> dict[str, float]:
    """Times ``case`` on ``library`` in this process: median ms over 30 layers, GB/s, checksum;
    each layer's pool has ``pool_blocks`` blocks."""
    import torch

    from kvrelay.kernels import cpu_attention, gemv, hugepages

    lib = ctypes.CDLL(library)
    lib.decode_attention.argtypes = [ctypes.c_int] * 8 + [ctypes.c_float] + [ctypes.c_void_p] * 7
    lib.decode_attention.restype = ctypes.c_int
    lib.gemv.argtypes = [ctypes.c_int] * 5 + [ctypes.c_void_p] * 3
    lib.gemv.restype = ctypes.c_int
    lib.gemv_set_threads.argtypes = lib.gemv_use_openmp.argtypes = [ctypes.c_int]
    torch.set_num_threads(threads)
    lib.gemv_set_threads(threads)
    gemv.load_library = lambda: lib  # cpu_attention.decode and gemv call the library given
    if case.startswith("lm:"):
        return measure_lm_head(lib, case, iters)
    name, seqs, ctx = case.split(":")
    n, ctx_len = int(seqs), int(ctx)
    lib.gemv_use_openmp(int(n > 1))  # as the runner sets it: batched steps on OpenMP
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[name]
    gen = torch.Generator().manual_seed(0)
    shape = (2, pool_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    pools = [
        hugepages.empty(shape, dtype).copy_(torch.randn(shape, generator=gen))
        for _ in range(LAYERS)
    ]
    blocks = list(range(1, pool_blocks))
    random.Random(0).shuffle(blocks)
    per_seq = -(-ctx_len // BLOCK_SIZE)
    if n * per_seq > len(blocks):
        raise ValueError(f"{case}: {n * per_seq} blocks asked, the pool has {len(blocks)}")
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(n)]
    batch = cpu_attention.make_decode(list(range(n)), [ctx_len] * n, tables)
    q = torch.randn(n, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    out = torch.empty_like(q)

    code = 0 if dtype == torch.float32 else 1

    def run() -> None:  # the entry point every build has (a base commit's too)
        for pool in pools:
            lib.decode_attention(
                code, n, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, batch.tables.shape[1], 0,
                HEAD_DIM**-0.5, q.data_ptr(), pool[0].data_ptr(), pool[1].data_ptr(),
                batch.rows.data_ptr(), batch.tables.data_ptr(), batch.ctx_lens.data_ptr(),
                out.data_ptr(),
            )  # fmt: skip

    ms = median_ms(run, iters)
    kv_bytes = n * ctx_len * KV_HEADS * HEAD_DIM * 2 * q.element_size() * LAYERS
    return {"ms": ms, "gb_s": kv_bytes / ms / 1e6, "checksum": float(out.float().sum())}


def measure_lm_head(lib: ctypes.CDLL, case: str, iters: int) -> dict[str, float]:
    """``rows`` rows by the tied embedding on the library's pool (a lone step's threads)."""
    import torch

    from kvrelay.kernels import gemv

    _, name, rows = case.split(":")
    torch.set_num_threads(1)  # as in a decode step of at most gemv.MAX_ROWS rows
    lib.gemv_use_openmp(0)
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16}[name]
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype)
    x = torch.randn(int(rows), HIDDEN, generator=gen).to(dtype)
    result: list[torch.Tensor] = []

    def run() -> None:
        result[:] = [gemv.matmul_nt(x, table)]  # kept, not copied: the time is the product's

    ms = median_ms(run, iters)
    out = result[0]
    nbytes = table.numel() * table.element_size()
    return {"ms": ms, "gb_s": nbytes / ms / 1e6, "checksum": float(out.double().sum())}


def run_one(root: Path, case: str, args: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, str(HERE / "decode_attention.py"), "--library", str(library_path(root))]
    cmd += ["--cases", case, "--threads", str(args.threads), "--iters", str(args.iters)]
    cmd += ["--pool-blocks", str(args.pool_blocks)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.library:
        result = measure(args.library, args.cases[0], args.threads, args.iters, args.pool_blocks)
        print(json.dumps(result))
        return 0
    builds = {"tree": ROOT}
    worktree = Path(args.worktree)
    try:
        if args.base:
            from engine_ab import base_tree

            builds = {"base": base_tree(args.base, worktree), "tree": ROOT}
        print("| case | " + " | ".join(f"{b} ms (GB/s)" for b in builds)
              + (" | tree / base |" if args.base else ""))  # fmt: skip
        print("| --- |" + " ---: |" * (len(builds) + bool(args.base)))
        for case in args.cases:
            results: dict[str, list[dict[str, float]]] = {b: [] for b in builds}
            for r in range(args.rounds):
                for name in builds if r % 2 == 0 else list(builds)[::-1]:
                    results[name].append(run_one(builds[name], case, args))
            cells, med = [], {}
            for name, runs in results.items():
                med[name] = statistics.median(x["ms"] for x in runs)
                gb_s = statistics.median(x["gb_s"] for x in runs)
                # three decimals under 1 GB/s: the smoke test's ~1 MB cases on a loaded machine
                # (an OpenMP team descheduled at every layer) printed 0.0
                digits = 1 if gb_s >= 1 else 3
                cells.append(f"{med[name]:.2f} ({gb_s:.{digits}f})")
                print(f"{case} {name}: checksum {runs[0]['checksum']:.6f}", file=sys.stderr)
            ratio = [f"{med['tree'] / med['base']:.2f}x"] if args.base else []
            print(f"| {case} | " + " | ".join(cells + ratio) + " |", flush=True)
    finally:
        if args.base:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "-f", str(worktree)])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
