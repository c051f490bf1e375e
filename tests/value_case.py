"""The value and reward models tests/test_value_models.py trains through `fsdp2kit.Strategy` and with a plain PyTorch
loop: a PPO critic's clipped value loss on `values` [B, T] (LlamaForTokenClassification, one label) and a
Bradley-Terry loss on `scores` [B] of (chosen, rejected) row pairs (LlamaForSequenceClassification, one label), on
seeded right-padded micro-batches. Run as a script under torchrun (`python tests/value_case.py CRITIC_DIR REWARD_DIR
OUT`), each rank trains its data-parallel share of the critic and of the reward model, then the critic under Ulysses
2; rank 0 saves the losses and final weights of each run to OUT."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from strategy_case import global_micro_batches, plain_training, strategy_config

import fsdp2kit

STEPS, GLOBAL_MICRO_BATCHES = 3, 2
CLIP = 0.2
AUTO_CLASSES = {"critic": "AutoModelForTokenClassification", "reward": "AutoModelForSequenceClassification"}
MODEL_CLASSES = {
    "critic": "transformers:LlamaForTokenClassification",
    "reward": "transformers:LlamaForSequenceClassification",
}


def micro_batches(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """strategy_case's micro-batches with the critic's targets: returns and the old values it is clipped around."""
    generator = torch.Generator().manual_seed(2000 + step)
    batches = global_micro_batches(step, count)
    for batch in batches:
        shape = batch["token_weights"].shape
        batch["returns"] = torch.randn(shape, generator=generator)
        batch["old_values"] = batch["returns"] + torch.randn(shape, generator=generator) * 0.5
    return batches


def value_loss(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss on the values of positions 0..T-2 (each the state before the next token), over the
    weighted tokens: (summed loss, number of weighted tokens)."""
    current, old, returns = values[:, :-1], batch["old_values"], batch["returns"]
    clipped = old + (current - old).clamp(-CLIP, CLIP)
    loss = 0.5 * torch.maximum((current - returns).square(), (clipped - returns).square())
    weights = batch["token_weights"]
    return (loss * weights).sum(), (weights > 0).sum().float()


def reward_loss(scores: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Bradley-Terry on (chosen, rejected) row pairs: rows 0, 2, ... are preferred to rows 1, 3, ..."""
    pairs = scores.shape[0] // 2
    return -F.logsigmoid(scores[0::2] - scores[1::2]).sum(), torch.tensor(float(pairs))


LOSSES = {"critic": value_loss, "reward": reward_loss}


def config(kind: str, model_dir: str, output_dir: str, ulysses: int = 1) -> dict[str, Any]:
    cfg = strategy_config(model_dir, output_dir, STEPS, ulysses)
    cfg["model"]["model_class"] = MODEL_CLASSES[kind]
    return cfg


def train(kind: str, model_dir: str, output_dir: str, ulysses: int = 1) -> tuple[fsdp2kit.Strategy, list[float]]:
    """STEPS steps through the Strategy, this rank taking its data-parallel share of the global micro-batches."""
    strategy = fsdp2kit.Strategy.from_config(config(kind, model_dir, output_dir, ulysses))
    data_parallel = dist.get_world_size() // ulysses
    rank = dist.get_rank() // ulysses  # the ranks of a sequence-parallel group train the same micro-batches
    losses = []
    for step in range(STEPS):
        mine = micro_batches(step, GLOBAL_MICRO_BATCHES)[rank::data_parallel]
        losses.append(strategy.train_step(mine, LOSSES[kind])["loss"])
    return strategy, losses


def outputs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """values [B, T] or scores [B] of a transformers model."""
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]


def load_reference(kind: str, model_dir: Path) -> torch.nn.Module:
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    if kind == "critic":  # no dropout before a critic's head (transformers' default would be 0.1): fsdp2kit's default
        config.classifier_dropout = 0.0
    return getattr(transformers, AUTO_CLASSES[kind]).from_pretrained(model_dir, config=config, dtype=torch.float32)


def reference(kind: str, model_dir: Path) -> dict:
    """The same training as a plain single-process loop of transformers' model."""
    model = load_reference(kind, model_dir)
    return plain_training(
        model,
        STEPS,
        lambda step: micro_batches(step, GLOBAL_MICRO_BATCHES),
        lambda b: LOSSES[kind](outputs(model, b), b),
    )


def run(critic_dir: str, reward_dir: str, out: str) -> None:
    """Both models at data parallel over the world, then the critic under Ulysses over the world."""
    results = {}
    for name, kind, model_dir, ulysses in [
        ("critic", "critic", critic_dir, 1),
        ("reward", "reward", reward_dir, 1),
        ("critic-ulysses", "critic", critic_dir, int(os.environ.get("WORLD_SIZE", "1"))),
    ]:
        strategy, losses = train(kind, model_dir, f"{out}.{name}", ulysses)
        weights = {n: t.clone() for n, t in strategy.full_weights(bucket_bytes=1 << 16)}
        results[name] = {"losses": losses, "weights": weights}
    results["reward-ulysses-padded-with-5"] = padding_scored_under_ulysses(reward_dir, f"{out}.refused")
    if dist.get_rank() == 0:
        torch.save(results, out)


def padding_scored_under_ulysses(reward_dir: str, output_dir: str) -> str:
    """A reward model's forward_step under Ulysses over the world on rows padded with id 5, not its pad_token_id 0:
    each score would be read at padding, whose output depends on the split. The refusal, or "" for none."""
    from fsdp2kit.errors import UserError

    strategy = fsdp2kit.Strategy.from_config(config("reward", reward_dir, output_dir, dist.get_world_size()))
    batch = micro_batches(0, 1)[0]
    batch["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, 5)
    try:
        strategy.forward_step(batch)
    except UserError as refused:
        return str(refused)
    return ""


if __name__ == "__main__":
    run(*sys.argv[1:4])
