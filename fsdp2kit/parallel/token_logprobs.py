"""Per-token log-probabilities (and entropies) straight from the LM head, in chunks of tokens, so that no
[B, T, vocab] float32 tensor ever exists: for a 152k vocabulary at T=4096 that tensor alone is 2.5 GB per sample.

The head's forward is replaced in place (`replace_forward`), so it runs inside the model's forward where FSDP has
its weight gathered, and its hooks, names and checkpoints are unchanged. While a `TokenRequest` is set on the head,
the head returns the log-probabilities of the requested target tokens instead of logits; each chunk is recomputed
in backward (activation checkpointing), so backward holds one chunk's logits at a time too."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.forward_patch import Forward, replace_forward

_REQUEST = "_fsdp2kit_token_request"


@dataclass
class TokenRequest:
    """What the head computes on its next call: log p(targets) per position (IGNORE_INDEX targets give 0)."""

    targets: torch.Tensor  # [B, T] int64, aligned with the head's input positions
    chunk_tokens: int  # tokens per chunk; 0 = all at once
    entropy: bool = False
    entropies: torch.Tensor | None = None  # [B, T] float32, filled when `entropy`


def head_name(model: nn.Module) -> str:
    """The module path of the model's output embeddings (the LM head)."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    return next(name for name, module in model.named_modules() if module is head)


def install_token_head(model: nn.Module) -> None:
    """Let the LM head answer `TokenRequest`s; without one it computes logits as before."""
    replace_forward(model, [head_name(model)], _token_forward)


def _token_forward(head: nn.Module, original: Forward) -> Forward:
    def forward(hidden: torch.Tensor) -> object:
        request: TokenRequest | None = getattr(head, _REQUEST, None)
        if request is None:
            return original(hidden)
        return _chunked(hidden, cast(torch.Tensor, head.weight), getattr(head, "bias", None), request)

    return forward


def _chunk(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = F.linear(hidden, weight, bias).float()
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    log_probs = (picked - normaliser).masked_fill(targets == IGNORE_INDEX, 0.0)
    if not entropy:
        return log_probs, log_probs.new_zeros(())
    probs = torch.softmax(logits, dim=-1)
    return log_probs, normaliser - (probs * logits).sum(-1)


def _chunked(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, request: TokenRequest
) -> torch.Tensor:
    """Log-probs [B, T] float32 of `request.targets`, chunk by chunk over the flattened tokens."""
    batch, length = hidden.shape[:2]
    flat_hidden, flat_targets = hidden.reshape(batch * length, -1), request.targets.reshape(-1)
    step = request.chunk_tokens or flat_targets.numel()
    log_probs, entropies = [], []
    for start in range(0, flat_targets.numel(), max(1, step)):
        part = slice(start, start + step)
        args = (flat_hidden[part], weight, bias, flat_targets[part], request.entropy)
        if torch.is_grad_enabled():  # backward recomputes each chunk's logits instead of keeping them all
            lp, ent = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _chunk(*args)
        log_probs.append(lp)
        entropies.append(ent)
    if request.entropy:
        request.entropies = torch.cat(entropies).reshape(batch, length)
    return torch.cat(log_probs).reshape(batch, length).clone()  # its own storage: FSDP hooks a view badly


@contextmanager
def token_request(model: nn.Module, request: TokenRequest) -> Iterator[TokenRequest]:
    """Within the block, the model's forward returns `request`'s log-probs as its `logits`."""
    head = model.get_output_embeddings()  # type: ignore[operator]
    setattr(head, _REQUEST, request)
    try:
        yield request
    finally:
        setattr(head, _REQUEST, None)


def chunk_tokens(setting: int | str, vocab_size: int) -> int:
    """`training.loss_chunk_tokens`: `auto` chunks (by 1024 tokens) above a 32k vocabulary, where the logits start
    to dominate a step's memory; 0 computes the whole sequence at once."""
    if setting == "auto":
        return 1024 if vocab_size > 32768 else 0
    return int(setting)
