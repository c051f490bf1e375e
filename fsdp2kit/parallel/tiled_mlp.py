"""`apply_tiled_mlp`: TiledMLP. Each planned MLP runs over `num_shards` tiles of its tokens and keeps only its input
for backward; backward recomputes the MLP tile by tile and hands autograd each parameter's gradient once, summed
over the tiles. The MLP's intermediate activations (gate, up, activation, product: several times the hidden size
per token) then exist for one tile at a time instead of for the whole sequence.

Like `apply_recompute`, the module's `forward` is replaced in place, so parameter names and checkpoints do not
change. An MLP's parameters belong to the shard group of its decoder layer, whose FSDP hooks sit outside this
forward: they are all-gathered when the layer's forward starts and again when its backward starts, so both the
tiles of the forward and their recomputation in backward see the full, unsharded parameters."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from fsdp2kit.parallel.forward_patch import Forward, replace_forward


class _TiledMLP(torch.autograd.Function):
    """out = mlp(hidden_states), computed tile by tile. Autograd runs `forward` without building a graph, so nothing
    inside the MLP is saved; the parameters are inputs only so that their gradients flow back through `backward`."""

    @staticmethod
    def forward(
        ctx: Any,
        mlp: nn.Module,
        mlp_forward: Callable[[torch.Tensor], torch.Tensor],
        num_shards: int,
        hidden_states: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:
        ctx.mlp, ctx.mlp_forward, ctx.num_shards = mlp, mlp_forward, num_shards
        ctx.save_for_backward(hidden_states)
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])  # an MLP acts on each token alone
        out = torch.cat([mlp_forward(tile) for tile in tokens.chunk(num_shards)])
        return out.view(*hidden_states.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (hidden_states,) = ctx.saved_tensors
        # The parameters the recomputation uses: under FSDP, the unsharded ones its hooks have just all-gathered
        # (the same tensors that were passed to forward).
        params = list(ctx.mlp.parameters())
        trainable = [p for p, needed in zip(params, ctx.needs_input_grad[4:], strict=True) if needed]
        input_needed = ctx.needs_input_grad[3]
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        grad_tokens = grad_output.reshape(-1, grad_output.shape[-1])
        grad_input = torch.empty_like(tokens) if input_needed else None
        param_grads: list[torch.Tensor | None] = [None] * len(trainable)
        start = 0
        for tile, grad_tile in zip(tokens.chunk(ctx.num_shards), grad_tokens.chunk(ctx.num_shards), strict=True):
            tile = tile.detach().requires_grad_(input_needed)
            with torch.enable_grad():
                out = ctx.mlp_forward(tile)
            grads = torch.autograd.grad(out, ([tile] if input_needed else []) + trainable, grad_tile, allow_unused=True)
            if grad_input is not None:
                grad_input[start : start + len(tile)] = grads[0]
                grads = grads[1:]
            for i, grad in enumerate(grads):
                if grad is not None:
                    summed_so_far = param_grads[i]
                    param_grads[i] = grad if summed_so_far is None else summed_so_far.add_(grad)
            start += len(tile)
        summed = iter(param_grads)
        return (
            None,
            None,
            None,
            grad_input.view_as(hidden_states) if grad_input is not None else None,
            *(next(summed) if needed else None for needed in ctx.needs_input_grad[4:]),
        )


def apply_tiled_mlp(model: nn.Module, module_names: list[str], num_shards: int) -> None:
    def tile(mlp: nn.Module, forward: Forward) -> Forward:
        def tiled(hidden_states: torch.Tensor) -> torch.Tensor:
            return _TiledMLP.apply(mlp, forward, num_shards, hidden_states, *mlp.parameters())

        return tiled

    replace_forward(model, module_names, tile)
