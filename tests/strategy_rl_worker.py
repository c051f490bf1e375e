"""Two ranks of `fsdp2kit.Strategy` driven as an RL loop drives it, for tests/test_strategy_rl.py: `python
tests/strategy_rl_worker.py MODEL_DIR OUT` under torchrun. Each rank writes what it measured to OUT.rank<r> (a dict,
saved after each part, so that a part that hangs leaves the parts before it):

- data-parallel: forward_step, then train_step over a micro-batch per rank: the clipped gradients the optimizer
  steps with, the gradient norm and the metrics against plain transformers on the whole global batch;
- Ulysses 2: left-padded prompts without position_ids against transformers' padded log-probs, then a plain
  transformers model built from the strategy's source config in the same process;
- unequal micro-batch counts (rank 0 two, rank 1 one): the error each rank raises and how long it took;
- a batch only rank 1 refuses (train_step: an id outside the vocabulary; forward_step: no rows) and a loss_fn that
  fails part-way (at micro-batch 1, on both ranks): each call's error and time, then a good step against a fresh
  strategy's first step."""

from __future__ import annotations

import os
import sys
import time

import torch
from rl_case import (
    applied_gradients,
    clipped_config,
    largest_difference,
    left_padded,
    metric_loss,
    plain_step,
    update_norm,
)
from strategy_case import global_micro_batches, policy_loss

import fsdp2kit
from fsdp2kit.errors import UserError


def data_parallel(strategy: fsdp2kit.Strategy, model_dir: str, rank: int) -> dict:
    batches = global_micro_batches(0, 2)
    expected = plain_step(model_dir, batches, policy_loss)
    strategy.forward_step(batches[rank])
    with applied_gradients(strategy) as grads:
        result = strategy.train_step([batches[rank]], policy_loss)
    return {
        "grad_norm": (result["grad_norm"], expected["grad_norm"]),
        "update_norm": update_norm(grads),
        "grad_error": largest_difference(grads, expected["grads"]),
    }


def metrics(strategy: fsdp2kit.Strategy, rank: int) -> dict:
    """A second step: each rank's metrics averaged with the other's, against the metrics of both micro-batches
    computed from forward_step's log-probs at the same weights."""
    batches = global_micro_batches(1, 2)
    each = [metric_loss(strategy.forward_step(batch)["log_probs"], batch)[2] for batch in batches]
    expected = {name: sum(m[name].item() for m in each) / 2 for name in each[0]}
    result = strategy.train_step([batches[rank]], metric_loss)
    return {"metrics": (result.get("metrics"), expected)}


def ulysses(model_dir: str, out: str) -> dict:
    from transformers import AutoModelForCausalLM

    strategy = fsdp2kit.Strategy.from_config(clipped_config(model_dir, out + ".sp", 2, ulysses=2))
    batch = left_padded(global_micro_batches(3, 1)[0])
    got = strategy.forward_step(batch)["log_probs"]
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    expected = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    real = (batch["attention_mask"][:, :-1] * batch["attention_mask"][:, 1:]).bool()
    # A rollout model built from the same config in the same process must compute what a fresh one computes.
    rollout = AutoModelForCausalLM.from_config(strategy.sharded.source.hf_config).eval()
    rollout.load_state_dict(plain.state_dict())
    with torch.no_grad():
        rollout_logits = rollout(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return {
        "left_padded_error": (got - expected)[real].abs().max().item(),
        "plain_model_error": (rollout_logits - logits).abs().max().item(),
    }


def unequal_counts(strategy: fsdp2kit.Strategy, rank: int) -> dict:
    batches = global_micro_batches(1, 2)[: 2 - rank]
    start = time.monotonic()
    try:
        strategy.train_step(batches, policy_loss)
        error = None
    except UserError as exc:
        error = str(exc)
    return {"unequal_error": error, "unequal_seconds": time.monotonic() - start}


def timed_errors(calls: list) -> tuple[list[str | None], list[float]]:
    """Each call's UserError (None: it returned) and its seconds."""
    errors, seconds = [], []
    for call in calls:
        start = time.monotonic()
        try:
            call()
            errors.append(None)
        except UserError as exc:
            errors.append(str(exc))
        seconds.append(time.monotonic() - start)
    return errors, seconds


def refused_batches(model_dir: str, out: str, rank: int) -> dict:
    good = global_micro_batches(2, 2)
    out_of_vocabulary = {**good[0], "input_ids": good[0]["input_ids"].clone().fill_(1 << 20)}
    no_rows = {key: value[:0] for key, value in good[0].items()}
    calls_made = []

    def fails_at_micro_batch_1(log_probs: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        calls_made.append(1)
        return policy_loss(log_probs, batch) if len(calls_made) == 1 else (log_probs.sum(), "not a tensor")

    strategy = fsdp2kit.Strategy.from_config(clipped_config(model_dir, out + ".refused", 3))
    errors, seconds = timed_errors(
        [
            lambda: strategy.train_step([out_of_vocabulary, good[1]] if rank == 1 else good, policy_loss),
            lambda: strategy.forward_step(no_rows if rank == 1 else good[0]),
            lambda: strategy.train_step(good, fails_at_micro_batch_1),
        ]
    )
    after = strategy.train_step(good, policy_loss)
    first = fsdp2kit.Strategy.from_config(clipped_config(model_dir, out + ".clean", 3)).train_step(good, policy_loss)
    return {
        "refused_errors": errors,
        "refused_seconds": seconds,
        "after_refusals": (after["loss"], after["grad_norm"]),
        "clean_step": (first["loss"], first["grad_norm"]),
    }


def main(model_dir: str, out: str) -> None:
    """Each part's measurements, or the error it raised, saved as soon as the part ends."""
    rank = int(os.environ["RANK"])
    strategy = fsdp2kit.Strategy.from_config(clipped_config(model_dir, out + ".dp", 3))
    parts = {
        "data_parallel": lambda: data_parallel(strategy, model_dir, rank),
        "metrics": lambda: metrics(strategy, rank),
        "ulysses": lambda: ulysses(model_dir, out),
        "unequal": lambda: unequal_counts(strategy, rank),
        "refused": lambda: refused_batches(model_dir, out, rank),
    }
    measured: dict = {}
    for name, part in parts.items():
        try:
            measured |= part()
        except Exception as exc:  # recorded for the test to show, not hidden: the test fails on it
            measured[f"{name}_failure"] = f"{type(exc).__name__}: {exc}"
        torch.save(measured, f"{out}.rank{rank}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
