"""The masks of sequence-parallel attention over the whole sequence (`model.ulysses_size`,
`model.context_parallel_size`): the model sees only its rank's slice and builds none, so they are made here from the
global position ids and padding, in each of the forms the attention takes (a mask function of global indices, a
dense mask made on demand, key ranges for the blocks of the fused kernel, a BlockMask for FlexAttention).

The wrapper (parallel/ulysses.py) applies causal attention over the gathered sequence, which is exact for
right-padded samples (padding comes after every real token, so no real token attends to it), narrowed to the layer's
sliding window if it has one. Packed documents need a block-diagonal mask over the whole sequence: `shard_sequence`
(parallel/sequence_layout.py) builds it from the global position ids and leaves it beside the group, where the
wrapper reads it: the model gets no `attention_mask`, which the rest of it (MoE's load-balancing loss) would read as
a [B, T] padding mask; left-padded samples (RL's prompts) get one too, with the padding masked out as keys. Where the
build picked FlexAttention for packed documents (parallel/document_attention.py: CUDA, model.attn_implementation
auto) the wrapper runs DOCUMENT_FLEX over the gathered sequence, and `shard_sequence` hands the same rule as a
BlockMask (skipped, full or partial 128 x 128 blocks): no [T, T] mask exists on that path. Under context parallel it
does so on CUDA with or without documents, through a block mask of the rank's rows that the wrapper makes from the
rule (`_FlexSequenceMask`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from fsdp2kit.parallel.context_attention import KeyRanges
from fsdp2kit.parallel.document_attention import document_block_mask


def _documents(positions: torch.Tensor) -> torch.Tensor | None:
    """Each token's document number [B, T] in rows packed by the caller's `positions`, by transformers' rule for
    packed samples: a new document starts wherever the position does not grow by one. None for one document a row."""
    documents = (torch.diff(positions, prepend=positions[:, :1] - 1) != 1).cumsum(-1)
    return documents if documents[:, -1].any() else None


def _left_padded(real: torch.Tensor | None) -> bool:
    """Whether any padding (`real` False) comes before a real token."""
    return real is not None and bool((~real[:, :-1] & real[:, 1:]).any())


def _sequence_mask_function(documents: torch.Tensor | None, real: torch.Tensor | None) -> Callable | None:
    """The mask over the whole sequence as a mask function (batch, head, query, key global indices -> True = attend;
    FlexAttention's form, and indexable with broadcast index tensors) where causal attention alone is not exact:
    packed `documents` (`_documents`), padding (`real` False) before a real token, masked out as keys. None
    otherwise. It is transformers' padding mask by global index, so a left-padding query has no key at all, as on
    one rank: its output is what the inner attention gives such a row (sdpa and FlexAttention 0, eager the mean of
    the values, `_full_sequence_mask`)."""
    left_padded = _left_padded(real)
    if documents is None and not left_padded:
        return None

    def attend(batch: torch.Tensor, head: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        allowed = key <= query
        if documents is not None:
            allowed = allowed & (documents[batch, query] == documents[batch, key])
        if left_padded:
            allowed = allowed & real[batch, key]  # type: ignore[index]
        return allowed

    return attend


def _dense_mask(attend: Callable, batch_size: int, queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The boolean [B, 1, queries, keys] mask a mask function describes at those global indices."""
    rows = torch.arange(batch_size, device=queries.device)[:, None, None]
    return attend(rows, None, queries[:, None], keys[None, :])[:, None]


def _whole_sequence_mask(
    attend: Callable | None,
    positions: torch.Tensor,
    indices: tuple[torch.Tensor, torch.Tensor] | None,
    block_mask: bool,
    on_demand: bool,
) -> Any:
    """The mask `attend` describes over the whole sequence (None: none needed): a BlockMask, or the dense one, at the
    global `indices` (None: in order); `on_demand` where the blocks may attend instead (CP's key ranges), made
    only if an attention call needs it after all. Under context parallel a BlockMask's rows are this rank's
    queries, which the wrapper's `_FlexSequenceMask` maps to global indices: `attend` itself is kept."""
    if attend is None:
        return None
    batch_size, total = positions.shape
    if block_mask and indices is not None:  # the wrapper makes the BlockMask of this rank's rows, per window
        return attend
    if block_mask:
        return document_block_mask(batch_size, total, total, mask_function=attend, device=positions.device)
    dense = DenseMaskOnDemand(attend, batch_size, *(indices or (torch.arange(total, device=positions.device),) * 2))
    return dense if on_demand else dense()


class DenseMaskOnDemand:
    """The dense [B, 1, queries, keys] mask a mask function describes, made by the first attention call that needs it
    and kept for the micro-batch's other layers and their recomputation. Context parallel's blockwise attention of
    packed documents or left-padded rows needs none: at a long sequence its [T/c, T] booleans would be the step's
    largest tensor."""

    def __init__(self, attend: Callable, batch_size: int, queries: torch.Tensor, keys: torch.Tensor) -> None:
        self._arguments: tuple | None = (attend, batch_size, queries, keys)
        self._mask: torch.Tensor | None = None

    @torch.compiler.disable  # made eagerly, once, also where the layer that first needs it is compiled
    def __call__(self) -> torch.Tensor:
        if self._mask is None:
            assert self._arguments is not None
            self._mask, self._arguments = _dense_mask(*self._arguments), None
        return self._mask


def padding_mask(real: torch.Tensor) -> torch.Tensor | None:
    """The causal [B, T, T] mask with the padding (`real` [B, T] False) masked out as keys where it comes before a
    real token (left-padded prompts); None where it does not (right padding needs no mask under causal attention)."""
    attend = _sequence_mask_function(None, real)
    positions = torch.arange(real.shape[1], device=real.device)
    return None if attend is None else _dense_mask(attend, real.shape[0], positions, positions)[:, 0]


def _key_ranges(documents: torch.Tensor | None, real: torch.Tensor | None) -> KeyRanges | None:
    """The mask as key ranges (context_attention.KeyRanges) where it is packed documents alone, or left padding of
    rows whose real tokens are one run (a prompt left-padded, the response and any right padding after it); None
    where it is anything else (both, padding between real tokens) or causal alone."""
    left_padded = _left_padded(real)
    if documents is not None and not left_padded:
        first = torch.diff(documents, prepend=documents[:, :1] - 1) != 0
        return KeyRanges((torch.arange(documents.shape[1], device=documents.device) * first).cummax(-1).values)
    if documents is not None or real is None or not left_padded:
        return None
    if ((real[:, 1:] & ~real[:, :-1]).sum(1) + real[:, 0]).max() > 1:  # a row with two runs of real tokens
        return None
    begin = real.int().argmax(1, keepdim=True)  # the first real token (0 in a row of padding alone)
    end = begin + real.sum(1, keepdim=True)
    index = torch.arange(real.shape[1], device=real.device)
    padding_ends = torch.where(real, -1, torch.where(index < begin, begin, end))  # none before the prompt
    return KeyRanges(begin.expand_as(real).contiguous(), padding_ends)


def _full_sequence_mask(
    attention_mask: torch.Tensor | None,
    indices: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
    sliding_window: int | None,
    additive_dtype: torch.dtype | None,
    device: torch.device,
    batch_length: int | None = None,
) -> torch.Tensor | None:
    """The boolean mask over the gathered sequence (True = attend): the mask the batch brought (packed documents,
    left padding), or causal (None, which sdpa applies itself where queries and keys are the whole sequence in order),
    narrowed to a sliding window that is shorter than the sequence. Its rows and columns are the global tokens
    `indices` names (context parallel: this rank's queries, the gathered keys; None: the sequence in order), and
    causal is by that index. Eager applies no causal mask of its own and adds the mask to the scores: it gets an
    additive one, transformers' (the dtype's min where masked), and -inf at the masked keys from `batch_length` on
    (the padding to a multiple of the cut): a row with no key (left padding) then weighs the batch's keys alike, as
    one rank's eager softmax of a row of mins does, and not the cut's padding, which one rank's row has not."""
    queries, keys = (
        (t.to(device) for t in indices) if indices is not None else (torch.arange(length, device=device),) * 2
    )
    mask = attention_mask
    if sliding_window is not None and length > sliding_window:
        distance = queries[:, None] - keys[None, :]
        band = (distance >= 0) & (distance < sliding_window)
        mask = band if mask is None else mask & band
    if mask is None and indices is None and additive_dtype is None:
        return None  # sdpa's own causal attention
    if mask is None:
        mask = queries[:, None] >= keys[None, :]
    if additive_dtype is None:
        return mask
    additive = torch.zeros(mask.shape, dtype=additive_dtype, device=device).masked_fill(
        ~mask, torch.finfo(additive_dtype).min
    )
    return additive if batch_length is None else additive.masked_fill(~mask & (keys >= batch_length), -math.inf)


class _FlexSequenceMask:
    """The BlockMask DOCUMENT_FLEX attends through over the gathered sequence: the one the batch brought
    (`shard_sequence`'s documents and left padding), a mask function over a dense mask that came instead (a VL
    model's left padding, parallel/vision.py), or causal; narrowed to a sliding window shorter than the sequence.
    Under context parallel its rows are this rank's queries and its columns the gathered keys (`indices`): a mask
    function of global indices (`shard_sequence`'s rule, causal, the window) is read through those maps, and the
    kernel skips every 128 x 128 block no query of it sees, as the balanced chunks leave them. The last one made per
    shape and window is kept for the layers (and recomputations) that see the same mask."""

    def __init__(self) -> None:
        self._made: dict[tuple, tuple[Any, Any, Any]] = {}

    def __call__(
        self,
        attention_mask: Any,
        batch_size: int,
        indices: tuple[torch.Tensor, torch.Tensor] | None,
        length: int,
        window: int | None,
        device: Any,
    ) -> Any:
        from torch.nn.attention.flex_attention import BlockMask
        from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

        narrow = window if window is not None and length > window else None
        if isinstance(attention_mask, BlockMask) and narrow is None:
            return attention_mask
        key = (batch_size, length, narrow, device)
        made = self._made.get(key)
        if made is not None and made[0] is attention_mask and made[1] is indices:
            return made[2]
        function: Callable
        if isinstance(attention_mask, BlockMask):
            function = attention_mask.mask_mod
        elif isinstance(attention_mask, torch.Tensor):  # its rows and columns are the attention's own
            function = _indexed_mask(attention_mask)
        else:  # a rule of global indices: the sequence's (context parallel), or causal
            function = _at_global_indices(attention_mask or causal_mask_function, indices, device)
        if narrow is not None:
            function = and_masks(function, _at_global_indices(sliding_window_overlay(narrow), indices, device))
        queries = length if indices is None else indices[0].numel()
        block_mask = document_block_mask(batch_size, queries, length, mask_function=function, device=device)
        self._made[key] = (attention_mask, indices, block_mask)
        return block_mask


def _at_global_indices(function: Callable, indices: tuple[torch.Tensor, torch.Tensor] | None, device: Any) -> Callable:
    """A mask function of global indices read at the attention's own rows and columns: under context parallel this
    rank's queries and the gathered keys (`indices`), else the sequence in order (itself)."""
    if indices is None:
        return function
    queries, keys = (t.to(device) for t in indices)

    def attend(batch: torch.Tensor, head: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return function(batch, head, queries[query], keys[key])

    return attend


def _indexed_mask(dense: torch.Tensor) -> Callable:
    """A boolean [B, 1, T, T] mask as a mask function."""

    def attend(batch: torch.Tensor, head: Any, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        return dense[batch, 0, query, key]

    return attend


def _block_indices(
    indices: tuple[torch.Tensor, torch.Tensor] | None, ranges: KeyRanges | None, window: int | None, length: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The index maps blocks attend by: context parallel's; under Ulysses alone the whole sequence's, where a mask
    (documents, left padding, a window shorter than the sequence) would otherwise send sdpa to the math kernel; None
    where sdpa's own causal kernel needs no mask."""
    if indices is not None:
        return indices
    if ranges is not None or (window is not None and length > window):
        whole = torch.arange(length)
        return whole, whole
    return None


def _inner_mask(
    inner: str,
    flex_mask: _FlexSequenceMask | None,
    attention_mask: Any,
    indices: tuple[torch.Tensor, torch.Tensor] | None,
    length: int,
    window: int | None,
    query: torch.Tensor,
    batch_length: int | None,
) -> Any:
    """The mask the inner attention gets over the `length` gathered keys: the sequence's (made now if on demand) as
    a BlockMask for FlexAttention, else dense by the global `indices` (additive for eager, `batch_length` the
    micro-batch's own tokens), narrowed to `window`."""
    if isinstance(attention_mask, DenseMaskOnDemand):
        attention_mask = attention_mask()
    if flex_mask is not None:
        return flex_mask(attention_mask, query.shape[0], indices, length, window, query.device)
    additive = query.dtype if inner == "eager" else None
    return _full_sequence_mask(attention_mask, indices, length, window, additive, query.device, batch_length)
