"""The case tests/test_strategy.py trains through `fsdp2kit.Strategy` and with a plain PyTorch loop: seeded global
micro-batches (right-padded, with per-sample advantages and per-token weights) and an algorithm's own loss."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

LENGTH, ROWS, VOCAB = 17, 2, 512
LEARNING_RATE = 1e-3


def clip_grad_norm_exact(params: Any, max_norm: float) -> torch.Tensor:
    """torch's `clip_grad_norm_` with the norm taken in float64, as fsdp2kit's is on the CPU: torch's CPU norm kernel
    accumulates each tensor in fp32 and is 1e-5 to 1e-4 off on these tiny models."""
    params = [p for p in params if p.grad is not None]
    norm = torch.stack([p.grad.double().norm() for p in params]).norm()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.float())
    return norm


def strategy_config(model_dir: str, output_dir: str, steps: int, ulysses: int = 1) -> dict[str, Any]:
    return {
        "model": {"name_or_path": model_dir, "ulysses_size": ulysses},
        "training": {
            "learning_rate": LEARNING_RATE,
            "lr_scheduler_type": "constant",
            "max_steps": steps,
            "max_grad_norm": 1.0,
            "output_dir": output_dir,
        },
    }


def global_micro_batches(step: int, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of step `step`, the same in every process."""
    generator = torch.Generator().manual_seed(1000 + step)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB, (ROWS, LENGTH), generator=generator)
        lengths = torch.randint(LENGTH // 2, LENGTH + 1, (ROWS,), generator=generator)
        mask = (torch.arange(LENGTH)[None, :] < lengths[:, None]).long()
        weights = torch.rand(ROWS, LENGTH - 1, generator=generator) * mask[:, 1:]
        batches.append(
            {
                "input_ids": ids.masked_fill(mask == 0, 0),
                "attention_mask": mask,
                "advantages": torch.randn(ROWS, generator=generator),
                "token_weights": weights,
            }
        )
    return batches


def policy_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A clipped-ratio policy-gradient loss with per-token weights: (summed loss, number of weighted tokens)."""
    ratio = torch.exp(log_probs - (log_probs.detach() - 0.1))
    advantages = batch["advantages"][:, None]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    weights = batch["token_weights"]
    return -(surrogate * weights).sum(), (weights > 0).sum().float()


def plain_training(
    model: torch.nn.Module,
    steps: int,
    micro_batches: Callable[[int], list[dict[str, torch.Tensor]]],
    loss_of: Callable[[dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]],
) -> dict:
    """What the Strategy's training must equal, as a plain single-process PyTorch loop: AdamW, clipping, each step's
    loss summed over all its micro-batches (`micro_batches(step)`; `loss_of(batch)` -> (summed loss, weight)) and
    divided by their total weight. Returns the steps' losses and the trained weights."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    losses = []
    for step in range(steps):
        terms = [loss_of(batch) for batch in micro_batches(step)]
        loss = torch.stack([t[0] for t in terms]).sum() / torch.stack([t[1] for t in terms]).sum()
        loss.backward()
        clip_grad_norm_exact(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": model.state_dict()}
