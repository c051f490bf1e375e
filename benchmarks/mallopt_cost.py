"""The speed and memory of three CPU allocator settings, on the hand-written fully_shard loop (so only the
allocator differs), alternately, medians of the repeats:

- `glibc`: glibc as it comes (its mmap threshold rises after each large free, freed heap memory is kept);
- `return`: M_MMAP_THRESHOLD fixed at 4 MiB for the whole run, large frees unmapped (fsdp2kit's ranks before);
- `fsdp2kit`: that while loading, then the steps' setting (`distributed.reuse_freed_memory`: buffers up to 32 MiB
  from the heap, freed memory kept for the next step), what fsdp2kit's CPU ranks do now.

Prints one JSON object: per world size each arm's tokens/s, peak RSS of rank 0 and losses, and the ratios
fsdp2kit / return and fsdp2kit / glibc (loss_max_rel_diff 0: the allocator changes no number).

Run: .venv/bin/python benchmarks/mallopt_cost.py [--world-sizes 2] [--repeats 3] [--steps 6]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Arm, arms_main  # noqa: E402

if __name__ == "__main__":
    arms_main(
        "mallopt_cost",
        [Arm(name, "fsdp2", ("--allocator", name)) for name in ("fsdp2kit", "return", "glibc")],
        [("fsdp2kit", "return"), ("fsdp2kit", "glibc")],
        "the fully_shard loop with three CPU allocator settings",
    )
