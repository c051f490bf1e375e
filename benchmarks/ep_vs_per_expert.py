"""Expert parallelism against per-expert FSDP wrapping (and one fused-experts group a layer), the same MoE model,
data and world size, side by side in one run: median step time and rank 0's peak of live tensor bytes.

Prints one JSON object. Run: .venv/bin/python benchmarks/ep_vs_per_expert.py [--ranks 2 4] [--steps 6] [--repeats 2]
The model is the built-in Qwen3-MoE widened to --experts experts a layer (top 2), fp32. Arms at each world size:
- `per_expert`: every expert its own shard group with the expert patch (ROLL's moe_experts: [Qwen3MoeMLP]); each
  rank gathers every expert of a layer and runs all of them (a dummy token for those it does not use);
- `fused`: each layer's fused experts one shard group (moe_experts: [Qwen3MoeExperts]): one gather of all of them;
- `ep`: ep_size = the world (efsdp 1): each rank holds its experts whole and receives their tokens;
- `ep2_efsdp2` (4 ranks): EP 2 with each expert sharded over 2 ranks.
Arms are interleaved repeat by repeat; the first step of each run (warm-up) is left out of the median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import REPO, child_env

STRATEGY = "strategy_args.strategy_config"
ARMS = {
    "per_expert": [f"{STRATEGY}.wrap_policy.moe_experts=[Qwen3MoeMLP]", f"{STRATEGY}.apply_expert_patch=true"],
    "fused": [f"{STRATEGY}.wrap_policy.moe_experts=[Qwen3MoeExperts]"],
    "ep": [],  # ep_size is set per world size
    "ep2_efsdp2": [f"{STRATEGY}.ep_size=2", f"{STRATEGY}.efsdp_size=2"],
}


def settings(args: argparse.Namespace, out: Path) -> list[str]:
    return [
        "model.name_or_path=builtin:tiny-qwen3-moe",
        f"model.config.num_experts={args.experts}",
        f"model.config.moe_intermediate_size={args.expert_width}",
        f"model.config.num_hidden_layers={args.layers}",
        f"data.seq_len={args.seq_len}",
        "training.per_device_train_batch_size=2",
        "training.gradient_accumulation_steps=1",
        f"training.max_steps={args.steps}",
        "training.save_steps=0",
        "training.export_hf=false",
        "training.track_memory=true",
        "training.report_to=[]",
        f"training.output_dir={out}",
    ]


def run(arm: str, ranks: int, args: argparse.Namespace, out: Path) -> dict[str, float]:
    overrides = [*settings(args, out), *ARMS[arm]]
    if arm == "ep":
        overrides.append(f"{STRATEGY}.ep_size={ranks}")
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", str(ranks)]
    command += [arg for item in overrides for arg in ("--set", item)]
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{arm} at {ranks} ranks failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_time_s": statistics.median(r["step_time"] for r in records[1:]),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--expert-width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    report: dict[str, object] = {"settings": vars(args)}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            arms = [arm for arm in ARMS if arm != "ep2_efsdp2" or ranks == 4]
            runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
            for repeat in range(args.repeats):
                for arm in arms:
                    runs[arm].append(run(arm, ranks, args, Path(tmp) / f"{ranks}-{arm}-{repeat}"))
            table = {
                arm: {
                    "step_time_s": statistics.median(r["step_time_s"] for r in results),
                    "peak_mem_bytes": results[0]["peak_mem_bytes"],
                    "loss": results[0]["loss"],
                }
                for arm, results in runs.items()
            }
            base = table["per_expert"]
            for row in table.values():
                row["time_vs_per_expert"] = row["step_time_s"] / base["step_time_s"]
                row["peak_vs_per_expert"] = row["peak_mem_bytes"] / base["peak_mem_bytes"]
            report[f"{ranks}_ranks"] = table
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
