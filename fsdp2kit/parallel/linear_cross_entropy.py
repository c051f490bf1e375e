"""The training loss straight from the LM head: -sum(log p(target)) over the target tokens, with its gradients
computed during the forward pass, chunk by chunk, as fused linear cross-entropy kernels do. The gradient of a sum
reaches every token with the same factor, so backward only scales what the forward computed: the head's matmuls run
as often as without chunking (no recompute), and no [tokens, vocab] float32 tensor exists beyond one chunk's.

What keeps it as fast as the unchunked loss: chunks are sized by memory (`LOGITS_BUDGET_BYTES` of float32 logits a
chunk), not by a fixed token count, so a step has few of them; the weight's gradient is accumulated in place in the
weight's own dtype (`addmm_` into one buffer: exact for float32 weights, one rounding a chunk for bf16 ones, as a
bf16 matmul rounds anyway) instead of a float32 copy per chunk; backward scales the buffers in place; and a forward
without autograd (evaluation) computes no gradients at all.

On CUDA, where liger-kernel is installed (`pip install fsdp2kit[cuda]`), its fused linear cross-entropy computes the
same thing with one Triton kernel a chunk for the softmax, loss and gradient (where the chunks here make five passes
over a chunk's logits), for heads whose logits go through at most a soft-cap (`Cap`); elsewhere, and on a CPU, the
chunks here run."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.autograd.function import once_differentiable

from fsdp2kit.labels import IGNORE_INDEX

# A chunk's float32 logits take at most this much (1 GiB: 2048 tokens of a 128k vocabulary); a chunk's other
# transients (its gradient in the compute dtype) take about half as much again.
LOGITS_BUDGET_BYTES = 1 << 30

# A chunk's float32 logits and the factor their gradient is multiplied by (None: 1), for a chunk of hidden states:
# the head, and what the model does to its logits after it (scale, soft-cap).
ChunkLogits = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | float | None]]


@dataclass(frozen=True)
class Cap:
    """The head's logits go through at most a soft-cap (cap x tanh(z / cap); None: nothing), which a fused kernel can
    apply. A head whose logits are scaled has no Cap: only the chunks here reproduce it."""

    softcap: float | None = None


def budget_chunk_tokens(vocab_size: int, budget_bytes: int = LOGITS_BUDGET_BYTES) -> int:
    """Tokens a chunk of a `vocab_size` head may hold within `budget_bytes` of float32 logits, rounded down to a
    multiple of 256 (matmul-friendly) where the budget allows that many."""
    tokens = budget_bytes // (4 * vocab_size)
    return tokens // 256 * 256 if tokens >= 256 else max(1, tokens)


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    chunk: int,
    logits_of: ChunkLogits,
    cap: Cap | None = None,
) -> torch.Tensor:
    """-sum(log p(targets)) of the flat hidden states [N, H] (IGNORE_INDEX targets count nothing, and the head runs
    on the targeted tokens alone), float32, `chunk` tokens at a time; with autograd on, its gradients come from the
    same pass (liger's kernel where `cap` allows)."""
    targeted = _targeted_rows(targets)
    if targeted is not None:  # prompts and padding need no logits (as TRL's fused head skips them)
        hidden, targets = hidden.index_select(0, targeted), targets.index_select(0, targeted)  # their gradient: 0
    gradients = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not gradients:
        return _LinearCrossEntropy.forward(None, hidden, weight, bias, targets, chunk, logits_of)
    fused = _liger_kernel() if hidden.is_cuda and hidden.dtype == weight.dtype else None
    if fused is not None and cap is not None:
        loss = fused(
            hidden, weight, targets, bias=bias, ignore_index=IGNORE_INDEX, reduction="sum", softcap=cap.softcap
        )
        return loss.float()
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, chunk, logits_of)


def _targeted_rows(targets: torch.Tensor) -> torch.Tensor | None:
    """The rows whose target is not IGNORE_INDEX where they are some but not all; else None (every row). On the CPU
    only: on CUDA their count is a host read that waits for the device, once per micro-batch, where the step makes
    one (docs/PERFORMANCE.md, "Host reads in the step"); not measured there yet. Also None where shapes cannot depend
    on values: under torch.compile (one graph) and on fake or meta tensors (`plan` traces the step on fake ones:
    every row counted, an upper bound of the head's memory)."""
    if targets.device.type != "cpu" or torch.compiler.is_compiling() or is_fake(targets):
        return None
    targeted = (targets != IGNORE_INDEX).nonzero().squeeze(1)
    return targeted if 0 < targeted.numel() < targets.numel() else None


@cache
def _liger_kernel() -> Callable | None:
    """liger-kernel's fused linear cross-entropy, where the package is installed (the `cuda` extra)."""
    if importlib.util.find_spec("liger_kernel") is None:
        return None
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy


class _LinearCrossEntropy(torch.autograd.Function):
    """See the module docstring. Forward with `ctx` None computes the loss alone."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        chunk: int,
        logits_of: ChunkLogits,
    ) -> torch.Tensor:
        wanted = ctx.needs_input_grad[:3] if ctx is not None else (False, False, False)
        grad_hidden = torch.empty_like(hidden) if wanted[0] else None
        grad_weight = torch.empty_like(weight) if wanted[1] else None
        grad_bias = torch.zeros_like(bias) if bias is not None and wanted[2] else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Chunks of even size: a small last one would run the CPU's matrix-vector kernels, several times less exact
        count = targets.numel()
        chunk = -(-count // -(-count // chunk)) if count else chunk
        for start in range(0, count, chunk):
            rows = slice(start, start + chunk)
            part, part_targets = hidden[rows], targets[rows]
            keep = (part_targets != IGNORE_INDEX).unsqueeze(-1)
            index = part_targets.clamp(min=0).unsqueeze(-1)
            logits, slope = logits_of(part)
            normaliser = torch.logsumexp(logits, dim=-1, keepdim=True)
            # Out of place: torch 2.11's dynamo loses the gradient of an output built by `+=` (it was zero).
            total = total + ((normaliser - logits.gather(-1, index)) * keep).sum()
            if not any(wanted):
                continue
            grad = logits.sub_(normaliser).exp_().scatter_add_(-1, index, -torch.ones_like(normaliser))
            grad = grad.mul_(keep if slope is None else keep * slope).to(weight.dtype)  # softmax - one-hot
            if grad_hidden is not None:
                torch.mm(grad, weight, out=grad_hidden[rows])
            if grad_weight is not None:  # in place, in the weight's dtype: no float32 copy of [vocab, hidden]
                _accumulate(grad_weight, grad.t(), part, first=start == 0)
            if grad_bias is not None:
                grad_bias += grad.sum(0)
        if ctx is not None:
            ctx.save_for_backward(grad_hidden, grad_weight, grad_bias)
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # In place: each buffer is this function's own and backward runs once (once_differentiable).
        scaled = tuple(None if t is None else t.mul_(grad) for t in ctx.saved_tensors)
        return (*scaled, None, None, None)


def _accumulate(out: torch.Tensor, left: torch.Tensor, right: torch.Tensor, first: bool) -> None:
    """out = left @ right on the first chunk, out += left @ right after it, without a temporary product."""
    if first:
        torch.mm(left, right, out=out)
    else:
        out.addmm_(left, right)
