"""How long training waits for a checkpoint, synchronous vs asynchronous DCP save, on the demo model.

Prints one JSON object. Run: .venv/bin/python benchmarks/checkpoint_stall.py [--nproc 2] [--steps 12] [--every 3]
`stall_s` is the time the loop spends inside `save` (parsed from the run's "training paused" lines); an async
save returns after staging the shards in memory and writes them while training continues.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run(async_save: bool, args: argparse.Namespace, out: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "fsdp2kit",
        "train",
        "examples/demo.yaml",
        "--nproc",
        str(args.nproc),
        "--set",
        f"training.max_steps={args.steps}",
        "--set",
        f"training.save_steps={args.every}",
        "--set",
        f"training.output_dir={out}",
        "--set",
        "training.export_hf=false",
        "--set",
        f"strategy_args.strategy_config.async_save_ckpt={str(async_save).lower()}",
    ]
    result = subprocess.run(
        command, cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr)
    stalls = [float(s) for s in re.findall(r"training paused ([0-9.]+)s", result.stdout)]
    steps = [json.loads(line)["step_time"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    checkpoint = next((out / "checkpoints").glob("step_*"))
    size = sum(f.stat().st_size for f in checkpoint.iterdir())
    return {
        "saves": len(stalls),
        "stall_s_mean": statistics.mean(stalls),
        "stall_s_max": max(stalls),
        "step_time_s_median": statistics.median(steps),
        "checkpoint_bytes": size,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        sync = run(False, args, Path(work) / "sync")
        asynchronous = run(True, args, Path(work) / "async")
    print(
        json.dumps(
            {
                "sync": sync,
                "async": asynchronous,
                "async_over_sync_stall": round(asynchronous["stall_s_mean"] / sync["stall_s_mean"], 3),
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
