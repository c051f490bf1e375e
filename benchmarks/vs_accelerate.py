"""fsdp2kit against Accelerate's `prepare`/`accumulate` loop. On a CPU-only machine Accelerate runs
DDP (the JSON's `accelerate_mode`), so there the fair fsdp2kit arm is the one a user with that much memory would
pick: NO_SHARD (replicated parameters, gradients all-reduced) without recompute. fsdp2kit's default FULL_SHARD
runs too.

The same 25M Llama, initial weights, data, fp32 precision, AdamW, clipping and world size, run alternately; medians of
the repeats. Prints one JSON object: per world size each arm's tokens/s, peak RSS of rank 0 and losses, and the
ratios fsdp2kit_no_shard / accelerate and fsdp2kit / accelerate.

Run: .venv/bin/python benchmarks/vs_accelerate.py [--world-sizes 1 2] [--repeats 3] [--steps 6] [--seq-len 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import NO_SHARD, Arm, arms_main  # noqa: E402

if __name__ == "__main__":
    arms_main(
        "vs_accelerate",
        [Arm("fsdp2kit_no_shard", "fsdp2kit", NO_SHARD), Arm("accelerate", "accelerate"), Arm("fsdp2kit", "fsdp2kit")],
        [("fsdp2kit_no_shard", "accelerate"), ("fsdp2kit", "accelerate")],
        "fsdp2kit NO_SHARD (and its default FULL_SHARD) vs Accelerate (DDP on CPU)",
    )
