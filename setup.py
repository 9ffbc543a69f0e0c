"""Builds the native pieces, plain shared libraries (no Python C-API) loaded with ctypes:
``kvrelay/csrc/kvcopy.c`` (KV copy and checksum, ``kvrelay.transport.slabhash``) and
``kvrelay/csrc/gemv.c`` (decode-step matmuls, ``kvrelay.kernels.gemv``) with the other CPU
kernels (attention, the whole decode step, row ops, ``kvrelay.kernels.cpu_panels``' products).
Everything else is in pyproject.toml. ``optional``: without a C compiler the install still
succeeds; the KV checksum runs in numpy + xxhash and the matmuls in torch (same results,
slower; logged once)."""

import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The kernels' flags, after Python's own CFLAGS. No fused multiply-adds the source did not
# write (-ffp-contract=off): decode.c rounds as torch does. -fopenmp: the kernels' thread pool
# is OpenMP's (libgomp), the one torch's CPU build loads, so native kernels and torch ops share
# one team of threads. benchmarks/panels_ab.py builds with these too, after Python's CFLAGS.
KERNEL_FLAGS = ["-O3", "-std=gnu99", "-pthread", "-fopenmp", "-ffp-contract=off"]


class BuildExt(build_ext):
    """``build_ext --inplace`` that puts each library in place by renaming a fresh copy over
    it: the default copy rewrites the file in place, and a process that has it loaded (a
    benchmark, a worker) then runs the new bytes under the old symbols and crashes or computes
    nonsense. A rename leaves such a process its own, unchanged file."""

    def copy_file(self, infile, outfile, *args, **kwargs):
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        staged = f"{outfile}.{os.getpid()}.tmp"
        _, copied = super().copy_file(infile, staged, *args, **kwargs)
        os.replace(staged, outfile)
        return outfile, copied


setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "kvrelay.transport._kvcopy",
            sources=["kvrelay/csrc/kvcopy.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        ),
        Extension(
            "kvrelay.kernels._gemv",
            sources=[
                "kvrelay/csrc/gemv.c",
                "kvrelay/csrc/attention.c",
                "kvrelay/csrc/attention_blocks.c",
                "kvrelay/csrc/attention_tiles.c",
                "kvrelay/csrc/decode.c",
                "kvrelay/csrc/rows.c",
                "kvrelay/csrc/panels.c",
            ],
            depends=[
                "kvrelay/csrc/attention.h",
                "kvrelay/csrc/attention_tiles.h",
                "kvrelay/csrc/bf16.h",
                "kvrelay/csrc/pool.h",
                "kvrelay/csrc/rowops.h",
                "kvrelay/csrc/vexp.h",
            ],
            extra_compile_args=KERNEL_FLAGS,
            extra_link_args=["-pthread", "-fopenmp"],
            optional=True,
        ),
    ],
)
