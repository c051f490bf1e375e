"""Ulysses sequence parallel (DeepSpeed-Ulysses), `model.ulysses_size: k`, and the attention wrapper every
sequence-parallel layout runs through (context parallel's too).

The k consecutive ranks of a sequence-parallel (SP) group train on the same samples, each holding a contiguous 1/k
of every sample's tokens (parallel/sequence_layout.py). Everything but attention works token by token, so it runs on
the local slice as it is; attention needs the whole sequence, so around it an all-to-all trades the sequence split
for a head split ([batch, heads, seq/k, dim] -> [batch, heads/k, seq, dim]): each rank attends over the whole
sequence with 1/k of the heads, and a second all-to-all trades back. Where k does not divide the heads (unaligned
Ulysses), the first heads % k ranks attend with one head more (`heads_per_rank`), and the all-to-alls exchange pieces
of uneven sizes. The model's code is not touched: the wrapper is registered as a transformers attention
implementation (around the configured sdpa or eager) and the model is switched to it.

Between the two exchanges the wrapper runs context parallel where the group has a cp part: keys and values gathered
over it (parallel/context_parallel.py), this rank's queries over all of them. It reads the mask over the whole
sequence from parallel/sequence_masks.py's forms, and attends by blocks of the fused kernel where that applies
(parallel/context_attention.py).

The wrapper is registered under a name that only the models Ulysses switched use: each model owns its config
(`models/build.py:build_meta_model`), so a plain model built from the same source config in the same process (a
rollout or reward model) keeps its own attention. The name is its group's (`ulysses_<inner>_group<name>`, c10d's
name of the process group): two models of one process with different Ulysses groups (an actor over 2 ranks, a
critic over 4) each attend over their own.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from fsdp2kit.errors import UserError
from fsdp2kit.parallel import context_attention
from fsdp2kit.parallel.context_attention import blockwise_applies, has_attention_sinks
from fsdp2kit.parallel.context_parallel import _gathered_again_in_backward, _GatherKeys
from fsdp2kit.parallel.document_attention import DOCUMENT_FLEX, document_flex_attention
from fsdp2kit.parallel.mesh import divisors, sequence_subgroups
from fsdp2kit.parallel.sequence_layout import sequence_key_ranges, sequence_mask, token_indices, unpadded_length
from fsdp2kit.parallel.sequence_masks import _block_indices, _FlexSequenceMask, _inner_mask

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def apply_ulysses(model: PreTrainedModel, group: ProcessGroup, sub_config: str | None = None) -> None:
    """Switch the model's attention (or its `sub_config` part's) to the Ulysses wrapper around its configured
    implementation (sdpa or eager), or around DOCUMENT_FLEX where the build picked it for packed documents."""
    from transformers import AttentionInterface

    ulysses = sequence_subgroups(group).ulysses
    size = ulysses.size() if ulysses is not None else 1
    heads = model.config.get_text_config().num_attention_heads
    if heads < size:
        valid = [d for d in divisors(dist.get_world_size()) if d <= heads]
        raise UserError(
            f"model.ulysses_size = {size} exceeds the model's {heads} attention heads (each rank attends with at "
            f"least one); valid here: {', '.join(map(str, valid))}"
        )
    inner = model.config._attn_implementation
    if inner not in ("sdpa", "eager", DOCUMENT_FLEX):
        raise UserError(
            f"model.attn_implementation: {inner} cannot run inside Ulysses (model.ulysses_size = {size}), which "
            "attends over the gathered sequence with sdpa or eager; set auto, sdpa or eager"
        )
    name = f"ulysses_{inner}_group{group.group_name}"  # per group: another model's group registers its own
    AttentionInterface.register(name, _ulysses_attention(inner, group))
    # `sub_config` names the part of the model that attends over the sequence (a VL model's language model: its tower
    # runs unsplit, parallel/vision.py); None switches the whole model.
    model.set_attn_implementation({sub_config: name} if sub_config else name)


def heads_per_rank(heads: int, size: int) -> list[int]:
    """How many of `heads` attention heads each rank of a k = `size` group attends with: heads // k, one more on the
    first heads % k ranks (unaligned Ulysses), each rank a contiguous run of heads in rank order."""
    return [heads // size + (rank < heads % size) for rank in range(size)]


def _all_to_all(
    x: torch.Tensor,
    group: ProcessGroup,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: list[int],
    gather_sizes: list[int],
) -> torch.Tensor:
    """Cut `x` along `scatter_dim` into pieces of `scatter_sizes`, send piece i to rank i of the group, and join the
    pieces that arrive along `gather_dim`, in rank order: rank i's is `gather_sizes[i]` long there (and this rank's
    `scatter_sizes` entry long along `scatter_dim`). Uneven sizes are uneven heads per rank."""
    pieces = x.split(scatter_sizes, dim=scatter_dim)
    send = x.new_empty(x.numel())
    for piece, flat in zip(pieces, send.split([piece.numel() for piece in pieces]), strict=True):
        flat.view(piece.shape).copy_(piece)  # one copy: each rank's piece contiguous in the send buffer
    shape = list(x.shape)
    shape[scatter_dim] = scatter_sizes[group.rank()]
    shapes = [shape[:gather_dim] + [size] + shape[gather_dim + 1 :] for size in gather_sizes]
    counts = [math.prod(piece_shape) for piece_shape in shapes]
    received = x.new_empty(sum(counts))
    sent = [piece.numel() for piece in pieces]
    dist.all_to_all_single(received, send, output_split_sizes=counts, input_split_sizes=sent, group=group)
    arrived = [flat.view(piece_shape) for flat, piece_shape in zip(received.split(counts), shapes, strict=True)]
    return torch.cat(arrived, dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` with its gradient: the reverse exchange (gather_dim scattered, scatter_dim gathered)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        group: ProcessGroup,
        scatter_dim: int,
        gather_dim: int,
        scatter_sizes: list[int],
        gather_sizes: list[int],
    ) -> torch.Tensor:
        ctx.group, ctx.dims, ctx.sizes = group, (scatter_dim, gather_dim), (scatter_sizes, gather_sizes)
        return _all_to_all(x, group, scatter_dim, gather_dim, scatter_sizes, gather_sizes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (scatter_dim, gather_dim), (scatter_sizes, gather_sizes) = ctx.dims, ctx.sizes
        reverse = _all_to_all(grad, ctx.group, gather_dim, scatter_dim, gather_sizes, scatter_sizes)
        return reverse, None, None, None, None, None


class _RegroupedAttention:
    """The attention module as the inner implementation sees it once key/value heads were repeated: each key/value
    head serves fewer query heads (`num_key_value_groups`); every other attribute is the module's own."""

    def __init__(self, module: torch.nn.Module, num_key_value_groups: int):
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _rank_key_value(
    module: Any, heads: int, key: torch.Tensor, value: torch.Tensor, size: int
) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """Key and value with their heads repeated so that each rank's share serves exactly its query heads, and the
    module as the inner attention then sees it. Where k divides the query heads, each key/value head is repeated just
    enough that every rank gets whole ones (none where k divides them too). Where it does not, the ranks attend with
    heads // k and heads // k + 1 query heads, and one ratio of query to key/value heads on every rank (the inner
    attention's `num_key_value_groups`) divides both counts only if it is 1: key/value are repeated to the query
    heads and split like them."""
    from transformers.integrations.sdpa_attention import repeat_kv

    kv_heads = key.shape[1]
    repeats = heads // kv_heads if heads % size else math.lcm(kv_heads, size) // kv_heads
    if repeats == 1:
        return module, key, value
    module = _RegroupedAttention(module, heads // (kv_heads * repeats))
    return module, repeat_kv(key, repeats), repeat_kv(value, repeats)


class _RankHeadSinks:
    """The attention module as the inner implementation sees it on this rank, which attends with its own contiguous
    run of `split[rank]` heads: its per-head attention sinks (GPT-OSS's `sinks`) narrowed to those heads, their
    gradient kept."""

    def __init__(self, module: Any, split: list[int], rank: int):
        self._module = module
        self.sinks = module.sinks.narrow(0, sum(split[:rank]), split[rank])

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _eager_attention(module: torch.nn.Module) -> Callable:
    """The eager attention of the module's own modeling file: transformers registers no generic one."""
    for cls in type(module).__mro__:  # fully_shard subclasses the module's class in a module of its own
        function = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if function is not None:
            return function
    raise UserError(
        f"model.attn_implementation: eager with model.ulysses_size > 1 needs the eager_attention_forward "
        f"of {type(module).__name__}'s modeling file, which has none; use sdpa"
    )


def _inner_attention(inner: str, module: torch.nn.Module, functions: Any) -> Callable:
    """The attention `inner` names: transformers' sdpa, DOCUMENT_FLEX, or the module's own eager one."""
    if inner == "sdpa":
        return functions["sdpa"]
    return document_flex_attention if inner == DOCUMENT_FLEX else _eager_attention(module)


def _heads_out(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ulysses: ProcessGroup
) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, tuple[list[int], list[int]]]:
    """Ulysses' first all-to-all: this rank's heads (`heads_per_rank`, key/value repeated as `_rank_key_value` says)
    over the Ulysses group's whole share of the sequence; also the module as the inner attention then sees it, and
    the (head split, sequence pieces) the output's exchange back reverses."""
    size = ulysses.size()
    query_split = heads_per_rank(query.shape[1], size)
    module, key, value = _rank_key_value(module, query.shape[1], key, value, size)
    if has_attention_sinks(module):
        module = _RankHeadSinks(module, query_split, ulysses.rank())
    pieces = [query.shape[2]] * size  # every rank's slice of the sequence is as long (shard_sequence pads it)
    query = _AllToAll.apply(query, ulysses, 1, 2, query_split, pieces)
    key, value = (_AllToAll.apply(t, ulysses, 1, 2, heads_per_rank(t.shape[1], size), pieces) for t in (key, value))
    return module, query, key, value, (query_split, pieces)


