"""One rank of tests/test_replica_reduce.py, under torchrun: fsdp2kit's NO_SHARD (whole parameters on every rank,
gradients all-reduced across the replicas while backward goes on) against torch's DistributedDataParallel, on the
same model, micro-batches and loss; once as configured and once with `sync_each_batch` (weights read by rank 0
and broadcast). Rank 0 saves each run's
losses and weights, and how many all-reduces were still in flight at each end of backward, to OUT."""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from strategy_case import LEARNING_RATE, clip_grad_norm_exact, global_micro_batches, policy_loss, strategy_config
from transformers import AutoModelForCausalLM

import fsdp2kit
from fsdp2kit.parallel import replica_reduce

STEPS, ACCUMULATION = 2, 2


def next_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def count_in_flight() -> list[int]:
    """Record len(pending) at every wait: the all-reduces that overlapped backward."""
    seen: list[int] = []
    wait = replica_reduce.ReplicaAllReduce.wait

    def counting(self: replica_reduce.ReplicaAllReduce) -> None:
        seen.append(len(self.pending))
        wait(self)

    replica_reduce.ReplicaAllReduce.wait = counting  # type: ignore[method-assign]
    return seen


def mine(step: int) -> list[dict[str, torch.Tensor]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    return global_micro_batches(step, ACCUMULATION * world)[rank::world]


def with_ddp(model_dir: str) -> dict:
    """The reference: DDP, `no_sync` while accumulating, each micro-batch's loss over the global weight."""
    model = torch.nn.parallel.DistributedDataParallel(AutoModelForCausalLM.from_pretrained(model_dir))
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        total = sum(
            policy_loss(torch.zeros(b["token_weights"].shape), b)[1]
            for b in global_micro_batches(step, ACCUMULATION * dist.get_world_size())
        )
        loss = torch.zeros(())
        for index, batch in enumerate(mine(step)):
            last = index == ACCUMULATION - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                summed = policy_loss(next_token_logprobs(logits, batch["input_ids"]), batch)[0] / total
                (summed * dist.get_world_size()).backward()  # DDP averages over the ranks
            loss += summed.detach()
        dist.all_reduce(loss)
        clip_grad_norm_exact(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}


def with_fsdp2kit(model_dir: str, out: str, sync_each_batch: bool) -> dict:
    config = strategy_config(model_dir, out, STEPS)
    if sync_each_batch:  # and rank 0 reads the weights for every replica
        config["model"]["weights_loading"] = "rank0_broadcast"
    config["strategy_args"] = {"strategy_config": {"sharding_strategy": "NO_SHARD", "sync_each_batch": sync_each_batch}}
    strategy = fsdp2kit.Strategy.from_config(config)
    losses = [strategy.train_step(mine(step), policy_loss)["loss"] for step in range(STEPS)]
    return {"losses": losses, "weights": dict(strategy.full_weights())}


if __name__ == "__main__":
    model_dir, out = sys.argv[1:3]
    in_flight = count_in_flight()
    runs = {"overlapped": with_fsdp2kit(model_dir, out + ".a", False)}
    runs["in_flight"] = list(in_flight)
    in_flight.clear()
    runs["sync_each_batch"] = with_fsdp2kit(model_dir, out + ".b", True)
    runs["sync_each_batch_in_flight"] = list(in_flight)
    runs["ddp"] = with_ddp(model_dir)
    if dist.get_rank() == 0:
        torch.save(runs, out)
