"""CPU prefill attention: kvrelay's native kernel (a row per token over the block pool) against
torch's SDPA (one causal call per segment), by segment length.

Each case is 2,048 prompt tokens in segments of one length (16 x 128 ... 2,048 x 1; longer
lengths are one segment), SmolLM2's heads (9 query, 3 kv, head size 64). The native kernel
takes the step's rows in one call (``cpu_attention.decode`` with a per-row table, as the
runner builds for segments up to ``cpu_attention.prefill_limit``), each row attending over
its segment's keys up to its own position, read from a pool whose blocks are drawn at random;
SDPA gets each segment's contiguous queries, keys and values (``is_causal``, grouped-query
heads). Printed: the median time of ``--iters`` calls for each path the CPU has (AVX-512,
AVX2: ``--paths``) and SDPA's, and their ratio. This is what sets ``prefill_limit``.

    python benchmarks/prefill_attention.py [--dtypes float32 bfloat16] [--lengths 16 128 1024]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from decode_attention import median_ms

from kvrelay.kernels import cpu_attention, gemv

PATH_NAMES = {0: "portable C", 1: "AVX2", 2: "AVX-512"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument(
        "--lengths", nargs="+", type=int, default=[16, 32, 64, 128, 256, 512, 1024, 2048]
    )
    parser.add_argument("--paths", nargs="+", type=int, default=[2, 1], help="2 AVX-512, 1 AVX2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--iters", type=int, default=9)
    return parser.parse_args(argv)


def case(dtype: torch.dtype, length: int, iters: int, paths: list[int]) -> str:
    block_size, kv_heads, q_heads, head_dim = 16, 3, 9, 64
    segments = max(1, 2048 // length)
    per_segment = -(-length // block_size)
    num_blocks = segments * per_segment + 1
    gen = torch.Generator().manual_seed(length)
    kv = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    free = list(range(1, num_blocks))
    random.Random(length).shuffle(free)
    tables = [[free.pop() for _ in range(per_segment)] for _ in range(segments)]
    rows = list(range(segments * length))
    ctx_lens = [pos + 1 for _ in range(segments) for pos in range(length)]
    row_table = [s for s in range(segments) for _ in range(length)]
    batch = cpu_attention.make_decode(rows, ctx_lens, tables, row_table)
    q = torch.randn(len(rows), q_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(len(rows), kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(rows), kv_heads, head_dim, generator=gen).to(dtype)
    out = torch.empty_like(q)
    scale = head_dim**-0.5

    def sdpa() -> None:
        for s in range(segments):
            r = slice(s * length, (s + 1) * length)
            F.scaled_dot_product_attention(
                *(t[r].unsqueeze(0).transpose(1, 2) for t in (q, k, v)),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            )

    library = gemv.load_library()
    assert library is not None
    old = library.attention_set_isa(-1)
    timings = []
    try:
        for path in paths:
            library.attention_set_isa(path)
            if library.attention_isa(1 if dtype == torch.bfloat16 else 0, head_dim) != path:
                continue  # the CPU lacks it
            native = median_ms(lambda: cpu_attention.decode(q, kv, batch, None, scale, out), iters)
            timings.append((PATH_NAMES[path], native))
    finally:
        library.attention_set_isa(old)
    torch_ms = median_ms(sdpa, iters)
    cells = "  ".join(f"{name} {ms:7.2f} ms ({ms / torch_ms:.2f}x)" for name, ms in timings)
    return f"{str(dtype)[6:]:9s} {length:5d} x {segments:4d}: SDPA {torch_ms:7.2f} ms  {cells}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gemv.set_threads(args.threads)
    gemv.use_openmp(True)  # as the runner runs a prefill step's library jobs
    print("dtype     length x segments: median ms of the 2,048 rows (native / SDPA)")
    for name in args.dtypes:
        for length in args.lengths:
            print(case(getattr(torch, name), length, args.iters, args.paths))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
