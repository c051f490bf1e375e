"""Replacing a module's `forward` in place, the way recompute and TiledMLP change how a module runs. No wrapper
module is inserted, so parameter names, state-dict keys and checkpoints are the same with and without the change,
and FSDP's hooks, which sit on `__call__`, stay outside the new forward."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch.nn as nn

Forward = Callable[..., object]


def replace_forward(model: nn.Module, module_names: list[str], make: Callable[[nn.Module, Forward], Forward]) -> None:
    """Each named module's forward becomes `make(module, its_original_forward)`."""
    for name in module_names:
        module = model.get_submodule(name)
        original = module.forward
        module.forward = functools.wraps(original)(make(module, original))
