#!/usr/bin/env bash
# What only a GPU shows, in one command: bash benchmarks/gpu_suite.sh [BENCH_DIR] (default docs/bench).
# Needs CUDA and 1+ GPUs (NPROC, default: all visible). It writes, in BENCH_DIR:
#   - gpu_tests.txt and gpu_tests.json: `pytest -m cuda` (tests/test_cuda.py and the other cuda-marked tests) and the
#     figures its tests measure (offload_states GB/s each way, plan against the CUDA peak);
#   - gpu_vs_minimal.json: fsdp2kit against a minimal fully_shard loop on issue 31's 1.5B Llama shape, eager and
#     compiled, alternately (benchmarks/gpu_vs_minimal.py), with the issue's targets and whether they are met;
#   - gpu_cases.json: bf16 tokens/s, MFU, the CUDA peak and `fsdp2kit plan`'s prediction for it, on that shape at
#     seq 2048 and 4096, recompute off/on, CPU offload with pinned memory, compile, compile + float8;
#   - gpu_side_by_side.json: the CPU suite's comparisons (raw fully_shard loop, FSDP1, Accelerate) at this
#     machine's world size, and memory_scaling;
#   - gpu_context_parallel.json: one context-parallel rank's attention at 32k-128k tokens, fsdp2kit's FlexAttention
#     path against the dense mask it replaced (benchmarks/context_parallel_gpu.py; world size 1 suffices);
#   - gpu_weight_sync.json: weight sync on a 0.5B shape (benchmarks/weight_sync.py).
# Training runs go to RUNS (default runs/gpu_suite). Not run by `make bench` (CPU) nor in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
BENCH=${1:-docs/bench}
OUT=${RUNS:-runs/gpu_suite}
PY=${PYTHON:-.venv/bin/python}
if ! $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_suite.sh: no CUDA device is visible to $PY; it measures only what a GPU shows (run the CPU set: make bench)" >&2
  exit 1
fi
NPROC=${NPROC:-$($PY -c 'import torch; print(max(1, torch.cuda.device_count()))')}
STEPS=${STEPS:-20}
mkdir -p "$OUT" "$BENCH"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"
as_json_array() {  # JSON lines file -> a JSON array file
  $PY -c 'import json, sys; print(json.dumps([json.loads(l) for l in open(sys.argv[1]) if l.strip()], indent=1))' "$1" > "$2"
}

# 1. The CUDA test suite; its measured figures as JSON lines (tests/test_cuda.py:record). A failure is reported and
#    the measurements go on.
: > "$OUT/gpu_tests.jsonl"
FSDP2KIT_GPU_RESULTS="$OUT/gpu_tests.jsonl" $PY -m pytest -m cuda -q -rA tests/ 2>&1 | tee "$BENCH/gpu_tests.txt" || true
as_json_array "$OUT/gpu_tests.jsonl" "$BENCH/gpu_tests.json"

# 2. fsdp2kit against the minimal fully_shard loop on the issue's shape, eager and compiled, alternately.
$PY benchmarks/gpu_vs_minimal.py --nproc "$NPROC" --out "$BENCH/gpu_vs_minimal.json"

# 3. Issue 31's Llama-3.2-1B shape (1.50B parameters, untied 128256-token vocabulary) on the builtin tokenizer
#    (weights are fresh: speed and memory only); fp32 master weights, bf16 compute, fp32 reduce, 4 samples a rank.
MODEL=(
  --set model.dtype=bf16 --set model.config.vocab_size=128256 --set model.config.tie_word_embeddings=false
  --set model.config.hidden_size=2048 --set model.config.intermediate_size=8192
  --set model.config.num_hidden_layers=16 --set model.config.num_attention_heads=32
  --set model.config.num_key_value_heads=8 --set model.config.max_position_embeddings=8192
  --set strategy_args.strategy_config.param_dtype=bf16 --set strategy_args.strategy_config.reduce_dtype=fp32
)

run_case() {  # name, seq_len, then extra --set arguments
  local name=$1 seq=$2; shift 2
  local dir="$OUT/$name"
  local common=("${MODEL[@]}" --set data.seq_len="$seq" --set training.per_device_train_batch_size=4
    --set training.gradient_accumulation_steps=1 --set training.max_steps="$STEPS" --set training.save_steps=0
    --set training.export_hf=false --set training.report_to=[] --set training.resume=never
    --set training.output_dir="$dir" "$@")
  local plan
  plan=$($PY -m fsdp2kit plan examples/demo.yaml --nproc "$NPROC" --json "${common[@]}" | tail -1)
  $PY -m fsdp2kit train examples/demo.yaml --nproc "$NPROC" "${common[@]}" > "$dir.log" 2>&1
  $PY - "$name" "$dir/metrics.jsonl" "$plan" >> "$RESULTS" <<'EOF'
import json, statistics, sys
name, metrics, plan = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
records = [json.loads(line) for line in open(metrics)][3:]  # steady state: warm-up steps left out
measured = max(r["peak_mem_bytes"] for r in records)
print(json.dumps({
    "case": name,
    "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
    "mfu": statistics.median(r["mfu"] for r in records),
    "cuda_peak_bytes": measured,
    "plan_peak_bytes": plan["peak_bytes"],
    "plan_vs_measured": plan["peak_bytes"] / measured,
}))
EOF
}

for seq in 2048 4096; do
  run_case "bf16_seq${seq}" "$seq"
  run_case "bf16_seq${seq}_recompute" "$seq" --set model.gradient_checkpointing=true
done
run_case "bf16_seq2048_offload_pinned" 2048 --set strategy_args.strategy_config.offload_policy=true \
  --set strategy_args.strategy_config.pin_memory=true
run_case "bf16_seq2048_compile" 2048 --set training.compile=true
run_case "bf16_seq2048_compile_recompute" 2048 --set training.compile=true --set model.gradient_checkpointing=true
# float8 (torchao, tensorwise, float8 all-gather) against bf16_seq2048_compile: issue 62's target >= 1.15x at a lower peak
run_case "bf16_seq2048_compile_float8" 2048 --set training.compile=true \
  --set strategy_args.strategy_config.float8.enabled=true

as_json_array "$RESULTS" "$BENCH/gpu_cases.json"

# 4. The CPU suite's side-by-side comparisons, here on the GPU.
: > "$OUT/side_by_side.jsonl"
for bench in vs_raw_fsdp2 vs_fsdp1 vs_accelerate; do
  $PY "benchmarks/$bench.py" --world-sizes "$NPROC" --repeats 3 --steps 8 >> "$OUT/side_by_side.jsonl"
done
$PY benchmarks/memory_scaling.py --world-sizes 1 >> "$OUT/side_by_side.jsonl"
as_json_array "$OUT/side_by_side.jsonl" "$BENCH/gpu_side_by_side.json"
# 5. One context-parallel rank's attention at 32k-128k tokens (FlexAttention's block mask against the dense mask).
$PY benchmarks/context_parallel_gpu.py > "$BENCH/gpu_context_parallel.json"

# Weight sync to a rollout engine on a 0.5B shape: full, sharded, delta and adapter syncs, and a step beside a
# background sync (benchmarks/weight_sync.py).
$PY benchmarks/weight_sync.py --world-sizes 1 --steps 3 --shape 0.5b > "$BENCH/gpu_weight_sync.json"
echo "results: $BENCH/gpu_tests.json $BENCH/gpu_vs_minimal.json $BENCH/gpu_cases.json $BENCH/gpu_side_by_side.json" \
  "$BENCH/gpu_context_parallel.json"
