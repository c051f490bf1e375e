"""Log-probs, entropies and the loss of an LM head split by vocabulary over the tensor-parallel ranks: each rank
computes its shard's logits for a chunk of tokens and the ranks combine their maxima, their sums of exponentials and
the target's logit in all-reduces over the tp group, so no rank ever holds a token's whole logits; backward sums the
hidden states' gradient over the ranks. What the model does to its logits after the head (a scale, a soft-cap) and a
sampling temperature act on each logit alone, so each shard applies them to its own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Shard

from fsdp2kit.labels import IGNORE_INDEX

# (hidden, weight, bias, temperature) -> (float32 logits after the head's steps and the temperature, their slope)
LogitsOf = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None],
    tuple[torch.Tensor, torch.Tensor | float | None],
]


@dataclass(frozen=True)
class VocabShard:
    """This rank's rows of a vocabulary-split head (as autograd leaves of the DTensor parameters) and where they
    start in the vocabulary."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    group: ProcessGroup
    start: int


def vocab_shard(weight: torch.Tensor, bias: torch.Tensor | None) -> VocabShard | None:
    """The rank's shard of a head whose weight is split by vocabulary over a tp mesh (None: a whole head)."""
    if not isinstance(weight, DTensor):
        return None
    mesh = weight.device_mesh
    rows = -(-weight.shape[0] // mesh.size())  # Shard(0)'s rows per rank, torch.chunk's: the last rank may have fewer
    local_bias = bias.to_local() if isinstance(bias, DTensor) else bias
    start = min(mesh.get_local_rank() * rows, weight.shape[0])
    return VocabShard(weight.to_local(), local_bias, mesh.get_group(), start)


def gathered_logits(hidden: torch.Tensor, weight: DTensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The head's whole logits (what the model returns without a log-prob request): each rank's shard, gathered."""
    shard = cast(VocabShard, vocab_shard(weight, bias))
    local = F.linear(hidden, shard.weight, shard.bias)
    return DTensor.from_local(local, weight.device_mesh, [Shard(local.dim() - 1)], run_check=False).full_tensor()


class VocabShardLogProbs(torch.autograd.Function):
    """log p(target) of one chunk of tokens, and with `entropy` each token's entropy (else an empty tensor), from
    this rank's vocabulary shard of the head. Backward recomputes the shard's logits and sums the hidden states'
    gradient over the group; the shard's weight gradient stays its own."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: torch.Tensor | None,
        logits_of: LogitsOf,
        entropy: bool,
        group: ProcessGroup,
        start: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = logits_of(hidden, weight, bias, temperature)
        top = logits.max(-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        exp_sums = (logits - top.unsqueeze(-1)).exp().sum(-1)
        dist.all_reduce(exp_sums, group=group)
        normaliser = top + exp_sums.log()
        local, mine = _local_targets(targets, start, logits.shape[-1])
        picked = logits.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        expected = (torch.exp(logits - normaliser.unsqueeze(-1)) * logits).sum(-1) if entropy else picked[:0]
        summed = torch.cat([picked, expected])  # one all-reduce for both
        dist.all_reduce(summed, group=group)
        picked, expected = summed[: picked.numel()], summed[picked.numel() :]
        entropies = normaliser - expected if entropy else logits.new_empty(0)
        log_probs = (picked - normaliser).masked_fill(targets == IGNORE_INDEX, 0.0)
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser, temperature, entropies)
        ctx.logits_of, ctx.entropy, ctx.group, ctx.start = logits_of, entropy, group, start
        return log_probs, entropies

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser, temperature, entropies = ctx.saved_tensors
        grad = grad.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        grad_logits, slope = ctx.logits_of(hidden, weight, bias, temperature)
        grad_logits.sub_(normaliser.unsqueeze(-1))  # log p of this shard's tokens
        softmax_gradient_(grad_logits, grad, grad_entropy if ctx.entropy else None, entropies)
        local, mine = _local_targets(targets, ctx.start, grad_logits.shape[-1])
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), grad.masked_fill(~mine, 0.0).unsqueeze(-1))  # + one-hot
        if slope is not None:
            grad_logits.mul_(slope)
        grad_logits = grad_logits.to(hidden.dtype)
        grad_hidden = grad_logits @ weight
        dist.all_reduce(grad_hidden, group=ctx.group)
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def softmax_gradient_(
    log_p: torch.Tensor, grad: torch.Tensor, grad_entropy: torch.Tensor | None, entropies: torch.Tensor
) -> None:
    """log p [tokens, vocab] turned in place into the gradient of the logits, but for the target's one-hot term:
    -g_lp x p, and with an entropy's gradient g_H also -g_H x p x (log p + H)."""
    if grad_entropy is None:
        log_p.exp_().mul_(-grad.unsqueeze(-1))  # -grad x softmax
        return
    probs = log_p.exp()
    log_p.add_(entropies.unsqueeze(-1)).mul_(grad_entropy.float().unsqueeze(-1))  # g_H x (log p + H)
    log_p.add_(grad.unsqueeze(-1)).mul_(probs).neg_()  # -p x (g_lp + g_H x (log p + H))


def _local_targets(targets: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each target's index in this shard (clamped where another shard holds it) and whether this shard holds it."""
    local = targets - start
    mine = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), mine
