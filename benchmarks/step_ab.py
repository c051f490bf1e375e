"""fsdp2kit's step against the minimal loop's step in the same processes: each rank holds both fsdp2kit's `Strategy`
and the hand-written loop's model (`reference_loop.py`), and runs their steps alternately (the order flipped every
step) on the same batches. What separate processes cannot show apart from this VM's drift (two runs of the same
code differ by 5-15%) or from process-level state (the allocator, threads): the step's own cost.

Pairs: `full_shard` — fsdp2kit's default against `fully_shard` on each layer and the root; `no_shard` — fsdp2kit's
NO_SHARD against torch's DistributedDataParallel with `no_sync` during accumulation (what Accelerate runs on CPU).
Both sides get synthetic batches (`--synthetic-batches` of the reference loop), or fsdp2kit's own pipeline batches
with `--pipeline-batches` (document masks included). Prints one JSON object: per world size each side's median
step seconds (the first step left out) and the ratio of speeds fsdp2kit / reference; the median of the steps' paired
ratios (each step's two sides ran back to back, so a change in the machine's load hits both); and each side's CPU
seconds per step on rank 0 (the step's own work, without waiting on a rank another job slowed).

Run: .venv/bin/python benchmarks/step_ab.py [--pair full_shard] [--world-sizes 1 2] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import LR, NO_SHARD, REPO, Workload, child_env, fsdp2kit_overrides, load_average, model_folder  # noqa: E402


def _reference(model_dir: str, pair: str, lr: float):
    """The minimal loop: torch's DistributedDataParallel with `no_sync` for `no_shard`, `fully_shard` otherwise."""
    import torch
    from reference_loop import MinimalLoop, ddp_sync, fsdp2_sync, wrap
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    if pair == "no_shard":
        ddp, clip = wrap(model, "ddp", torch.device("cpu"))
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=lr, weight_decay=0.0, foreach=True)
        return MinimalLoop(ddp, optimizer, clip, ddp_sync(ddp))
    sharded, clip = wrap(model, "fsdp2", torch.device("cpu"))
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=lr, weight_decay=0.0, foreach=True)
    return MinimalLoop(sharded, optimizer, clip, fsdp2_sync(sharded))


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist
    from reference_loop import micro_batches_per_step, minimal_step, synthetic_micro_batches

    from fsdp2kit.strategy import Strategy

    work = Workload(args.seq_len, args.batch, args.accumulation, args.steps)
    overrides = fsdp2kit_overrides(Path(args.model), work, Path(f"{args.out}.run"))
    overrides += NO_SHARD if args.pair == "no_shard" else ()
    strategy = Strategy.from_config(REPO / "examples" / "demo.yaml", overrides=overrides)
    strategy.model.train()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    loop = _reference(args.model, args.pair, LR)
    shapes = types.SimpleNamespace(seed=42, **work.__dict__)
    if args.pipeline_batches:
        steps = micro_batches_per_step(shapes, rank, world_size)
    else:
        steps = synthetic_micro_batches(shapes, rank, strategy.sharded.source.hf_config.vocab_size)
    sides = {
        "fsdp2kit": lambda batches: strategy.step(batches),
        "reference": lambda batches: minimal_step(loop, batches),
    }
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    cpu: dict[str, list[float]] = {name: [] for name in sides}
    for index, batches in enumerate(steps):
        for name in list(sides)[:: 1 if index % 2 == 0 else -1]:
            started, started_cpu = time.perf_counter(), time.process_time()
            sides[name](batches)
            seconds[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    if rank == 0:
        Path(args.out).write_text(json.dumps({"step_s": seconds, "cpu_s": cpu}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pair", choices=["full_shard", "no_shard"], default="full_shard")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--pipeline-batches", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    before = load_average()
    results = {}
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-step-ab-") as workdir:
        model = model_folder(Path(workdir))
        for nproc in args.world_sizes:
            out = Path(workdir) / f"ab_{nproc}.json"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
            command += [__file__, "--worker", "--model", str(model), "--out", str(out), *sys.argv[1:]]
            done = subprocess.run(command, env=child_env(), capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
            measured = json.loads(out.read_text())
            seconds, cpu = measured["step_s"], measured["cpu_s"]
            median = {name: statistics.median(values[1:]) for name, values in seconds.items()}
            paired = [ref / ours for ref, ours in zip(seconds["reference"][1:], seconds["fsdp2kit"][1:], strict=True)]
            median_cpu = {name: statistics.median(values[1:]) for name, values in cpu.items()}
            results[str(nproc)] = {
                "median_step_s": median,
                "ratio_speed": median["reference"] / median["fsdp2kit"],
                # each step's two sides ran back to back: the median of their ratios follows the machine's load
                "ratio_speed_paired": statistics.median(paired),
                # this rank's CPU seconds: the step's own work, without the waits another job's load adds
                "median_cpu_s": median_cpu,
                "ratio_cpu": median_cpu["reference"] / median_cpu["fsdp2kit"],
                "step_s": seconds,
            }
    report = {"benchmark": "step_ab", "pair": args.pair, "pipeline_batches": args.pipeline_batches}
    report |= {"steps": args.steps, "loadavg": {"before": before, "after": load_average()}, "world_sizes": results}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
