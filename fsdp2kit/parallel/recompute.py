"""`apply_recompute`: activation checkpointing on exactly the planned modules.

The module's own `forward` is wrapped in place (no wrapper module), so parameter names, state-dict keys and
checkpoints are the same with and without recompute. FSDP's hooks sit on `__call__`, outside the checkpointed
region, so parameters are all-gathered again by FSDP's pre-backward hook before the recomputation runs."""

from __future__ import annotations

import functools

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def apply_recompute(model: nn.Module, module_names: list[str], use_reentrant: bool) -> None:
    for name in module_names:
        module = model.get_submodule(name)
        forward = module.forward

        @functools.wraps(forward)
        def recomputed(*args, _forward=forward, **kwargs):
            if use_reentrant:
                # The reentrant implementation takes positional tensors only; bind the keywords.
                return checkpoint(functools.partial(_forward, **kwargs), *args, use_reentrant=True)
            return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

        module.forward = recomputed
