"""One rank of tests/test_checkpoint_failure.py, launched as `python tests/checkpoint_failure_worker.py MODEL_DIR
OUT CASE` under torchrun: it saves a checkpoint through the Strategy API where one rank fails (`folders`: each rank
names its own folder, as ROLL's workers do; `disk`: rank 1's disk is full as it writes; `late_verdict`: the disk
under OUT fills in DCP's write on both ranks, and rank 1 judges the failure a second after rank 0, as a slower
rank does) and writes what it raised to OUT.rankN, so the test sees every rank stop with the error instead of one
waiting for the other."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from strategy_case import strategy_config
from torch.distributed.checkpoint.api import CheckpointException

import fsdp2kit
import fsdp2kit.checkpoint.manager as checkpoint_manager


def judge_late() -> None:
    """This rank decides whether its failed write ran out of space one second later than it would."""
    judge = checkpoint_manager.ran_out_of_space

    def later(*args: Any) -> bool:
        time.sleep(1.0)
        return judge(*args)

    checkpoint_manager.ran_out_of_space = later


def run(model_dir: str, out: str, case: str) -> None:
    strategy = fsdp2kit.Strategy.from_config(strategy_config(model_dir, out + ".run", 1))
    rank = dist.get_rank()
    folder = Path(out + ".run") / (f"rank-{rank}/checkpoint-1" if case == "folders" else "checkpoint-1")
    if case == "late_verdict" and rank == 1:
        judge_late()
    try:
        strategy.save_checkpoint(folder)
        raised = "nothing"
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raised = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.rank{rank}").write_text(raised)


if __name__ == "__main__":
    run(*sys.argv[1:4])
