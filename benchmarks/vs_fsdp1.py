"""fsdp2kit against torch's `FullyShardedDataParallel` (FULL_SHARD, transformer auto-wrap):
seed 003 claims FSDP2 beats it on speed and peak memory.

The same 25M Llama, initial weights, data, fp32 precision, AdamW, clipping and world size, run alternately; medians of
the repeats. Prints one JSON object: per world size, ratio_tokens_per_s and ratio_peak_mem (fsdp2kit / reference;
peak RSS of rank 0) and loss_max_rel_diff.

Run: .venv/bin/python benchmarks/vs_fsdp1.py [--world-sizes 1 2] [--repeats 3] [--steps 6] [--seq-len 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import main  # noqa: E402

if __name__ == "__main__":
    main("fsdp1", "vs_fsdp1")
