"""Builds the one native piece, ``kvrelay/csrc/kvcopy.c``: a plain shared library (no Python
C-API) that ``kvrelay.transport.slabhash`` loads with ctypes. Everything else is in
pyproject.toml. ``optional``: without a C compiler the install still succeeds and the KV
checksum runs in numpy + xxhash (same values, slower; logged once)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvrelay.transport._kvcopy",
            sources=["kvrelay/csrc/kvcopy.c"],
            extra_compile_args=["-O3", "-std=c99"],
            optional=True,
        )
    ]
)
