"""Weight sync to a rollout engine, at 1 and 2 ranks and learning rates 1e-6, 1e-5 and 1e-4: per sync, the bytes
moved and the time taken by the whole model gathered (`full_weights`, rank 0 serialising it), each rank's blocks
(`sharded`, whole every time), only what changed (`delta`) and a LoRA run's adapters only (`adapter`, rank 16, also
as deltas); the share of values that changed; and a training step's time with a background delta sync running
beside it against none (interleaved, the median of each).

The model is the 25M-parameter Llama of the other CPU benchmarks (fp32 master weights), the rollout dtype bf16,
batches of 4 x 256 tokens, AdamW; each setting trains 2 steps first. Bytes are the messages' tensor bytes summed over
the ranks (what reaches the rollout engine), serialised with `WeightMessage.to_bytes` (the transport is the caller's:
here the bytes are dropped). Times are the slowest rank's.

Prints one JSON object. Run: .venv/bin/python benchmarks/weight_sync.py [--world-sizes 1 2] [--steps 4] [--shape 0.5b]
(on a GPU the ranks train there: benchmarks/gpu_suite.sh runs the 0.5B shape at world size 1).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import REPO, child_env, model_folder

LEARNING_RATES = (1e-6, 1e-5, 1e-4)
SEQ, BATCH, WARM = 256, 4, 2
# --shape 0.5b: Qwen2.5-0.5B's dimensions on the builtin tokenizer (fresh weights), for a GPU (gpu_suite.sh).
SHAPES = {
    "25m": None,
    "0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
}


def slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    value = torch.tensor([seconds])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def summed(count: int) -> int:
    import torch
    import torch.distributed as dist

    value = torch.tensor([count], dtype=torch.int64)
    dist.all_reduce(value)
    return int(value)


def batch(step: int) -> list[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    ids = torch.randint(3, 4096, (BATCH, SEQ), generator=generator)
    return [{"input_ids": ids, "labels": ids}]


def timed(work: Any) -> tuple[Any, float]:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    result = work()
    return result, slowest(time.perf_counter() - start)


def full_sync(s: Any) -> tuple[int, float]:
    """Every tensor gathered on every rank; rank 0 serialises them (what it would send)."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import save

    def gather() -> int:
        weights = {name: tensor.cpu() for name, tensor in s.full_weights(dtype=torch.bfloat16)}
        return len(save(weights)) if dist.get_rank() == 0 else 0

    size, seconds = timed(gather)
    return summed(size), seconds


def sender_sync(sender: Any) -> dict[str, Any]:
    """One sync of `sender` to a receiver that holds what it was sent last (the steady state)."""
    stats, seconds = timed(lambda: sender.sync(sender.sent_version, lambda message: message.to_bytes()))
    return {
        "bytes": summed(stats.bytes),
        "seconds": seconds,
        "changed_fraction": summed(stats.sent_elements) / max(1, summed(stats.elements)),
        "full": stats.full,
    }


def measure_rate(model: Path, learning_rate: float, steps: int, out: Path) -> dict[str, Any]:
    import torch

    import fsdp2kit

    training = {
        "learning_rate": learning_rate,
        "warmup_steps": 0,
        "lr_scheduler_type": "constant",
        "max_steps": 4 * steps + WARM + 4,
        "output_dir": str(out),
    }
    actor = fsdp2kit.Strategy.from_config({"model": {"name_or_path": str(model)}, "training": training})
    lora = {"name_or_path": str(model), "lora": {"rank": 16, "target_modules": "all-linear"}}
    adapters = fsdp2kit.Strategy.from_config({"model": lora, "training": training})
    sharded = actor.weight_sender(dtype=torch.bfloat16, delta=False)
    delta = actor.weight_sender(dtype=torch.bfloat16)
    adapter = adapters.weight_sender(part="adapter")
    for sender in (delta, adapter):
        sender.sync(None, lambda message: message.to_bytes())  # the first sync, whole
    for step in range(WARM):
        actor.train_step(batch(step))
        adapters.train_step(batch(step))
    rows = []
    for step in range(WARM, WARM + steps):
        actor.train_step(batch(step))
        adapters.train_step(batch(step))
        full_bytes, full_seconds = full_sync(actor)
        rows.append(
            {
                "full": {"bytes": full_bytes, "seconds": full_seconds},
                "sharded": sender_sync(sharded),
                "delta": sender_sync(delta),
                "adapter": sender_sync(adapter),
            }
        )
    result: dict[str, Any] = {"learning_rate": learning_rate}
    for kind in ("full", "sharded", "delta", "adapter"):
        keys = [key for key in rows[0][kind] if key != "full"]
        result[kind] = {key: statistics.median(row[kind][key] for row in rows) for key in keys}
    result["delta"]["bytes_vs_full"] = result["delta"]["bytes"] / result["full"]["bytes"]
    result["background"] = background_cost(actor, delta, steps)
    return result


def background_cost(actor: Any, sender: Any, steps: int) -> dict[str, Any]:
    """Training steps alone against training steps with the previous step's delta sync running in the background
    (interleaved pairs); `start_seconds`: what starting it takes on the caller's thread (copying this rank's blocks)."""
    alone, beside, starts = [], [], []
    base = actor.steps_done
    for i in range(steps):
        first, second = batch(100 + base + 2 * i), batch(101 + base + 2 * i)
        _, seconds = timed(lambda: actor.train_step(first))  # noqa: B023 (called at once)
        alone.append(seconds)
        _, start = timed(lambda: sender.start(sender.sent_version, lambda message: message.to_bytes()))
        starts.append(start)
        _, seconds = timed(lambda: actor.train_step(second))  # noqa: B023
        beside.append(seconds)
        sender.wait()
    step_alone, step_beside = statistics.median(alone), statistics.median(beside)
    return {
        "step_seconds_alone": step_alone,
        "step_seconds_beside_sync": step_beside,
        "ratio": step_beside / step_alone,
        "start_seconds": statistics.median(starts),
    }


def worker(model: Path, steps: int, out: Path) -> None:
    import torch.distributed as dist

    from fsdp2kit.distributed import shutdown

    try:
        results = [measure_rate(model, rate, steps, out / f"lr{rate}") for rate in LEARNING_RATES]
        if dist.get_rank() == 0:
            (out / "result.json").write_text(json.dumps(results))
    finally:
        shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="25m")
    parser.add_argument("--worker", nargs=2, metavar=("MODEL", "OUT"))
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker[0]), args.steps, Path(args.worker[1]))
        return
    report: dict[str, Any] = {"model": f"llama {args.shape}, fp32 master, bf16 rollout", "seq": SEQ, "batch": BATCH}
    report["runs"] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = model_folder(Path(tmp), SHAPES[args.shape], f"llama{args.shape}")
        for world in args.world_sizes:
            out = Path(tmp) / f"world{world}"
            out.mkdir()
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
            command += [__file__, "--steps", str(args.steps), "--worker", str(model), str(out)]
            done = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"world {world} failed:\n{done.stderr[-3000:]}")
            report["runs"][str(world)] = json.loads((out / "result.json").read_text())
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
