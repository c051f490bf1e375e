"""One rank of tests/test_lora_init.py's LoRA run, launched as `python tests/lora_worker.py RUN.json` under torchrun's
environment (or called in-process by the test, a world of one): the `fsdp2kit.Strategy` of the run's config, its
adapters as they start (whole, under PEFT's keys), then `steps` steps of next-token cross-entropy, each on this
rank's share of the same two seeded micro-batches (so that the loss falls where the adapters learn); rank 0 saves
the adapters, losses and gradient norms to the run's `out`."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from moe_families_worker import micro_batches

import fsdp2kit
from fsdp2kit.models.lora import full_tensor, peft_state


def train(run: dict[str, Any]) -> None:
    strategy = fsdp2kit.Strategy.from_config(run["config"])
    start = {key: full_tensor(tensor).clone() for key, tensor in peft_state(strategy.model).items()}
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, grad_norms = [], []
    for _ in range(run["steps"]):
        result = strategy.train_step(micro_batches(0, 2)[rank::world])
        losses.append(result["loss"])
        grad_norms.append(result["grad_norm"])
    if rank == 0:
        torch.save({"start": start, "losses": losses, "grad_norms": grad_norms}, run["out"])


if __name__ == "__main__":
    train(json.loads(open(sys.argv[1]).read()))
