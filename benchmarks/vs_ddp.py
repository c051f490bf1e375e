"""fsdp2kit NO_SHARD against a hand-written DistributedDataParallel loop (`reference_loop.py --impl ddp`: DDP as it
comes, `no_sync` while accumulating), with Accelerate's loop (DDP too on a CPU) as a third arm: the project's earlier
NO_SHARD figure was taken against Accelerate, and this shows what Accelerate's loop itself costs against plain DDP.

The same 25M Llama, initial weights, data, fp32 precision, AdamW, clipping and world size, run alternately; medians of
the repeats. Prints one JSON object (harness.arms_main).

Run: .venv/bin/python benchmarks/vs_ddp.py [--world-sizes 2] [--repeats 3] [--steps 6]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import NO_SHARD, Arm, arms_main  # noqa: E402

if __name__ == "__main__":
    arms_main(
        "vs_ddp",
        [Arm("fsdp2kit_no_shard", "fsdp2kit", NO_SHARD), Arm("ddp", "ddp"), Arm("accelerate", "accelerate")],
        [("fsdp2kit_no_shard", "ddp"), ("accelerate", "ddp"), ("fsdp2kit_no_shard", "accelerate")],
        "fsdp2kit NO_SHARD vs a plain DDP loop, and Accelerate's loop (DDP on CPU) vs the same plain DDP loop",
    )
