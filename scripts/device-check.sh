#!/usr/bin/env bash
# The GPU checks in one call, run ON the lent GPU machine from the repo root: the CUDA tests,
# then the step benchmark, then the token path. Each part has its own timeout, about 8
# minutes in all, and each writes its log under $OUT. Here, first:
#
#   bash scripts/device-wheels.sh        # .whl/: what that machine lacks
#   mkdir -p .gpu/smollm2 && cp SMOLLM2_DIR/{config.json,tokenizer.json,tokenizer_config.json} .gpu/smollm2/
#   echo /.gpu/ >> .git/info/exclude     # SmolLM2's shapes for --like (no weights needed)
#
# then the device tool's `run` with command "bash scripts/device-check.sh", carry
# [".whl", ".gpu"] and timeout_s 540. LIKE overrides the config directory; without one, a
# make-tiny `medium` is made there. These are the commands of 2026-11-28's GPU stop
# (BENCHMARKS.md "Prompt and mixed steps on a GPU").
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/device-check}"
mkdir -p "$OUT"
LIKE="${LIKE:-.gpu/smollm2}"
if [ ! -f "$LIKE/config.json" ]; then
  python3 -m kvrelay model make-tiny /tmp/like-medium --size medium > /dev/null || exit 1
  LIKE=/tmp/like-medium
fi
nvidia-smi -L
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton_rows.py \
  tests/test_triton_attention.py > "$OUT/tests.log" 2>&1
echo "tests rc=$?"
grep -v "CUDAGraph.cpp" "$OUT/tests.log" | tail -8

timeout 120 python3 benchmarks/gpu_steps.py --like "$LIKE" --mixed-graphs all --requests 64 \
  --passes 2 > "$OUT/steps.log" 2>&1
echo "steps rc=$?"
grep "engine + warm-up\|pass2\|last pass" "$OUT/steps.log"

timeout 180 python3 benchmarks/token_path.py --like "$LIKE" --device cuda --dtype bfloat16 \
  --threads 4 --requests 24 --concurrency 1 8 32 --max-tokens 128 --json "$OUT/tp.json" \
  > "$OUT/tp.log" 2>&1
echo "token path rc=$?"
tail -9 "$OUT/tp.log"
