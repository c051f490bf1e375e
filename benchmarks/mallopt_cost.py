"""The speed and memory cost of the CPU allocator setting fsdp2kit's ranks make (glibc M_MMAP_THRESHOLD fixed at
4 MiB, so freed all-gather buffers go back to the OS): the hand-written fully_shard loop with and without it,
alternately, medians of the repeats. Prints one JSON object per world size: ratio_tokens_per_s and ratio_peak_mem
(with the setting / glibc's default; peak RSS of rank 0) and loss_max_rel_diff (0: the setting changes no number).

Run: .venv/bin/python benchmarks/mallopt_cost.py [--world-sizes 2] [--repeats 3] [--steps 6]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Workload, compare, model_folder, run_reference  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    args = parser.parse_args()
    work = Workload(args.seq_len, args.batch, args.accumulation, args.steps)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-mallopt-") as workdir:
        root = Path(workdir)
        model = model_folder(root)
        for nproc in args.world_sizes:
            tuned, default = [], []
            for repeat in range(args.repeats):
                tuned.append(run_reference("fsdp2", model, nproc, work, root / f"tuned_{nproc}_{repeat}.json"))
                default.append(
                    run_reference(
                        "fsdp2", model, nproc, work, root / f"default_{nproc}_{repeat}.json", ["--glibc-default-mmap"]
                    )
                )
            results[str(nproc)] = compare(tuned, default, ("mmap_threshold_4MiB", "glibc_default"))
    print(json.dumps({"benchmark": "mallopt_cost", "workload": work.__dict__, "world_sizes": results}))


if __name__ == "__main__":
    main()
