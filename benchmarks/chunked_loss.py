"""Chunked loss (`training.loss_chunk_tokens`) on a model with Qwen's 152k vocabulary: a training step's tracked peak,
its losses and its speed, chunked (auto: 1024 tokens) against the whole logits at once (0), and what `fsdp2kit plan`
predicts for each. The model is the built-in tiny Qwen3 with a 151936-token vocabulary (2 layers, hidden 256), seq
2048, one sample per step, fp32, one rank: the logits dominate its step, as they do for a real Qwen at long context.

Timing runs (without the memory tracker, which slows every op) alternate between the two settings, `--repeats`
times; tokens/s is the median over the steps after the first of every run of a setting.
Prints one JSON object. Run: .venv/bin/python benchmarks/chunked_loss.py [--steps 4] [--repeats 2]
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
MODEL = [
    "model.name_or_path=builtin:tiny-qwen3",
    "model.config={vocab_size: 151936, num_hidden_layers: 2, hidden_size: 256}",
    "data.seq_len=2048",
    "data.source=builtin:corpus",
    "training.per_device_train_batch_size=1",
    "training.gradient_accumulation_steps=1",
]
SETTINGS = {"whole": "0", "chunked": "auto"}


def fsdp2kit(command: str, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "fsdp2kit", command, "examples/demo.yaml", *extra]
    args += [a for item in overrides for a in ("--set", item)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def train(chunk: str, steps: int, out: Path, track: bool) -> list[dict]:
    overrides = [*MODEL, f"training.loss_chunk_tokens={chunk}", f"training.max_steps={steps}"]
    overrides += [f"training.track_memory={str(track).lower()}", "training.export_hf=false", "training.save_steps=0"]
    overrides += ["training.report_to=[]", "training.resume=never", f"training.output_dir={out}"]
    fsdp2kit("train", overrides)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    result: dict[str, dict] = {}
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, chunk in SETTINGS.items():
            tracked = train(chunk, 2, Path(tmp) / f"{name}-tracked", track=True)
            planned = fsdp2kit("plan", [*MODEL, f"training.loss_chunk_tokens={chunk}"], "--json")
            result[name] = {
                "loss_chunk_tokens": chunk,
                "tracked_peak_bytes": max(r["peak_mem_bytes"] for r in tracked),
                "planned_peak_bytes": json.loads(planned.stdout)["peak_bytes"],
                "losses": [r["loss"] for r in tracked],
            }
        for repeat in range(args.repeats):
            for name, chunk in SETTINGS.items():
                records = train(chunk, args.steps, Path(tmp) / f"{name}-{repeat}", track=False)
                speeds[name] += [r["tokens_per_s"] for r in records[1:]]
    for name in SETTINGS:
        result[name]["tokens_per_s"] = statistics.median(speeds[name])
        result[name]["plan_error"] = result[name]["planned_peak_bytes"] / result[name]["tracked_peak_bytes"] - 1
    whole, chunked = result["whole"], result["chunked"]
    summary = {
        "peak_ratio": chunked["tracked_peak_bytes"] / whole["tracked_peak_bytes"],
        "speed_ratio": chunked["tokens_per_s"] / whole["tokens_per_s"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(whole["losses"], chunked["losses"], strict=True)),
    }
    print(json.dumps({"benchmark": "chunked_loss", **result, **summary}, indent=2))


if __name__ == "__main__":
    main()
