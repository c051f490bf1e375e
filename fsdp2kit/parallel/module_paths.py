"""Finding a model's modules by class name, as the wrap policies and the expert rules name them."""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from fsdp2kit.errors import UserError


def model_class_name(model: nn.Module) -> str:
    """A module's own class name: fully_shard swaps a sharded module's class for an `FSDP<Class>` subclass of it."""
    return next(c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def modules_of_classes(model: nn.Module, class_names: list[str], key: str) -> list[str]:
    found: list[str] = []
    for class_name in class_names:
        hits = [n for n, m in model.named_modules() if n and type(m).__name__ == class_name]
        if not hits:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(f"{key}: class '{class_name}' matches no module of the model; its classes are {present}")
        found.extend(hits)
    order = [n for n, _ in model.named_modules()]
    return sorted(set(found), key=order.index)
