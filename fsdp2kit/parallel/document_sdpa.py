"""Packed documents through sdpa's fused causal kernel one document at a time (the CPU's path, `data.document_mask`).

transformers attends packed rows under sdpa through a dense [B, 1, T, T] document mask: the CPU kernel then computes
every block of the row, the masked ones too, and none of its causal skipping applies. `DOCUMENT_SDPA` keeps
transformers' mask (so what is attended is decided exactly as before) and reads it once a micro-batch: where it is
block-diagonal causal (each query sees its own document up to itself, nothing else), each document goes through
sdpa alone, causal, without a mask; consecutive short documents share a call of at most TILE_TOKENS under a small
mask of their own (a call per 4-token document would cost more than the blocks it skips). Anything else (a sliding
window that cuts a document, padding, a bias, dropout, shapes traced by `plan`, a layer being compiled) takes
transformers' sdpa with the dense mask unchanged.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

DOCUMENT_SDPA = "document_sdpa"
# The longest call that merges documents: a 12.6M Llama's training step against the dense mask at T = 256 (4 rows)
# 0.93-0.95x with documents of 4 to 64 tokens (0.94-0.96x at 128), at T = 2048 0.49-0.66x (one call per document:
# 1.20x at 4 tokens, 1.05x at 8).
TILE_TOKENS = 64
_QUERY_CHUNK = 512  # rows of the mask checked at a time: the check's temporaries stay [B, 512, T]


class Tile(NamedTuple):
    """One call of the fused kernel: the row's tokens [start, end), causal, or under `mask` where it holds several
    documents."""

    start: int
    end: int
    mask: torch.Tensor | None


def use_document_sdpa(model: Any, sub_config: str | None) -> None:
    """Switch the model's attention (or its `sub_config` part's) to DOCUMENT_SDPA."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_SDPA, document_sdpa_attention)
    AttentionMaskInterface.register(DOCUMENT_SDPA, document_sdpa_mask)
    model.set_attn_implementation({sub_config: DOCUMENT_SDPA} if sub_config else DOCUMENT_SDPA)


def document_sdpa_mask(*args: Any, **kwargs: Any) -> Any:
    """transformers' own sdpa mask, with its documents (`document_spans`) on it where it is theirs alone."""
    from transformers.masking_utils import sdpa_mask

    mask = sdpa_mask(*args, **kwargs)
    if isinstance(mask, torch.Tensor):
        spans = document_spans(mask)
        if spans is not None:
            mask.document_spans = spans  # type: ignore[attr-defined]  # read by each layer's attention
    return mask


def document_spans(mask: torch.Tensor) -> list[list[Tile]] | None:
    """Each row's tiles (`tiles`) where the boolean [B, 1, T, T] `mask` is exactly block-diagonal causal; None where
    it is any other mask, or traced."""
    if is_fake(mask) or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] != 1:
        return None
    rows = mask[:, 0]
    length = rows.shape[-1]
    if rows.shape[1] != length or torch.compiler.is_compiling():
        return None
    keys = torch.arange(length, device=mask.device)
    firsts = []
    for start in range(0, length, _QUERY_CHUNK):
        block = rows[:, start : start + _QUERY_CHUNK]
        first = block.to(torch.uint8).argmax(-1)  # the first key each query sees
        queries = keys[start : start + block.shape[1], None]
        if not torch.equal(block, (keys >= first[..., None]) & (keys <= queries)):
            return None
        firsts.append(first)
    first = torch.cat(firsts, 1)
    starts = first == keys  # a document begins where a query's first key is itself
    # each query's first key: its own, or its predecessor's (one document continues)
    if not bool((starts[:, 1:] | (first[:, 1:] == first[:, :-1])).all()):
        return None
    return [tiles(torch.nonzero(row).flatten().tolist() + [length], mask.device) for row in starts]


def tiles(bounds: list[int], device: torch.device) -> list[Tile]:
    """A row's documents (`bounds`: each one's first index, then the row's length) as the calls that attend them:
    consecutive documents merged while they fit in TILE_TOKENS, a tile of one document causal without a mask, one of
    several with its own small block-diagonal causal mask."""
    groups: list[list[int]] = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if groups and end - groups[-1][0] <= TILE_TOKENS:
            groups[-1].append(end)
        else:
            groups.append([start, end])
    result = []
    for group in groups:
        start, end = group[0], group[-1]
        mask = None
        if len(group) > 2:
            lengths = torch.tensor([b - a for a, b in zip(group[:-1], group[1:], strict=True)], device=device)
            document = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
            index = torch.arange(end - start, device=device)
            mask = ((index[:, None] >= index) & (document[:, None] == document))[None, None]
        result.append(Tile(start, end, mask))
    return result


def document_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [B, H, T, D], key/value [B, H_kv, T, D] in, [B, T, H, D] out; by
    document where the mask carries its spans, else transformers' sdpa with the mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    spans = getattr(attention_mask, "document_spans", None)
    unsupported = dropout or any(kwargs.get(name) is not None for name in ("softcap", "position_bias", "s_aux"))
    if spans is None or unsupported or torch.compiler.is_compiling():
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    rows = []
    for row, documents in enumerate(spans):
        parts = [
            torch.nn.functional.scaled_dot_product_attention(
                query[row : row + 1, :, start:end],
                key[row : row + 1, :, start:end],
                value[row : row + 1, :, start:end],
                attn_mask=mask,
                is_causal=mask is None,
                scale=scaling,
                enable_gqa=key.shape[1] != query.shape[1],
            )
            for start, end, mask in documents
        ]
        rows.append(torch.cat(parts, 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None
