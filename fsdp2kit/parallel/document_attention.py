"""Attention over packed documents without a dense mask (`data.document_mask`).

Packed windows restart their position ids at each document. Under sdpa or eager, transformers turns that into a
dense [batch, 1, T, T] mask, which keeps SDPA off its fast kernels (the issue-31 H100 run lost 8-10% at T = 2048).
`DOCUMENT_FLEX` is a transformers attention implementation on torch's FlexAttention instead: transformers composes
the same mask *function* it would have expanded (causal, the documents it finds in the position ids, padding, a
sliding window) and hands it to `document_block_mask`, which makes a BlockMask of it — per 128 x 128 block: skipped,
full or partial — so attention computes only the blocks inside documents and no [T, T] tensor exists.

On CUDA the block mask and the attention are compiled (Triton kernels). On a CPU they run eagerly and forward only
(torch has no CPU backward for FlexAttention), so a CPU run under sdpa attends document by document through the fused
kernel instead (parallel/document_sdpa.py); `document_path` decides, the build applies it, `check` prints it and
`plan` counts what it picks. Under Ulysses the same choice holds: the wrapper
(`parallel/ulysses.py`) runs DOCUMENT_FLEX over the gathered sequence with a block mask made from the whole
sequence's documents (`parallel/sequence_masks.py`). Under context parallel a rank's rows (its two chunks) over the
gathered keys need a mask with or without documents: on CUDA DOCUMENT_FLEX takes it too, as a block mask of those
rows (`_context_parallel_path`).
flash_attention_2 needs nothing: transformers runs it variable-length from the position ids.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any, cast

import torch

from fsdp2kit.config.schema import DataConfig, ModelConfig
from fsdp2kit.parallel.context_attention import has_attention_sinks
from fsdp2kit.parallel.document_sdpa import DOCUMENT_SDPA, TILE_TOKENS, use_document_sdpa
from fsdp2kit.transformers_compat import mask_interface_function

DOCUMENT_FLEX = "document_flex"


def document_path(
    requested: str,
    documents: bool,
    ulysses_size: int,
    device: torch.device,
    current: str,
    supports_flex: bool,
    context_parallel_size: int = 1,
) -> tuple[str | None, str | None]:
    """The attention implementation a run switches to for its packed documents (DOCUMENT_FLEX, DOCUMENT_SDPA or None:
    none), and how they are attended (None: no documents). `requested` is model.attn_implementation as written,
    `current` what the model resolved it to (sdpa where the build switched it to DOCUMENT_SDPA already)."""
    current = "sdpa" if current == DOCUMENT_SDPA else current
    if context_parallel_size > 1:
        return _context_parallel_path(requested, documents, device, current, supports_flex, context_parallel_size)
    if not documents:
        return None, None
    gathered = " over the gathered sequence (Ulysses)" if ulysses_size > 1 else ""
    flex = f"FlexAttention with a document block mask{gathered} (no [T, T] mask)"
    if DOCUMENT_FLEX in current:  # switched already: alone, or inside Ulysses' wrapper (ulysses_document_flex_...)
        return None, flex
    if current.startswith("flash_attention"):
        return None, f"{current}, variable-length from the position ids (no [T, T] mask)"
    dense = f"{current} with a dense [T, T] document mask{gathered}"
    if device.type != "cuda" and current == "sdpa" and ulysses_size == 1:
        by_documents = f"sdpa by documents (the fused causal kernel per document, short ones in {TILE_TOKENS}-token "
        return DOCUMENT_SDPA, by_documents + "tiles; the [T, T] document mask is read, not attended through)"
    if requested != "auto":
        return None, f"{dense} (model.attn_implementation: {requested}; auto picks FlexAttention on CUDA)"
    if not supports_flex:
        return None, f"{dense} (the family has no FlexAttention, or attention sinks)"
    if device.type != "cuda":
        return None, f"{dense} (FlexAttention has no backward on {device.type})"
    return DOCUMENT_FLEX, flex


def _context_parallel_path(
    requested: str, documents: bool, device: torch.device, current: str, supports_flex: bool, size: int
) -> tuple[str | None, str | None]:
    """`document_path` under context parallel, where each rank attends for its queries (two chunks of T/2c) over the
    gathered keys, a mask (causal by global index, documents, padding, a window) no kernel applies by itself, with or
    without documents. On CUDA FlexAttention takes it as a block mask of those rows (the kernel skips every block
    no query sees; no [T/c, T] tensor); a CPU's sdpa attends by blocks of its fused kernel within documents
    (parallel/context_attention.py); else the dense [T/c, T] mask."""
    flex = f"FlexAttention with a block mask of each rank's queries over the gathered keys (no [T/{size}, T] mask)"
    if DOCUMENT_FLEX in current:
        return None, flex
    if device.type == "cuda" and requested == "auto" and supports_flex:
        return DOCUMENT_FLEX, flex
    if not documents:
        return None, None
    if device.type != "cuda":
        if "sdpa" in current:
            blocks = "sdpa by blocks of the fused kernel within documents over the gathered keys"
            return None, f"{blocks} (no [T/{size}, T] mask)"
        why = f"FlexAttention has no backward on {device.type}"
    elif requested != "auto":
        why = f"model.attn_implementation: {requested}; auto picks FlexAttention on CUDA"
    else:
        why = "the family has no FlexAttention, or attention sinks"
    return None, f"{current} with a dense [T/{size}, T] document mask over the gathered keys ({why})"


def document_route(
    model: Any, cfg: ModelConfig, data: DataConfig, device: torch.device
) -> tuple[str | None, str | None]:
    """`document_path` for a built model: what its decoder's attention resolved to, and whether its family has
    FlexAttention that DOCUMENT_FLEX can run: not with attention sinks (GPT-OSS), which it refuses."""
    current = str(model.config.get_text_config()._attn_implementation)
    sinks = any(has_attention_sinks(module) for module in model.modules())
    supports_flex = bool(getattr(model, "_supports_flex_attn", False)) and not sinks
    documents = (data.pack and data.document_mask) or cfg.remove_padding  # the API's packed rows (train/packing.py)
    return document_path(
        cfg.attn_implementation, documents, cfg.ulysses_size, device, current, supports_flex, cfg.context_parallel_size
    )


def attend_documents(
    model: Any, cfg: ModelConfig, data: DataConfig, device: torch.device, sub_config: str | None
) -> bool:
    """The build's step (before Ulysses, which then wraps DOCUMENT_FLEX): switch to DOCUMENT_FLEX or DOCUMENT_SDPA
    where `document_path` says so; whether it switched to DOCUMENT_FLEX (whose batches carry a BlockMask)."""
    switch = document_route(model, cfg, data, device)[0]
    if switch == DOCUMENT_FLEX:
        use_document_attention(model, sub_config)
    elif switch == DOCUMENT_SDPA:
        use_document_sdpa(model, sub_config)
    return switch == DOCUMENT_FLEX


def use_document_attention(model: Any, sub_config: str | None) -> None:
    """Switch the model's attention (or its `sub_config` part's: a VL model's language model) to DOCUMENT_FLEX."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(DOCUMENT_FLEX, document_flex_attention)
    AttentionMaskInterface.register(DOCUMENT_FLEX, mask_interface_function(document_block_mask))
    model.set_attn_implementation({sub_config: DOCUMENT_FLEX} if sub_config else DOCUMENT_FLEX)


