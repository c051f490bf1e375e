"""LoRA against full fine-tuning of the same model, data and world size, in one run: checkpoint size, per-rank peak
memory, trainable parameters, tokens/s.

Prints one JSON object. Run: .venv/bin/python benchmarks/lora_vs_full.py [--nproc 2] [--steps 4] [--hidden 768]
The model is the built-in Llama widened to --hidden with --layers layers (fp32 master weights for full
fine-tuning; the LoRA base is frozen in model.dtype). Memory is rank 0's peak of live tensor bytes
(`training.track_memory`, torch's FSDPMemTracker) with its categories, and its peak resident set size, which also
counts the Python runtime and libraries.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(lora: str | None, args: argparse.Namespace, out: Path) -> dict:
    settings = {
        "model.config.hidden_size": args.hidden,
        "model.config.intermediate_size": args.hidden * 8 // 3,
        "model.config.num_hidden_layers": args.layers,
        "model.config.num_attention_heads": args.hidden // 64,
        "model.config.num_key_value_heads": args.hidden // 64,
        "model.dtype": args.dtype,
        "data.seq_len": 128,
        "training.max_steps": args.steps,
        "training.save_steps": 0,
        "training.output_dir": out,
        "training.export_hf": "false",
        "training.track_memory": "true",
        "strategy_args.strategy_config.async_save_ckpt": "false",
    }
    if lora:
        settings["model.lora"] = lora
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", str(args.nproc)]
    result = subprocess.run(
        command + overrides, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    check = subprocess.run(
        [sys.executable, "-m", "fsdp2kit", "check", "examples/demo.yaml", "--json", *overrides],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    plan = json.loads(check.stdout.strip().splitlines()[-1])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    checkpoint = next((out / "checkpoints").glob("step_*"))
    return {
        "trainable_parameters": plan["trainable_parameters"],
        "frozen_parameters": plan["frozen_parameters"],
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.iterdir()),
        "peak_mem_bytes_rank0": max(r["peak_mem_bytes"] for r in records),
        "peak_mem_categories_rank0": max(records, key=lambda r: r["peak_mem_bytes"])["peak_mem_categories"],
        "peak_rss_bytes_rank0": max(r["peak_rss_bytes"] for r in records),
        "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in records[1:]),
        "first_loss": records[0]["loss"],
        "last_loss": records[-1]["loss"],
        "adapter_bytes": plan["lora"]["parameter_bytes"] if plan["lora"] else None,
        "adapter_optimizer_bytes": plan["lora"]["optimizer_state_bytes"] if plan["lora"] else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--lora", default="{rank: 16, target_modules: all-linear}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        full = run(None, args, Path(work) / "full")
        lora = run(args.lora, args, Path(work) / "lora")
    print(
        json.dumps(
            {
                "settings": vars(args),
                "full": full,
                "lora": lora,
                "lora_over_full": {
                    key: round(lora[key] / full[key], 4)
                    for key in (
                        "checkpoint_bytes",
                        "peak_mem_bytes_rank0",
                        "peak_rss_bytes_rank0",
                        "tokens_per_s_median",
                        "trainable_parameters",
                    )
                },
                "peak_mem_saved_bytes_rank0": full["peak_mem_bytes_rank0"] - lora["peak_mem_bytes_rank0"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
