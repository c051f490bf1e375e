"""fsdp2kit against torch's `FullyShardedDataParallel` (FULL_SHARD, transformer auto-wrap):
seed 003 claims FSDP2 beats it on speed and peak memory.

The same 25M Llama, initial weights, data, fp32 precision, AdamW, clipping and world size, run alternately; medians of
the repeats. Four arms: each stack plain (tokens/s, peak RSS of rank 0, loss curve) and each with its live tensors
tracked (fsdp2kit's `training.track_memory`: torch's FSDPMemTracker; FSDP1: torch's MemTracker, its base class,
around the whole loop): the tracked peak of rank 0 and its categories; and fsdp2kit tracked with
`strategy_config.sync_each_batch: true` (gradients reduce-scattered every micro-batch, as FSDP1's loop does). Prints
one JSON object.

Run: .venv/bin/python benchmarks/vs_fsdp1.py [--world-sizes 1 2] [--repeats 3] [--steps 6] [--seq-len 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Arm, arms_main  # noqa: E402

SYNC_EACH_BATCH = "strategy_args.strategy_config.sync_each_batch=true"  # reduce-scatter every micro-batch, as FSDP1

if __name__ == "__main__":
    arms_main(
        "vs_fsdp1",
        [
            Arm("fsdp2kit", "fsdp2kit"),
            Arm("fsdp1", "fsdp1"),
            Arm("fsdp2kit_tracked", "fsdp2kit", ("training.track_memory=true",)),
            Arm("fsdp1_tracked", "fsdp1", ("--track-memory",)),
            Arm("fsdp2kit_sync_each_tracked", "fsdp2kit", ("training.track_memory=true", SYNC_EACH_BATCH)),
        ],
        [
            ("fsdp2kit", "fsdp1"),
            ("fsdp2kit_tracked", "fsdp1_tracked"),
            ("fsdp2kit_sync_each_tracked", "fsdp1_tracked"),
        ],
        "fsdp2kit (FULL_SHARD) vs FSDP1 FULL_SHARD; *_tracked: live tensor bytes tracked (slower, not for speed)",
    )
