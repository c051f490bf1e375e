"""One rank of the 2-rank zoo run for tests/test_zoo.py, launched as `python tests/zoo_worker.py ROOT OUT` under
torchrun: for every family of `zoo_case.FAMILIES` (folders already under ROOT) it builds a Strategy, trains one step
on its share of the micro-batches and scores the probe batch, then scores it with the two ranks as one Ulysses pair;
rank 0 saves the results to OUT. One process start-up serves every family."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from zoo_case import FAMILIES, probe_batch, train_and_score, zoo_batches, zoo_config

import fsdp2kit


def run(root: Path, out: Path) -> None:
    results = {}
    for family in FAMILIES:
        strategy = fsdp2kit.Strategy.from_config(zoo_config(root / family.name, out.parent / "run"))
        mine = zoo_batches(2)[dist.get_rank() :: dist.get_world_size()]
        results[family.name] = train_and_score(strategy, mine)
    for family in FAMILIES:  # the two ranks as one Ulysses pair, around the attention the family runs
        strategy = fsdp2kit.Strategy.from_config(zoo_config(root / family.name, out.parent / "run", ulysses=2))
        results[family.name]["ulysses"] = strategy.forward_step(probe_batch())["log_probs"]
    if dist.get_rank() == 0:
        torch.save(results, out)


if __name__ == "__main__":
    run(Path(sys.argv[1]), Path(sys.argv[2]))
