#!/usr/bin/env bash
# Wheels that the lent GPU machine lacks, for running kvrelay's CUDA tests and GPU benchmarks
# there. That machine reaches no package index. Its image has torch, triton, numpy,
# safetensors, tokenizers, transformers, msgpack, uvloop, httpx, prometheus-client, pytest and
# xxhash, under Python 3.12, but none of the packages below. Run this here, in the repo root;
# it writes them to .whl/ (git ignores it through .git/info/exclude), at the versions this
# environment has. Then, on the GPU machine, with .whl carried:
#
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
#   python3 -m pytest -q tests/test_cuda.py tests/test_triton_attention.py
#
# (scripts/device-check.sh does this and the GPU benchmarks in one call.)
#
# About 19 MB. The list was found one missing import at a time (2026-11-28): fastapi 0.165
# imports opentelemetry, and openai 3.x imports httpx2.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
packages=(
  pyzmq fastapi starlette pydantic pydantic-core annotated-types typing-inspection
  opentelemetry-api uvicorn redis hiredis openai httpx2 httpcore2 truststore distro jiter
  sniffio anyio pytest-timeout blake3 xgrammar apache-tvm-ffi jsonschema referencing rpds-py
  jsonschema-specifications cryptography cffi pycparser gguf
)
platforms=()
# the older tags first: pip prefers them, and they are the ones that ran there
for p in manylinux_2_28 manylinux_2_27 manylinux_2_26 manylinux_2_24 manylinux_2_17 \
         manylinux2014 manylinux1 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
mkdir -p .whl
for name in "${packages[@]}"; do
  version=$(python -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}')
  if [ -z "$version" ]; then
    echo "$name is not installed here: pip install -e '.[test]' first" >&2
    exit 1
  fi
  python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${platforms[@]}" -d .whl "$name==$version"
done
ls .whl | wc -l | xargs echo "wheels in .whl:"
