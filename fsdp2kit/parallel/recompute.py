"""`apply_recompute`: activation checkpointing on exactly the planned modules.

The module's own `forward` is replaced in place (`replace_forward`: names and checkpoints unchanged). FSDP's hooks
sit on `__call__`, outside the checkpointed region, so parameters are all-gathered again by FSDP's pre-backward
hook before the recomputation runs."""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from fsdp2kit.parallel.forward_patch import Forward, replace_forward


def apply_recompute(model: nn.Module, module_names: list[str], use_reentrant: bool) -> None:
    def recompute(module: nn.Module, forward: Forward) -> Forward:
        def recomputed(*args: Any, **kwargs: Any) -> Any:
            if use_reentrant:
                # The reentrant implementation takes positional tensors only; bind the keywords.
                return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=True)
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)

        return recomputed

    replace_forward(model, module_names, recompute)
