"""Per-rank memory of model states at N = 1, 2, 4 ranks for ZeRO-3 (FULL_SHARD), ZeRO-2 (SHARD_GRAD_OP) and NO_SHARD,
against the ideal 16*P/N bytes of fp32 AdamW (4 params + 4 grads + 8 optimizer states per parameter), and
`fsdp2kit plan`'s predicted peak against the peak that `training.track_memory` measures in a real run.

States per rank = the tracked bytes of this rank's parameter shards and AdamW states (measured, at the step's peak)
plus its gradient shards (FSDP2 allocates each sharded gradient with its parameter's shard shape).
Prints one JSON object. Run: .venv/bin/python benchmarks/memory_scaling.py [--world-sizes 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import child_env

REPO = Path(__file__).resolve().parent.parent
NAMES = {"ZeRO-3": "FULL_SHARD", "ZeRO-2": "SHARD_GRAD_OP", "NO_SHARD": "NO_SHARD"}
WORKLOAD = [
    "data.seq_len=64",
    "training.per_device_train_batch_size=1",
    "training.gradient_accumulation_steps=1",
]


def measure(nproc: int, overrides: list[str], out: Path) -> dict:
    sets = [*overrides, "training.max_steps=2", "training.track_memory=true", "training.export_hf=false"]
    sets += ["training.report_to=[]", "training.resume=never", f"training.output_dir={out}"]
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", str(nproc)]
    command += [arg for item in sets for arg in ("--set", item)]
    env = child_env()
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return max(records, key=lambda r: r["peak_mem_bytes"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from fsdp2kit.memory_plan import STRATEGIES, ConfigSource, predict

    one_rank = predict(ConfigSource("examples/demo.yaml", WORKLOAD, None, None), 1)
    params = one_rank["computed"]["sharded_params"] // 4  # type: ignore[index]  # fp32: 4 bytes per parameter
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-memory-") as workdir:
        for nproc in args.world_sizes:
            for name, strategy in NAMES.items() if nproc > 1 else [("ZeRO-3", "FULL_SHARD")]:  # alike at 1 rank
                overrides = [*WORKLOAD, *STRATEGIES[strategy]]
                predicted = predict(ConfigSource("examples/demo.yaml", overrides, None, None), nproc)
                measured = measure(nproc, overrides, Path(workdir) / f"{name}_{nproc}")
                categories = measured["peak_mem_categories"]
                states = categories["sharded_param"] + categories.get("optstate", 0)
                states += predicted["computed"]["sharded_grads"]  # type: ignore[index]
                ideal = 16 * params / nproc
                rows.append(
                    {
                        "strategy": name,
                        "world_size": nproc,
                        "states_bytes": states,
                        "ideal_16P_over_N": ideal,
                        "states_vs_ideal": states / ideal,
                        "measured_peak_bytes": measured["peak_mem_bytes"],
                        "plan_peak_bytes": predicted["peak_bytes"],
                        "plan_vs_measured": predicted["peak_bytes"] / measured["peak_mem_bytes"],  # type: ignore[operator]
                    }
                )
    print(
        json.dumps({"benchmark": "memory_scaling", "model": "builtin:tiny-llama", "parameters": params, "rows": rows})
    )


if __name__ == "__main__":
    main()
