"""How the order a core reads a weight's rows in sets its read bandwidth: gemv.c's kn kernel
taking eight adjacent rows at a time (before) against one row from each of eight equal spans
(now), one core, the projection shapes of SmolLM2-135M, float32 and bfloat16. Compiles
``gemv_streams.c`` beside this file with the C compiler (``cc``) and prints a Markdown table
of GB/s (best of 5 interleaved runs, 400 MB streamed per run).

    python benchmarks/gemv_streams.py
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def main() -> int:
    argparse.ArgumentParser(description=__doc__).parse_args()
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("gemv_streams: no C compiler (cc or gcc) on PATH")
    source = Path(__file__).with_suffix(".c")
    with tempfile.TemporaryDirectory() as tmp:
        binary = Path(tmp) / "gemv_streams"
        subprocess.run([compiler, "-O3", "-std=gnu11", str(source), "-o", str(binary)], check=True)
        run = subprocess.run([str(binary)], check=True, capture_output=True, text=True)
    lines = run.stdout.split("\n")
    rates: dict[tuple[str, str], dict[str, float]] = {}
    for line in filter(None, lines):
        shape, dtype, order, rate = line.split()
        rates.setdefault((shape, dtype), {})[order] = float(rate)
    print("| k x n | dtype | adjacent rows GB/s | spans GB/s | spans / adjacent |")
    print("| --- | --- | ---: | ---: | ---: |")
    for (shape, dtype), by in rates.items():
        ratio = by["spans"] / by["adjacent"]
        print(f"| {shape} | {dtype} | {by['adjacent']:.1f} | {by['spans']:.1f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
