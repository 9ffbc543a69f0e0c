"""How the order a core reads a weight's rows in sets its read bandwidth: gemv.c's kn kernel
taking eight adjacent rows at a time (before) against one row from each of eight equal spans
(now), one core, the projection shapes of SmolLM2-135M, float32 and bfloat16. Compiles
``gemv_streams.c`` beside this file with the C compiler (``$CC``, ``cc`` or ``gcc``) and prints
a Markdown table of GB/s (best of 5 interleaved runs, 400 MB streamed per run).

    python benchmarks/gemv_streams.py [--write]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import command_line, cpu_model, markdown_table, update_benchmarks_md

SECTION = "gemv streams: the order a decode step reads a weight's rows in (one core)"
ABOUT = """\
One core multiplying one row by a weight stored [k, n] (the decode path's layout,
`kvrelay/csrc/gemv.c`), best of 5 interleaved runs, 400 MB streamed per run. "adjacent" takes
eight adjacent rows per step (the kernel before issue #14's stream change); "spans" takes one
row from each of eight equal spans (the kernel now), so the core reads eight long sequential
streams. Eight adjacent rows of a 576-column matrix are eight 1.2 KB pieces of the same pages,
which the hardware prefetcher does not follow as streams; bfloat16 rows are half as long, so
they lose the most. In the engine this took the lone decode step from 25.6 to 22.5 ms (float32)
and from 17.4 to 12.9 ms (bfloat16): see "Peers" for the run. An AVX512-BF16 `vdpbf16ps`
kernel on pair-packed weights and an AVX-512 widening kernel were tried in the same way and
came within 5% of the AVX2 kernel once rows were read as spans (the stream, not the
arithmetic, is the bound), so neither is in the library."""


def measure() -> dict[tuple[str, str], dict[str, float]]:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("gemv_streams: no C compiler (cc or gcc) on PATH")
    source = Path(__file__).with_suffix(".c")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "gemv_streams"
        subprocess.run([compiler, "-O3", "-std=gnu11", str(source), "-o", str(binary)], check=True)
        run = subprocess.run([str(binary)], check=True, capture_output=True, text=True)
    rates: dict[tuple[str, str], dict[str, float]] = {}
    for line in filter(None, run.stdout.split("\n")):
        shape, dtype, order, rate = line.split()
        rates.setdefault((shape, dtype), {})[order] = float(rate)
    return rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rates = measure()
    rows = [
        [shape, dtype, f"{by['adjacent']:.1f}", f"{by['spans']:.1f}",
         f"{by['spans'] / by['adjacent']:.2f}x"]
        for (shape, dtype), by in rates.items()
    ]  # fmt: skip
    headers = ["k x n", "dtype", "adjacent rows GB/s", "spans GB/s", "spans / adjacent"]
    table = markdown_table(headers, rows)
    print(table)
    if args.write:
        body = f"{ABOUT}\n\nCPU: {cpu_model()}.\n\n{table}"
        update_benchmarks_md(SECTION, body, command_line())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
