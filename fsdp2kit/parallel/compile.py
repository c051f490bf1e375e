"""`compile_modules`: torch.compile on each decoder block's forward (torchtitan's per-block compile).

Compiling blocks one by one keeps graphs small and identical (one compilation serves every layer) and leaves FSDP's
hooks, which sit on `__call__`, outside the graphs, so all-gathers and reduce-scatters run as in eager mode. The order
is torchtitan's: recompute wraps the forward first, compile wraps that, then `fully_shard`. Only `forward` is
replaced, so parameter names and checkpoints are the same with and without compile."""

from __future__ import annotations

import torch
import torch.nn as nn


def compile_modules(model: nn.Module, module_names: list[str]) -> None:
    for name in module_names:
        module = model.get_submodule(name)
        module.forward = torch.compile(module.forward)
