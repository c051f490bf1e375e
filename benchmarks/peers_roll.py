"""One rank of benchmarks/peers.py's ROLL arm, in ROLL's environment: ROLL's RLVR `ActorWorker` (built by
tests_roll/roll_worker.py from tests_roll/rlvr_tiny.yaml on the engine `backend` names: fsdp2kit's or ROLL's
FSDP2TrainStrategy; recomputing as ROLL does by default, unless told not to) on 8 rollouts, called as ROLL's
pipeline calls it: compute_log_probs, train_step, again both; those two timed; the entropy bonus the workload's."""

from __future__ import annotations

import json
import os
import sys

import roll_worker  # tests_roll/
import torch.distributed as dist
from peers import Record


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def main() -> None:
    settings = json.loads(sys.argv[1])
    # ROLL's default recompute (every decoder layer) unless --roll-no-recompute (tests_roll/rlvr_tiny.yaml's setting)
    model_args = {"disable_gradient_checkpointing": not settings["roll_recompute"]}
    worker, config = roll_worker.build(
        settings["backend"], "actor", settings["model"], settings["out"], settings["ranks"], model_args
    )
    config.entropy_loss_coef = settings["entropy_coeff"]  # the workload's (ROLL's default: 0), read at each loss
    record = Record()
    record.setup_done()
    worker.compute_log_probs = record.timed("compute_log_probs", worker.compute_log_probs, barrier)
    worker.train_step = record.timed("train_step", worker.train_step, barrier)
    rows = [roll_worker.rollout(step, 8, settings["prompt"], settings["response"]) for step in (0, 1)]
    before = worker.compute_log_probs(roll_worker.share(rows[0], 0)).batch
    first = worker.train_step(roll_worker.share(roll_worker.train_batch(rows[0], {}, "actor"), 0))
    worker.train_step(roll_worker.share(roll_worker.train_batch(rows[1], {}, "actor"), 1))
    worker.compute_log_probs(roll_worker.share(rows[1], 1))
    metrics = first.meta_info["metrics"]
    losses = {
        key: value for key, value in metrics.items() if "loss" in key and not key.startswith(("time/", "system/"))
    }
    record.write(settings["out"], int(os.environ["RANK"]), before["log_probs"].tolist(), losses)
    barrier()


if __name__ == "__main__":
    main()
