"""What tests/test_strategy_rl.py and tests/strategy_rl_worker.py share: losses of the kinds RL algorithms write (an
entropy bonus, metrics, a temperature), the same step computed by a plain transformers model, and the gradients the
strategy's optimizer is handed (after clipping), gathered whole, for comparison with the plain model's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from strategy_case import clip_grad_norm_exact, policy_loss, strategy_config
from torch.distributed.tensor import DTensor

Batch = dict[str, torch.Tensor]
ENTROPY_COEF = 0.01
CLIP = 0.25  # max_grad_norm below the cases' gradient norms: clipping acts


def clipped_config(model_dir: str, output_dir: str, steps: int, ulysses: int = 1) -> dict[str, Any]:
    """strategy_case's config with max_grad_norm CLIP."""
    config = strategy_config(model_dir, output_dir, steps, ulysses)
    config["training"]["max_grad_norm"] = CLIP
    return config


def metric_loss(log_probs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """The policy loss and two metrics of the micro-batch."""
    loss_sum, weight = policy_loss(log_probs, batch)
    return loss_sum, weight, {"log_prob_mean": log_probs.detach().mean(), "weight": weight}


def entropy_bonus_loss(log_probs: torch.Tensor, batch: Batch, entropy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The policy loss minus an entropy bonus over the weighted tokens (entropy with autograd)."""
    loss_sum, weight = policy_loss(log_probs, batch)
    return loss_sum - ENTROPY_COEF * (entropy * batch["token_weights"]).sum(), weight


def plain_outputs(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(next token) and the entropy [B, T-1] from whole logits, at the batch's temperature if it has one."""
    logits = logits[:, :-1].float()
    temperature = batch.get("temperature")
    if temperature is not None:
        temperature = torch.as_tensor(temperature, dtype=torch.float32)
        logits = logits / (temperature[:, None, None] if temperature.dim() else temperature)
    log_softmax = torch.log_softmax(logits, -1)
    log_probs = log_softmax.gather(-1, batch["input_ids"][:, 1:, None].long()).squeeze(-1)
    return log_probs, -(log_softmax.exp() * log_softmax).sum(-1)


def plain_step(model_dir: str, micro_batches: list[Batch], loss_fn: Any, max_grad_norm: float = CLIP) -> dict:
    """One step of the whole global batch through transformers' model: the loss sum(loss_sum) / sum(weight), the
    gradient norm before clipping, the clipped gradients by name and each micro-batch's metrics."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sums, weights, metrics = [], [], []
    for batch in micro_batches:
        logits = model(input_ids=batch["input_ids"].long(), attention_mask=batch.get("attention_mask")).logits
        log_probs, entropy = plain_outputs(logits, batch)
        wants_entropy = loss_fn is entropy_bonus_loss
        result = loss_fn(log_probs, batch, entropy) if wants_entropy else loss_fn(log_probs, batch)
        sums.append(result[0])
        weights.append(result[1])
        metrics.append(result[2] if len(result) > 2 else {})
    loss = torch.stack(sums).sum() / torch.stack(weights).sum()
    loss.backward()
    norm = clip_grad_norm_exact(model.parameters(), max_grad_norm)
    grads = {name: p.grad for name, p in model.named_parameters()}
    return {"loss": loss.item(), "grad_norm": norm.item(), "grads": grads, "metrics": metrics}


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


@contextmanager
def applied_gradients(strategy: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, the gradients (whole, by parameter name) the optimizer steps with, as it steps."""
    captured: dict[str, torch.Tensor] = {}

    def capture(*_: Any) -> None:
        for name, param in strategy.model.named_parameters():
            if param.grad is not None:
                captured[name] = whole(param.grad).detach().clone()

    handle = strategy.optimizer.register_step_pre_hook(capture)
    try:
        yield captured
    finally:
        handle.remove()


def largest_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest elementwise difference between two gradient sets; inf when their names differ."""
    if sorted(got) != sorted(expected):
        return float("inf")
    return max((got[name] - expected[name]).abs().max().item() for name in expected)


def update_norm(grads: dict[str, torch.Tensor]) -> float:
    return torch.stack([g.norm() for g in grads.values()]).norm().item()


def left_padded(batch: Batch) -> Batch:
    """The batch with its prompts left-padded too (RL's layout): the first 3 and 2 tokens of its rows masked."""
    mask = batch["attention_mask"].clone()
    mask[0, :3] = 0
    mask[1, :2] = 0
    real = mask[:, :-1] * mask[:, 1:]  # a real token's prediction of a real token
    ids = batch["input_ids"].masked_fill(mask == 0, 0)
    return {**batch, "attention_mask": mask, "input_ids": ids, "token_weights": batch["token_weights"] * real}
