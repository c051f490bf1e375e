"""One rank of the MoE-family runs of tests/test_moe_families.py, launched as `python tests/moe_families_worker.py
RUNS.json` under torchrun's environment (or called in-process by the test, a world of one). Each run of the JSON list
loads a folder written by transformers' `save_pretrained` through `fsdp2kit.Strategy`, trains `steps` steps of
next-token cross-entropy (router auxiliary loss included) on this rank's share of seeded global micro-batches, then
scores a probe batch and (`export`) exports the model; rank 0 saves the losses, the probe's log-probs and the
`full_weights`."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import fsdp2kit

LENGTH, ROWS, VOCAB = 16, 2, 64


def micro_batches(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of step `step` (step -1: the probe), the same in every process, the last row of each
    right-padded: the router loss leaves padding out."""
    generator = torch.Generator().manual_seed(2000 + step)
    mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
    mask[-1, LENGTH - 5 :] = 0
    return [
        {
            "input_ids": torch.randint(3, VOCAB, (ROWS, LENGTH), generator=generator).masked_fill(mask == 0, 2),
            "attention_mask": mask,
        }
        for _ in range(count)
    ]


def config(run: dict[str, Any]) -> dict[str, Any]:
    per_expert = run["per_expert"]
    return {
        "model": {"name_or_path": run["folder"], "ulysses_size": run["ulysses"], "dtype": "fp32"},
        "strategy_args": {
            "strategy_config": {
                "wrap_policy": {"moe_experts": [run["experts"]] if run["experts"] else []},
                "apply_expert_patch": per_expert,
                "ep_size": run.get("ep", 1),
                "efsdp_size": run.get("efsdp", 1),
                "moe_use_grouped_mm": run.get("grouped_mm", False),
            }
        },
        "training": {
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "max_steps": run["steps"],
            "max_grad_norm": 1.0,
            "output_dir": run["out"] + ".run",
        },
    }


def train(run: dict[str, Any]) -> None:
    strategy = fsdp2kit.Strategy.from_config(config(run))
    data_parallel = dist.get_world_size() // run["ulysses"]
    rank = dist.get_rank() // run["ulysses"]  # the ranks of a sequence-parallel group train the same micro-batches
    losses = []
    for step in range(run["steps"]):
        mine = micro_batches(step, run["accumulation"] * data_parallel)[rank::data_parallel]
        losses.append(strategy.train_step(mine)["loss"])
    log_probs = strategy.forward_step(micro_batches(-1, 1)[0])["log_probs"]
    weights = {name: tensor.clone() for name, tensor in strategy.full_weights(bucket_bytes=1 << 14)}
    if run["export"]:
        strategy.export_hf(run["out"] + ".hf")
    if dist.get_rank() == 0:
        torch.save({"losses": losses, "log_probs": log_probs, "weights": weights}, run["out"])


if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        train(run)