def _ulysses_attention(inner: str, group: ProcessGroup) -> Callable:
    """A transformers attention function: query [batch, heads, seq/n, dim] and key/value [batch, kv_heads, seq/n,
    dim] in, [batch, seq/n, heads, dim] out, computed by `inner` with this rank's heads (`heads_per_rank`, Ulysses'
    all-to-all) for this rank's share of the queries over every key (context parallel: the keys and values
    all-gathered over the c ranks with the rectangular mask, the exact all-gather form of Llama 3's context parallel,
    Llama 3 paper sec. 3.3.2, also torch's `context_parallel` and torchtitan; where attention is causal, within
    documents, around left padding or under a sliding window, no such mask but blocks of the fused kernel merged by
    their log-sum-exp, parallel/context_attention.py)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    subgroups = sequence_subgroups(group)
    ulysses, context = subgroups.ulysses, subgroups.context
    flex_mask = _FlexSequenceMask() if inner == DOCUMENT_FLEX else None

    def attention(
        module: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        indices, ranges = token_indices(group), None
        if attention_mask is None:  # a text micro-batch: the mask `shard_sequence` made for the whole sequence
            attention_mask, ranges = sequence_mask(group), sequence_key_ranges(group)
        inner_attention = _inner_attention(inner, module, ALL_ATTENTION_FUNCTIONS)
        if ulysses is not None:  # heads out, sequence in
            module, query, key, value, exchange = _heads_out(module, query, key, value, ulysses)
        gathered: list[tuple[torch.Tensor, torch.Tensor]] = []
        if context is not None:  # every key and value of the sequence, for this rank's queries
            blocks = key, value
            key, value = _GatherKeys.apply(key, context), _GatherKeys.apply(value, context)
            gathered = list(zip((key, value), blocks, strict=True))
        length, window = key.shape[2], kwargs.get("sliding_window")
        if context is not None and (indices is None or indices[1].numel() != length):
            # A forward of tokens no `shard_sequence` cut (the head's probe): each rank's taken as a contiguous part.
            indices = (torch.arange(query.shape[2]) + context.rank() * query.shape[2], torch.arange(length))
            attention_mask, ranges = None, None
        unblocked = attention_mask if ranges is None else None  # packed documents or left padding are blocks too
        padded = ranges is not None and ranges.padding_ends is not None
        blockwise = inner == "sdpa" and blockwise_applies(module, query, unblocked, length, padded, **kwargs)
        by = _block_indices(indices, ranges, window, length) if blockwise else None
        with _gathered_again_in_backward(context, gathered):
            if by is not None:
                attend = context_attention.blockwise_causal_attention
                output = attend(query, key, value, by, kwargs.get("scaling"), ranges, window)
            elif inner == "sdpa" and attention_mask is None and context is not None and is_fake(query):
                # `plan`'s trace of a causal CP rank: the run's kernel keeps no scores (FlexAttention on CUDA, the
                # blocks on a CPU), as sdpa's unmasked one; the dense mask would send the trace to the math kernel.
                output, _ = inner_attention(module, query, key, value, None, **kwargs)
            else:
                batch_length = unpadded_length(group)
                mask = _inner_mask(inner, flex_mask, attention_mask, indices, length, window, query, batch_length)
                output, _ = inner_attention(module, query, key, value, mask, **kwargs)  # [batch, seq, heads/k, dim]
        # The attention weights (eager) cover this rank's heads only; training never reads them.
        if ulysses is not None:  # sequence out, heads in
            output = _AllToAll.apply(output, ulysses, 1, 2, *reversed(exchange))
        return output, None

    return attention
