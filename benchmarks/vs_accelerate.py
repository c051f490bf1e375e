"""fsdp2kit against Accelerate's `prepare`/`accumulate` loop. On a CPU-only machine Accelerate runs
DDP (the JSON's `accelerate_mode`), so there the comparison is fsdp2kit's FSDP2 against Accelerate's DDP.

The same 25M Llama, initial weights, data, fp32 precision, AdamW, clipping and world size, run alternately; medians of
the repeats. Prints one JSON object: per world size, ratio_tokens_per_s and ratio_peak_mem (fsdp2kit / reference;
peak RSS of rank 0) and loss_max_rel_diff.

Run: .venv/bin/python benchmarks/vs_accelerate.py [--world-sizes 1 2] [--repeats 3] [--steps 6] [--seq-len 256]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import main  # noqa: E402

if __name__ == "__main__":
    main("accelerate", "vs_accelerate")
