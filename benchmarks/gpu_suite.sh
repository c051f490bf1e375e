#!/usr/bin/env bash
# What only a GPU shows, in one command: bash benchmarks/gpu_suite.sh [OUT_DIR] (default runs/gpu_suite).
# Needs CUDA and 1+ GPUs (NPROC, default: all visible). Every result is one JSON line in OUT_DIR/results.jsonl:
#   - bf16 tokens/s and MFU of a ~1B Llama at seq 2048 and 4096, recompute off/on, CPU offload with pinned memory;
#   - `fsdp2kit plan`'s predicted per-rank peak next to the CUDA allocator's measured peak for each of those runs;
#   - the side-by-side comparisons (raw fully_shard loop, FSDP1, Accelerate) at this machine's world size.
# Not run by `make bench` (CPU) nor in CI.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_suite}
PY=${PYTHON:-.venv/bin/python}
if ! $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then
  echo "gpu_suite.sh: no CUDA device is visible to $PY; it measures only what a GPU shows (run the CPU set: make bench)" >&2
  exit 1
fi
NPROC=${NPROC:-$($PY -c 'import torch; print(max(1, torch.cuda.device_count()))')}
STEPS=${STEPS:-20}
mkdir -p "$OUT"
RESULTS="$OUT/results.jsonl"
: > "$RESULTS"

# A Llama-3-style ~1.2B model on the builtin tokenizer's vocabulary (weights are fresh: speed and memory only).
MODEL=(
  --set model.dtype=bf16
  --set model.config.hidden_size=2048 --set model.config.intermediate_size=8192
  --set model.config.num_hidden_layers=22 --set model.config.num_attention_heads=16
  --set model.config.num_key_value_heads=8 --set model.config.max_position_embeddings=8192
  --set strategy_args.strategy_config.param_dtype=bf16 --set strategy_args.strategy_config.reduce_dtype=fp32
)

run_case() {  # name, seq_len, then extra --set arguments
  local name=$1 seq=$2; shift 2
  local dir="$OUT/$name"
  local common=("${MODEL[@]}" --set data.seq_len="$seq" --set training.per_device_train_batch_size=1
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

for bench in vs_raw_fsdp2 vs_fsdp1 vs_accelerate; do
  $PY "benchmarks/$bench.py" --world-sizes "$NPROC" --repeats 3 --steps 8 >> "$RESULTS"
done
$PY benchmarks/memory_scaling.py --world-sizes 1 >> "$RESULTS"
echo "results: $RESULTS"
