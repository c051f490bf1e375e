"""One rank of benchmarks/peers.py's verl arm, in verl's environment: verl's actor (`TrainingWorker` with verl's PPO
loss, built by tests_verl/verl_driver.py from the engine config `backend` names: fsdp2kit's or verl's FSDP2) on 8
rollouts, called as verl's PPO trainer calls it (verl_driver.infer / verl_driver.update): log-probs and entropy,
an update (two mini-batches), another, log-probs again; `infer_batch` and `train_mini_batch` timed. The log-prob
calls compute entropies (verl's `_compute_old_log_prob` always asks), the updates only under an entropy bonus
(`entropy_coeff` not 0, as verl's `_update_actor` decides)."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist
import verl_driver as driver  # tests_verl/ (it registers verl's CPU platform first)
from peers import Record
from verl import DataProto

FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}


def main() -> None:
    # verl's defaults otherwise (enable_gradient_checkpointing: both engines recompute every layer in backward)
    settings = {"ulysses": 1, "mixed_precision": FP32, "lr": 1e-3, "weight_decay": 0.1, "remove_padding": True}
    settings.update(json.loads(sys.argv[1]))
    driver.start(settings)
    rollout = driver.share(driver.rollout_batch(settings["model"], settings["prompt"], settings["response"]))
    actor = driver.actor_worker(settings)
    record = Record()
    record.setup_done()
    actor.infer_batch = record.timed("infer_batch", actor.infer_batch, dist.barrier)
    actor.train_mini_batch = record.timed("train_mini_batch", actor.train_mini_batch, dist.barrier)
    bonus = settings["entropy_coeff"] != 0
    before = driver.infer(actor, rollout, "log_probs", entropy=True)
    batch = rollout.union(DataProto.from_single_dict({"old_log_probs": before["log_probs"]}))
    first = driver.update(actor, batch, entropy=bonus)
    driver.update(actor, batch, entropy=bonus)
    driver.infer(actor, rollout, "log_probs", entropy=True)
    losses = {key: value for key, value in first["reduced"].items() if "loss" in key}
    record.write(settings["out"], dist.get_rank(), before["log_probs"].tolist(), losses)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
