"""One rank of a `fsdp2kit.Strategy` run for tests/test_strategy.py, launched as `python tests/strategy_worker.py
MODEL_DIR OUT ACCUMULATION ULYSSES STEPS` under torchrun's environment (or alone, a world of one): every step it
takes its data-parallel share of the global micro-batches and trains them with the policy-gradient-style loss of
`strategy_case`; rank 0 saves the losses and the final weights (`full_weights`) to OUT."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from strategy_case import global_micro_batches, policy_loss, strategy_config

import fsdp2kit


def run(model_dir: str, out: str, accumulation: int, ulysses: int, steps: int) -> None:
    strategy = fsdp2kit.Strategy.from_config(strategy_config(model_dir, out + ".run", steps, ulysses))
    data_parallel = dist.get_world_size() // ulysses
    rank = dist.get_rank() // ulysses  # the ranks of a sequence-parallel group train the same micro-batches
    losses = []
    for step in range(steps):
        mine = global_micro_batches(step, accumulation * data_parallel)[rank::data_parallel]
        losses.append(strategy.train_step(mine, policy_loss)["loss"])
    weights = {name: tensor.clone() for name, tensor in strategy.full_weights(bucket_bytes=1 << 16)}
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "weights": weights}, out)


if __name__ == "__main__":
    model_dir, out, accumulation, ulysses, steps = sys.argv[1:6]
    run(model_dir, out, int(accumulation), int(ulysses), int(steps))
