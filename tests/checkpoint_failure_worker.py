"""One rank of tests/test_checkpoint_failure.py, launched as `python tests/checkpoint_failure_worker.py MODEL_DIR
OUT CASE` under torchrun: it saves a checkpoint through the Strategy API where one rank fails (`folders`: each rank
names its own folder, as ROLL's workers do; `disk`: rank 1's disk is full as it writes) and writes what it raised
to OUT.rankN, so the test sees every rank stop with the error instead of one waiting for the other."""

from __future__ import annotations

import sys
from pathlib import Path

import torch.distributed as dist
from strategy_case import strategy_config

import fsdp2kit


def run(model_dir: str, out: str, case: str) -> None:
    strategy = fsdp2kit.Strategy.from_config(strategy_config(model_dir, out + ".run", 1))
    rank = dist.get_rank()
    folder = Path(out + ".run") / (f"rank-{rank}/checkpoint-1" if case == "folders" else "checkpoint-1")
    try:
        strategy.save_checkpoint(folder)
        raised = "nothing"
    except Exception as exc:
        raised = f"{type(exc).__name__}: {exc}"
    Path(f"{out}.rank{rank}").write_text(raised)


if __name__ == "__main__":
    run(*sys.argv[1:4])
