"""The panels' products (``csrc/panels.c``) of two builds of the native library, side by side.

A kernel change is measured against the kernel before it in the same process: the native
sources of ``--base`` (a commit) and of the working tree are each compiled into a library
of their own (as setup.py compiles ``_gemv``: Python's CFLAGS, then its ``KERNEL_FLAGS``;
``-D`` defines for the tree's build try a constant), both are loaded, and the products
alternate between them (A, B, B, A...) over SmolLM2-135M's four projection shapes in 30
layers of distinct float32 weights packed once (425 MB: every call reads its weight from
memory, as a batched engine step does). Per row count: the median time of each build, its
GFLOP/s, the ratio to the base, the median and range of the ratios within each repeat (its
two runs are adjacent in time: the machine's drift between repeats cancels), and whether the
two builds' outputs are equal bit for bit (each row's sums are meant not to change). This
VM's host has slower spells (the same build 20-25% slower for minutes): a change that helps
in one may hurt in the other, so repeat an A/B at another time before keeping it (BENCHMARKS
"Panels: the next panel's lines spread over the tiles").

    python benchmarks/panels_ab.py --base REV [--rows 8 16 64 256 2048] [--repeats 5]
        [-D KC=256 ...]
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import shlex
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO_ROOT, cpu_model, markdown_table
from cpu_panels import LAYERS, SHAPES

# setup.py's _gemv; attention_blocks.c since 5e13856, attention_tiles.c since the split of
# attention.c (a base before either has none: compile_library skips a missing file)
SOURCES = (
    "gemv.c",
    "attention.c",
    "attention_blocks.c",
    "attention_tiles.c",
    "decode.c",
    "rows.c",
    "panels.c",
)


def build_flags() -> list[str]:
    """The flags the installed library is compiled with: Python's CFLAGS (setuptools passes
    them first; they include -fwrapv, which changes the tile's code) and setup.py's
    ``KERNEL_FLAGS``, read from its source."""
    tree = ast.parse((REPO_ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "KERNEL_FLAGS" for t in node.targets
        ):
            kernel = list(ast.literal_eval(node.value))
            break
    else:
        raise RuntimeError("setup.py has no KERNEL_FLAGS")
    python = shlex.split(sysconfig.get_config_var("CFLAGS") or "")
    return [*python, *kernel, "-shared", "-fPIC"]


FLAGS = build_flags()


def compile_library(csrc: Path, out: Path, defines: list[str]) -> subprocess.Popen:
    """gcc building ``csrc``'s library into ``out`` (started, not waited for)."""
    sources = [str(csrc / name) for name in SOURCES if (csrc / name).exists()]
    return subprocess.Popen(
        ["gcc", *FLAGS, *(f"-D{d}" for d in defines), *sources, "-o", str(out), "-lm"]
    )


def load(out: Path) -> ctypes.CDLL:
    library = ctypes.CDLL(str(out))
    c_int, ptr = ctypes.c_int, ctypes.c_void_p
    library.panels_gemm.argtypes = [c_int] * 3 + [ptr] * 4 + [c_int]
    library.panels_pack.argtypes = [c_int, c_int, ptr, c_int, c_int, ptr]
    library.panels_pack.restype = None
    return library


def base_sources(rev: str, into: Path) -> Path:
    """``rev``'s ``kvrelay/csrc`` extracted under ``into``."""
    archive = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "archive", rev, "kvrelay/csrc"],
        check=True,
        capture_output=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "kvrelay" / "csrc"


def compare(libs: dict[str, ctypes.CDLL], rows: list[int], repeats: int, threads: int,
            layers_n: int = LAYERS) -> list[list]:  # fmt: skip
    for library in libs.values():
        library.gemv_set_threads(threads)
        library.gemv_use_openmp(1)  # as an engine's batched steps run the library's jobs
    first = next(iter(libs.values()))
    layers = []
    for _ in range(layers_n):
        packed = []
        for k, n in SHAPES:
            weight, data = torch.randn(k, n), torch.empty(-(-n // 16), k, 16)
            first.panels_pack(k, n, weight.data_ptr(), 0, 1, data.data_ptr())
            packed.append((k, n, data))
        layers.append(packed)
    flops_per_row = 2 * layers_n * sum(k * n for k, n in SHAPES)
    table = []
    for m in rows:
        xs = {k: torch.randn(m, k) for k, _ in SHAPES}
        times: dict[str, list[float]] = {name: [] for name in libs}
        outputs = {}
        for rep in range(repeats):
            for name in list(libs) if rep % 2 == 0 else list(libs)[::-1]:
                ys = {n: torch.empty(m, n) for _, n in SHAPES}
                start = time.perf_counter()
                for packed in layers:
                    for k, n, data in packed:
                        libs[name].panels_gemm(
                            m, k, n, xs[k].data_ptr(), data.data_ptr(), None, ys[n].data_ptr(),
                            threads,
                        )  # fmt: skip
                times[name].append(time.perf_counter() - start)
                outputs[name] = ys
        base, tree = (statistics.median(times[name]) for name in libs)
        # each repeat's two runs are adjacent in time: their ratio cancels the machine's
        # drift between repeats, which on a shared VM moves both by more than a kernel
        # change does (BENCHMARKS "Panels: even tiles, and what else was tried")
        paired = sorted(b / t for b, t in zip(*times.values(), strict=True))
        a, b = outputs.values()
        same = all(torch.equal(a[n], b[n]) for _, n in SHAPES)
        table.append([
            m, f"{base * 1e3:.1f}", f"{m * flops_per_row / base / 1e9:.0f}", f"{tree * 1e3:.1f}",
            f"{m * flops_per_row / tree / 1e9:.0f}", f"{base / tree:.2f}x",
            f"{statistics.median(paired):.2f}x ({paired[0]:.2f}-{paired[-1]:.2f})",
            "yes" if same else "NO",
        ])  # fmt: skip
    return table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base", required=True, help="the commit whose kernel is the baseline")
    p.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 256, 2048])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=int, default=LAYERS, help="distinct layers of weights")
    p.add_argument("-D", dest="defines", action="append", default=[], help="for the tree's build")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {  # both compiles at once
            "base": compile_library(base_sources(args.base, Path(tmp)), Path(tmp) / "base.so", []),
            "tree": compile_library(
                REPO_ROOT / "kvrelay" / "csrc", Path(tmp) / "tree.so", args.defines
            ),
        }
        if any(gcc.wait() != 0 for gcc in builds.values()):
            p.error("a build failed (gcc's errors above)")
        libs = {name: load(Path(tmp) / f"{name}.so") for name in builds}
        table = compare(libs, args.rows, args.repeats, args.threads, args.layers)
    headers = ["rows", "base ms", "base GFLOP/s", "tree ms", "tree GFLOP/s", "tree speed-up",
               "paired speed-up (range)", "same outputs"]  # fmt: skip
    print(f"{cpu_model()}, {args.threads} threads, base {args.base} against the tree"
          + (f" (-D {' -D '.join(args.defines)})" if args.defines else ""))  # fmt: skip
    print(markdown_table(headers, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
