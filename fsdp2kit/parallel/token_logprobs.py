"""Per-token log-probabilities (and entropies) straight from the LM head, in chunks of tokens, so that no
[B, T, vocab] float32 tensor ever exists: for a 152k vocabulary at T=4096 that tensor alone is 2.5 GB per sample.

The head's forward is replaced in place (`replace_forward`), so it runs inside the model's forward where FSDP has
its weight gathered, and its hooks, names and checkpoints are unchanged. While a `TokenRequest` is set on the head,
the head returns the log-probabilities of the requested target tokens instead of logits; each chunk's logits are
recomputed in backward and turned into their own gradient in place, so backward holds one chunk's logits at a time
too. Entropies are computed without autograd (`forward_step`)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.forward_patch import Forward, replace_forward
from fsdp2kit.parallel.linear_cross_entropy import budget_chunk_tokens, linear_cross_entropy

_REQUEST = "_fsdp2kit_token_request"
_SOFTCAP = "_fsdp2kit_logit_softcap"


@dataclass
class TokenRequest:
    """What the head computes on its next call: log p(targets) per position (IGNORE_INDEX targets give 0)."""

    targets: torch.Tensor  # [B, T] int64, aligned with the head's input positions
    chunk_tokens: int  # tokens per chunk; 0 = all at once
    entropy: bool = False
    entropies: torch.Tensor | None = None  # [B, T] float32, filled when `entropy`
    summed: bool = False  # return the summed cross-entropy -sum(log p) instead (the training loss)


def head_name(model: nn.Module) -> str:
    """The module path of the model's output embeddings (the LM head)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    return next(name for name, module in model.named_modules() if module is head)


def install_token_head(model: nn.Module) -> None:
    """Let the LM head answer `TokenRequest`s; without one it computes logits as before. A model that soft-caps its
    logits after the head (Gemma's final_logit_softcapping) gets the same cap in the chunks."""
    name = head_name(model)
    setattr(model.get_submodule(name), _SOFTCAP, getattr(_softcap_config(model), "final_logit_softcapping", None))
    replace_forward(model, [name], _token_forward)


def _token_forward(head: nn.Module, original: Forward) -> Forward:
    def forward(hidden: torch.Tensor) -> object:
        request: TokenRequest | None = getattr(head, _REQUEST, None)
        if request is None:
            return original(hidden)
        weight, bias = cast(torch.Tensor, head.weight), getattr(head, "bias", None)
        return _chunked(hidden, weight, bias, request, getattr(head, _SOFTCAP, None))

    return forward


def _logits(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A chunk's float32 logits, soft-capped as the model caps them (Gemma's final_logit_softcapping: cap x
    tanh(z / cap)), and the cap's derivative (None without one), which their gradient is multiplied by."""
    logits = F.linear(hidden, weight, bias).float()
    if not softcap:
        return logits, None
    squashed = torch.tanh(logits / softcap)
    return squashed * softcap, 1 - squashed.square()


class _ChunkLogProbs(torch.autograd.Function):
    """log p(target) of one chunk of tokens. Backward recomputes the chunk's logits once and turns them into their
    gradient in place (softmax, scaled, minus the target's one-hot), so it holds one [chunk, vocab] float32 tensor
    where autograd's log-softmax and gather would hold four or five."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        softcap: float | None,
    ) -> torch.Tensor:
        logits, _ = _logits(hidden, weight, bias, softcap)
        normaliser = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(hidden, weight, bias, targets, normaliser)
        ctx.softcap = softcap
        return (picked - normaliser).masked_fill(targets == IGNORE_INDEX, 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, normaliser = ctx.saved_tensors
        grad = grad.float().masked_fill(targets == IGNORE_INDEX, 0.0)
        grad_logits, slope = _logits(hidden, weight, bias, ctx.softcap)
        grad_logits.sub_(normaliser.unsqueeze(-1)).exp_().mul_(-grad.unsqueeze(-1))  # -grad x softmax
        grad_logits.scatter_add_(-1, targets.clamp(min=0).unsqueeze(-1), grad.unsqueeze(-1))  # + grad x one-hot
        if slope is not None:
            grad_logits.mul_(slope)
        grad_logits = grad_logits.to(hidden.dtype)
        grad_bias = grad_logits.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        grad_weight = grad_logits.t() @ hidden if ctx.needs_input_grad[1] else None
        return grad_logits @ weight, grad_weight, grad_bias, None, None


def _chunk_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, softcap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of one chunk, without autograd (forward_step)."""
    logits, _ = _logits(hidden, weight, bias, softcap)
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = (picked - normaliser).masked_fill(targets == IGNORE_INDEX, 0.0)
    expected_logit = (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return log_probs, normaliser - expected_logit


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, request: TokenRequest, softcap: float | None
) -> torch.Tensor:
    """Log-probs [B, T] float32 of `request.targets` (or their negated sum), chunk by chunk over the tokens."""
    batch, length = hidden.shape[:2]
    flat_hidden, flat_targets = hidden.reshape(batch * length, -1), request.targets.reshape(-1)
    step = max(1, request.chunk_tokens or flat_targets.numel())
    if request.summed:
        logits_of = partial(_logits, weight=weight, bias=bias, softcap=softcap)
        return linear_cross_entropy(flat_hidden, weight, bias, flat_targets, step, logits_of)
    log_probs, entropies = [], []
    for start in range(0, flat_targets.numel(), step):
        args = (flat_hidden[start : start + step], weight, bias, flat_targets[start : start + step], softcap)
        if request.entropy:
            with torch.no_grad():
                lp, entropy = _chunk_entropy(*args)
            entropies.append(entropy)
        else:
            lp = _ChunkLogProbs.apply(*args)
        log_probs.append(lp)
    if request.entropy:
        request.entropies = torch.cat(entropies).reshape(batch, length)
    return torch.cat(log_probs).reshape(batch, length).clone()  # its own storage: FSDP hooks a view badly


@contextmanager
def token_request(model: nn.Module, request: TokenRequest) -> Iterator[TokenRequest]:
    """Within the block, the model's forward returns `request`'s log-probs as its `logits`. A soft-capping model's
    own cap after the head is switched off meanwhile: the chunks apply it, and it must not squash their result."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    capping = _softcap_config(model)
    cap = getattr(capping, "final_logit_softcapping", None)
    setattr(head, _REQUEST, request)
    if cap is not None:
        capping.final_logit_softcapping = None
    try:
        yield request
    finally:
        setattr(head, _REQUEST, None)
        if cap is not None:
            capping.final_logit_softcapping = cap


def _softcap_config(model: nn.Module) -> Any:
    """The config a model reads final_logit_softcapping from (a VL model's text config)."""
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def chunk_tokens(setting: int | str, vocab_size: int) -> int:
    """`training.loss_chunk_tokens`: `auto` chunks (by 1024 tokens) above a 32k vocabulary, where the logits start
    to dominate a step's memory; 0 computes the whole sequence at once."""
    if setting == "auto":
        return budget_chunk_tokens(vocab_size) if vocab_size > 32768 else 0
    return int(setting)