def document_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **_: Any,
) -> Any:
    """transformers' mask function (documents, causality, window) and its 2-D padding mask as a BlockMask."""
    from torch.nn.attention.flex_attention import create_block_mask
    from transformers.masking_utils import (
        add_offsets_to_mask_function,
        and_masks,
        causal_mask_function,
        padding_mask_function,
        prepare_padding_mask,
    )

    function = mask_function if mask_function is not None else causal_mask_function
    if attention_mask is not None and not bool(attention_mask.all()):
        padding = cast(torch.Tensor, prepare_padding_mask(attention_mask, kv_length, kv_offset))
        function = and_masks(function, padding_mask_function(padding))
    function = add_offsets_to_mask_function(function, q_offset, kv_offset)
    compiled = torch.device(device).type == "cuda"  # eager evaluates the whole [T, T] grid once: CPU tests only
    return create_block_mask(function, batch_size, None, q_length, kv_length, device=device, _compile=compiled)


def document_flex_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    softcap: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function: query [batch, heads, T, dim], key/value [batch, kv_heads, T, dim] in,
    [batch, T, heads, dim] out, through the BlockMask `document_block_mask` made. What FlexAttention cannot do here
    (dropout, attention sinks, position biases) is refused rather than ignored."""
    refused = [name for name in ("s_aux", "position_bias") if kwargs.get(name) is not None]
    if dropout:
        refused.append(f"attention dropout {dropout}")
    if refused or attention_mask is None:
        raise ValueError(
            f"{DOCUMENT_FLEX} attention of {type(module).__name__} cannot apply "
            f"{', '.join(refused) or 'a missing block mask'}; set model.attn_implementation: sdpa"
        )
    heads = query.shape[1]
    if heads & (heads - 1):  # FlexAttention's grouped-query kernels want a power-of-two head count
        repeats = heads // key.shape[1]
        key, value = (t.repeat_interleave(repeats, dim=1) for t in (key, value))

    def capped(score: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
        return softcap * torch.tanh(score / softcap)  # type: ignore[operator]

    output = _flex_attention(query.device.type)(
        query,
        key,
        value,
        score_mod=capped if softcap is not None else None,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=key.shape[1] != heads,
    )
    return output.transpose(1, 2).contiguous(), None


def _flex_attention(device_type: str) -> Callable:
    """torch's FlexAttention: compiled once on CUDA (inlined where the caller is being compiled already), eager
    elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    if device_type != "cuda" or torch.compiler.is_compiling():
        return flex_attention
    return _compiled_flex_attention()


@cache
def _compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # shapes that change (API batches) turn dynamic after one recompile
