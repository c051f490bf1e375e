"""One rank of the ROLL adapter for tests/test_integration_ranks.py, launched as `python tests/integration_worker.py
MODEL_DIR OUT` under torchrun's environment: the rank replays ROLL's ActorWorker calls on its data-parallel share of
each batch, then again with the ranks as one Ulysses group; rank 0 saves what they saw to OUT. (verl's adapter is
tested against verl's own TrainingWorker, tests_verl/.)"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from test_integration_roll import replay


def run(model_dir: str, out: str) -> None:
    rank, ranks = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    roll = replay(model_dir, Path(out + ".roll"), rank, ranks, checkpoints=False)  # saves: tested at one rank
    # the same ranks as one Ulysses group: one data-parallel rank with the whole batch, each sequence split in two
    roll_ulysses = replay(model_dir, Path(out + ".roll_ulysses"), 0, 1, checkpoints=False, ulysses=ranks)
    if rank == 0:
        torch.save({"roll": roll, "roll_ulysses": roll_ulysses}, out)


if __name__ == "__main__":
    run(*sys.argv[1:3])
