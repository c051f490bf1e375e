"""AdamW with weight-decay groups, and warmup followed by constant, linear or cosine decay."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.optim.lr_scheduler import LambdaLR

from fsdp2kit.config.schema import TrainingConfig


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.AdamW:
    """Biases and norm weights (1-D tensors) get no weight decay, as in HF Trainer."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    on_cuda = any(p.is_cuda for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.learning_rate,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             fused=True if on_cuda else None, foreach=None if on_cuda else True)


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int) -> LambdaLR:
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, cfg.warmup_steps, cfg.lr_scheduler_type))
