"""AdamW with weight-decay groups (or Muon with AdamW: train/muon.py), and warmup followed by constant, linear or
cosine decay."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from fsdp2kit.config.schema import TrainingConfig
from fsdp2kit.train.muon import MuonWithAdamW, muon_split, require_torch_muon


def build_optimizer(model: nn.Module, cfg: TrainingConfig) -> torch.optim.Optimizer:
    """AdamW over every trainable parameter, or (training.optimizer: muon) Muon over the matrices
    training.muon_split picks and AdamW over the rest (train/muon.py)."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    if cfg.optimizer == "adamw":
        return adamw(trainable, cfg)
    require_torch_muon()
    matrices, rest = muon_split(model, cfg.muon_split)
    return MuonWithAdamW(matrices, adamw([param for _, param in rest], cfg) if rest else None, cfg)


def describe_optimizer(model: nn.Module, cfg: TrainingConfig) -> dict[str, object]:
    """For `check`: the optimizer, and with Muon the rule that splits the parameters, which it takes and which AdamW
    takes."""
    if cfg.optimizer == "adamw":
        return {"name": "adamw"}
    matrices, rest = muon_split(model, cfg.muon_split)
    names = {"muon": [name for name, _ in matrices], "adamw": [name for name, _ in rest]}
    return {"name": "muon", "split": cfg.muon_split, **names}


def adamw(params: list[nn.Parameter], cfg: TrainingConfig) -> torch.optim.AdamW:
    """Biases and norm weights (1-D tensors) get no weight decay, as in HF Trainer, unless
    `weight_decay_every_parameter` (verl's engine decays all). Sharded (DTensor) and replicated (ignored-module)
    parameters go in separate groups: one foreach op cannot mix the two."""
    groups: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for param in params:
        decay = param.dim() >= 2 or cfg.weight_decay_every_parameter
        groups.setdefault((decay, isinstance(param, DTensor)), []).append(param)
    on_cuda = any(p.is_cuda for params in groups.values() for p in params)
    return torch.optim.AdamW(
        [
            {"params": params, "weight_decay": cfg.weight_decay if decay else 0.0}
            for (decay, _), params in groups.items()
        ],
        lr=cfg.learning_rate,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_epsilon,
        fused=True if on_cuda else None,
        foreach=None if on_cuda else True,
    )


def lr_factor(
    step: int,
    total_steps: int,
    warmup_steps: int,
    kind: str,
    from_zero: bool = False,
    min_ratio: float = 0.0,
    cycles: float = 0.5,
) -> float:
    """Multiplier of the peak learning rate for optimizer step `step` (0-based). Warmup reaches the peak at its last
    step, or with `from_zero` (training.warmup_from_zero) at the first step after it, from 0 at step 0: transformers'
    get_{constant,linear,cosine}_schedule_with_warmup, whose decay this is in either case. The decay ends at
    `min_ratio` (training.min_lr_ratio), the cosine runs `cycles` periods (training.num_cycles); each is computed in
    the order transformers' linear and verl's cosine compute it, so that the rates are theirs to the bit."""
    if step < warmup_steps:
        return (step + (0 if from_zero else 1)) / warmup_steps
    if kind == "constant":
        return 1.0
    span = max(1, total_steps - warmup_steps)
    if kind == "linear":
        return min_ratio + (1.0 - min_ratio) * max(0.0, (total_steps - step) / span)
    progress = min((step - warmup_steps) / span, 1.0)
    return math.cos(math.pi * cycles * 2.0 * progress) * ((1.0 - min_ratio) * 0.5) + (1.0 + min_ratio) * 0.5


def warmup_steps(cfg: TrainingConfig, total_steps: int) -> int:
    """warmup_steps, or else warmup_ratio of the run's steps rounded up (as HF TrainingArguments and ROLL do)."""
    return cfg.warmup_steps or math.ceil(total_steps * cfg.warmup_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainingConfig, total_steps: int) -> LambdaLR:
    warmup = warmup_steps(cfg, total_steps)
    shape = (cfg.lr_scheduler_type, cfg.warmup_from_zero, cfg.min_lr_ratio, cfg.num_cycles)
    return LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, warmup, *shape))


def schedule_warnings(cfg: TrainingConfig, total_steps: int) -> list[str]:
    """Legal settings that rarely mean what they say, each as one line."""
    warnings = []
    warmup = warmup_steps(cfg, total_steps)
    if warmup > total_steps:
        last = lr_factor(total_steps - 1, total_steps, warmup, cfg.lr_scheduler_type, cfg.warmup_from_zero)
        peak = cfg.learning_rate * last
        warnings.append(
            f"training.warmup_steps (or warmup_ratio) gives {warmup} warmup steps, more than the run's "
            f"{total_steps}: the learning rate never reaches its peak {cfg.learning_rate:g} (it stops at {peak:.3g})"
        )
    return warnings
