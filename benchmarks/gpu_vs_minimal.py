"""fsdp2kit against a minimal hand-written `fully_shard` loop on the issue-31 shape, on one CUDA machine.

The model: a Llama-3.2-1B shape (hidden 2048, 16 layers, GQA 32/8, untied 128256-token vocabulary: 1.50B
parameters), fp32 master weights, bf16 compute, fp32 reduce, seq 2048 x batch 4 per rank (and seq 8192 x 1 under
compile). The minimal loop (`reference_loop.py --impl fsdp2 --bf16 --synthetic-batches`): each decoder layer then the
root, fused AdamW, clip 1.0, transformers' own loss on random tokens; with `--compile`, each layer compiled. fsdp2kit
trains the demo's builtin corpus with its defaults (document mask, chunked loss), and with either or both turned off.
Every arm runs once per repeat, in turn (eager and compiled alternate), from the same HF folder; tokens/s are
medians of the steady steps (the first WARMUP left out: compilation), the peak is the CUDA allocator's.

Run: .venv/bin/python benchmarks/gpu_vs_minimal.py [--nproc N] [--repeats 2] [--steps 15] [--arms a,b,...] \
         --out docs/bench/gpu_vs_minimal.json
(`--arms` runs those arms alone, and the targets whose two arms both ran: benchmarks/gpu_quick.sh's few minutes.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Arm, Workload, load_average, model_folder, run_fsdp2kit, run_reference  # noqa: E402

LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}
WARMUP = 3  # steps left out of the medians: the first compiles, the next may recompile
BF16 = ("strategy_args.strategy_config.param_dtype=bf16", "strategy_args.strategy_config.reduce_dtype=fp32")
NO_DOCUMENT_MASK = ("data.document_mask=false",)
UNCHUNKED = ("training.loss_chunk_tokens=0",)
COMPILE = ("training.compile=true",)
MINIMAL = ("--bf16", "--synthetic-batches")

# (arm, workload): eager, then compiled, then the long sequence; each group against its own minimal loop.
SHORT, LONG = "seq2048x4", "seq8192x1"
ARMS = [
    (Arm("minimal", "fsdp2", MINIMAL), SHORT),
    (Arm("fsdp2kit", "fsdp2kit", BF16), SHORT),
    (Arm("fsdp2kit_no_document_mask", "fsdp2kit", BF16 + NO_DOCUMENT_MASK), SHORT),
    (Arm("fsdp2kit_unchunked", "fsdp2kit", BF16 + UNCHUNKED), SHORT),
    (Arm("fsdp2kit_both_off", "fsdp2kit", BF16 + NO_DOCUMENT_MASK + UNCHUNKED), SHORT),
    (Arm("minimal_compiled", "fsdp2", (*MINIMAL, "--compile")), SHORT),
    (Arm("fsdp2kit_compiled", "fsdp2kit", BF16 + COMPILE), SHORT),
    (Arm("fsdp2kit_compiled_both_off", "fsdp2kit", BF16 + COMPILE + NO_DOCUMENT_MASK + UNCHUNKED), SHORT),
    (Arm("fsdp2kit_compiled_long", "fsdp2kit", BF16 + COMPILE), LONG),
    (Arm("fsdp2kit_compiled_long_no_document_mask", "fsdp2kit", BF16 + COMPILE + NO_DOCUMENT_MASK), LONG),
]
# The targets: (arm, its baseline, the least ratio of tokens/s).
TARGETS = [
    ("fsdp2kit", "minimal", 0.97),
    ("fsdp2kit_compiled", "minimal_compiled", 1.05),
    ("fsdp2kit_compiled_long", "fsdp2kit_compiled_long_no_document_mask", 0.90),
]


def steady(run: dict) -> dict:
    """Median tokens/s of the steady steps (all ranks' tokens) and the run's CUDA peak."""
    return {"tokens_per_s": statistics.median(run["tokens_per_s"][WARMUP:]), "peak_mem_bytes": run["peak_mem_bytes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--arms", help="comma-separated arm names (default: all)")
    args = parser.parse_args()
    names = [arm.name for arm, _ in ARMS]
    chosen = names if args.arms is None else args.arms.split(",")
    if unknown := sorted(set(chosen) - set(names)):
        parser.error(f"--arms: no arm named {', '.join(unknown)}; the arms are {', '.join(names)}")
    selected = [(arm, shape) for arm, shape in ARMS if arm.name in chosen]
    import torch

    workloads = {SHORT: Workload(2048, 4, 1, args.steps), LONG: Workload(8192, 1, 1, args.steps)}
    runs: dict[str, list[dict]] = {arm.name: [] for arm, _ in selected}
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-gpu-bench-") as tmp:
        model = model_folder(Path(tmp), LLAMA_1B, "llama1b")
        for repeat in range(args.repeats):
            for arm, shape in selected:
                out = Path(tmp) / f"{arm.name}_{repeat}"
                work = workloads[shape]
                if arm.impl == "fsdp2kit":
                    run = run_fsdp2kit(model, args.nproc, work, out, list(arm.extra))
                else:
                    run = run_reference(arm.impl, model, args.nproc, work, out.with_suffix(".json"), list(arm.extra))
                runs[arm.name].append(steady(run))
                print(json.dumps({"arm": arm.name, "repeat": repeat, **runs[arm.name][-1]}), flush=True)
    arms = {
        name: {
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
            "runs_tokens_per_s": [r["tokens_per_s"] for r in measured],
            "peak_mem_gib": max(r["peak_mem_bytes"] for r in measured) / 1024**3,
        }
        for name, measured in runs.items()
    }
    targets = [
        {
            "arm": arm,
            "vs": base,
            "ratio": arms[arm]["tokens_per_s"] / arms[base]["tokens_per_s"],
            "target": least,
            "met": arms[arm]["tokens_per_s"] / arms[base]["tokens_per_s"] >= least,
        }
        for arm, base, least in TARGETS
        if arm in arms and base in arms
    ]
    result = {
        "benchmark": "gpu_vs_minimal",
        "device": torch.cuda.get_device_name(),
        "nproc": args.nproc,
        "model": LLAMA_1B,
        "workloads": {name: vars(work) for name, work in workloads.items()},
        "repeats": args.repeats,
        "arms": arms,
        "targets": targets,
        "load_average": {"before": before, "after": load_average()},
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(targets))


if __name__ == "__main__":
    main()
