"""fsdp2kit against a minimal hand-written `fully_shard` loop (each decoder layer, then the root), twice: fed by
fsdp2kit's data pipeline (the same tokens: losses comparable) and by `--synthetic-batches` (random tokens made up
front: no data pipeline at all, the floor a real trainer cannot go under).

The same 25M Llama, initial weights, fp32 precision, AdamW, clipping and world size, run alternately; medians of the
repeats. Prints one JSON object: per world size each arm's tokens/s, peak RSS of rank 0 and losses, and the ratios
fsdp2kit / fsdp2_synthetic, fsdp2kit / fsdp2 and fsdp2 / fsdp2_synthetic (what the pipeline costs the minimal loop).

Run: .venv/bin/python benchmarks/vs_raw_fsdp2.py [--world-sizes 1 2] [--repeats 3] [--steps 6] [--seq-len 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Arm, arms_main  # noqa: E402

if __name__ == "__main__":
    arms_main(
        "vs_raw_fsdp2",
        [Arm("fsdp2kit", "fsdp2kit"), Arm("fsdp2_synthetic", "fsdp2", ("--synthetic-batches",)), Arm("fsdp2", "fsdp2")],
        [("fsdp2kit", "fsdp2_synthetic"), ("fsdp2kit", "fsdp2"), ("fsdp2", "fsdp2_synthetic")],
        "fsdp2kit (FULL_SHARD) vs a minimal fully_shard loop, with fsdp2kit's data pipeline and with synthetic batches",
    )
