#!/usr/bin/env bash
# Issue 31's GPU figures in one device call of about 9 minutes (a GPU-drawn session here has 15 minutes of device
# time in all, machine start included; benchmarks/gpu_suite.sh, the whole set, takes far longer):
#   1. `pytest -m cuda` (the demo, GRPO, offload_policy, offload_states GB/s, compile, MoE/LoRA/VL, chunked-loss and
#      document-mask parity, plan against the CUDA peak), at most 5 minutes;
#   2. gpu_vs_minimal.py on the 1.5B shape: the minimal fully_shard loop and fsdp2kit's defaults, eager and compiled,
#      once each, 10 steps (the targets 0.97x and 1.05x, and the peak), at most 4.2 minutes (the H200: 4).
# Before, here: bash ../shared/gpu/wheels.sh, and liger-kernel (the `cuda` extra: the fused chunked loss; it needs only
# torch and triton, which the device has) beside those wheels:
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: -d .whl "liger-kernel>=0.6"
# Usage, from the checkout on the device (run with carry [".whl"]):
#   source .whl/on-gpu.sh && bash benchmarks/gpu_quick.sh [DIR]
# DIR (default $OUT, else docs/bench) receives gpu_tests.txt, gpu_tests.json and gpu_vs_minimal_quick.json.
# Issue 48's 32k+ figures take a second call of about 3 minutes (one CP rank's attention; world size 1 suffices):
#   source .whl/on-gpu.sh && python benchmarks/context_parallel_gpu.py > $OUT/gpu_context_parallel.json
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-${OUT:-docs/bench}}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
: > "$DIR/gpu_tests.jsonl"
# The framework tests import tensordict, which the device image lacks; none is cuda-marked. SIGINT at the limit makes
# pytest print the failures it has (a plain kill lost them on the first H200 run).
SKIP=""
for module in ranks roll verl; do SKIP="$SKIP --ignore=tests/test_integration_$module.py"; done
FSDP2KIT_GPU_RESULTS="$DIR/gpu_tests.jsonl" timeout -s INT 300 $PY -m pytest -m cuda -q -rA --tb=short \
  --durations=0 -p no:cacheprovider $SKIP tests/ > "$DIR/gpu_tests.txt" 2>&1
echo "pytest -m cuda: exit $? ($(tail -1 "$DIR/gpu_tests.txt"))"
$PY -c 'import json, sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1]) if l.strip()], indent=1))' \
  "$DIR/gpu_tests.jsonl" > "$DIR/gpu_tests.json" && rm "$DIR/gpu_tests.jsonl"
timeout 250 $PY benchmarks/gpu_vs_minimal.py --repeats 1 --steps 10 \
  --arms minimal,fsdp2kit,minimal_compiled,fsdp2kit_compiled --out "$DIR/gpu_vs_minimal_quick.json"
echo "gpu_vs_minimal: exit $?"
