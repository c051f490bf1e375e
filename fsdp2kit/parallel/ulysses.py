"""Ulysses sequence parallel (DeepSpeed-Ulysses), `model.ulysses_size: k`.

The k consecutive ranks of a sequence-parallel (SP) group train on the same samples, each holding a contiguous 1/k
of every sample's tokens. Everything but attention works token by token, so it runs on the local slice as it is;
attention needs the whole sequence, so around it an all-to-all trades the sequence split for a head split
([batch, heads, seq/k, dim] -> [batch, heads/k, seq, dim]): each rank attends over the whole sequence with 1/k of
the heads, and a second all-to-all trades back. Where k does not divide the heads (unaligned Ulysses), the first
heads % k ranks attend with one head more (`heads_per_rank`), and the all-to-alls exchange pieces of uneven sizes.
The model's code is not touched: the wrapper is registered as a transformers attention implementation (around the
configured sdpa or eager) and the model is switched to it.

Masks: the model builds none for an implementation transformers does not know (it cannot: it sees only the local
slice). The wrapper applies causal attention over the gathered sequence, which is exact for right-padded samples
(padding comes after every real token, so no real token attends to it), narrowed to the layer's sliding window if
it has one. Packed documents need a block-diagonal mask over the whole sequence: `shard_sequence` builds it from
the global position ids and leaves it beside the group (`remember_tokens`), where the wrapper reads it: the model gets
no `attention_mask`, which the rest of it (MoE's load-balancing loss) would read as a [B, T] padding mask;
left-padded samples (RL's prompts) get one too, with the padding masked out as keys. Where the build picked
FlexAttention for packed documents (parallel/document_attention.py: CUDA, model.attn_implementation auto) the
wrapper runs DOCUMENT_FLEX over the gathered sequence, and `shard_sequence` hands the same rule as a BlockMask
(skipped, full or partial 128 x 128 blocks): no [T, T] mask exists on that path. Under context parallel it does so
on CUDA with or without documents, through a block mask of the rank's rows that the wrapper makes from the rule.

The wrapper is registered under a name that only the models Ulysses switched use: each model owns its config
(`models/build.py:build_meta_model`), so a plain model built from the same source config in the same process (a
rollout or reward model) keeps its own attention. The name is its group's (`ulysses_<inner>_group<name>`, c10d's
name of the process group): two models of one process with different Ulysses groups (an actor over 2 ranks, a
critic over 4) each attend over their own.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake
from torch.distributed import ProcessGroup

from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel import context_attention
from fsdp2kit.parallel.context_attention import KeyRanges, blockwise_applies, has_attention_sinks
from fsdp2kit.parallel.document_attention import DOCUMENT_FLEX, document_block_mask, document_flex_attention
from fsdp2kit.parallel.mesh import divisors, sequence_subgroups

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


def shard_sequence(
    batch: dict[str, torch.Tensor], group: ProcessGroup, block_mask: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's share of every sample of a collated micro-batch (`token_order`): input ids, labels (shifted
    already, before the cut) and the global position ids (rotary embeddings need them; without them 0..T-1, as the
    model numbers a batch on one rank, padding included: a padding query's scores, which eager's gradient reads,
    are then one rank's too), the sequence padded at the end to a multiple of the cut with non-target tokens. Packed
    documents get their block-diagonal causal mask over the whole sequence, and so does padding that comes before a
    real token (left-padded prompts): no real token attends to it. Right padding needs no mask under causal
    attention (see the module docstring), so the 2-D mask of a right-padded batch is dropped. Under context parallel
    the mask's rows are this rank's queries and its columns the gathered keys ([B, 1, T/c, T]), and the global index
    of each is recorded. `block_mask` (the model attends with DOCUMENT_FLEX): that mask as a BlockMask, never a
    dense one."""
    subgroups = sequence_subgroups(group)
    ulysses = (subgroups.ulysses.size(), subgroups.ulysses.rank()) if subgroups.ulysses is not None else (1, 0)
    context = (subgroups.context.size(), subgroups.context.rank()) if subgroups.context is not None else (1, 0)
    input_ids, labels = batch["input_ids"], batch["labels"]
    length = input_ids.shape[1]
    pad = -length % (ulysses[0] * context[0] * (2 if context[0] > 1 else 1))
    mask = batch.get("attention_mask")
    real = mask.bool() if mask is not None and mask.dim() == 2 else None
    positions = batch.get("position_ids")
    packed = positions is not None
    if positions is None:
        positions = torch.arange(length, device=input_ids.device).expand(input_ids.shape[0], -1)
    if pad:
        input_ids = F.pad(input_ids, (0, pad))  # any token id will do: it is no target and attended by none
        labels = F.pad(labels, (0, pad), value=IGNORE_INDEX)
        # Continuing the last position keeps the padding inside the last document: no extra document to mask.
        positions = torch.cat([positions, positions[:, -1:] + torch.arange(1, pad + 1, device=positions.device)], 1)
        real = F.pad(real, (0, pad), value=False) if real is not None else None
    order = token_order(length + pad, context[0], ulysses[0]).to(input_ids.device)
    local = order[context[1], ulysses[1]]
    shard = {"input_ids": input_ids[:, local], "position_ids": positions[:, local], "labels": labels[:, local]}
    tokens = torch.ones_like(input_ids, dtype=torch.bool)
    tokens[:, length:] = False
    indices = (order[context[1]].flatten(), order.flatten()) if context[0] > 1 else None
    documents = _documents(positions) if packed else None
    attend = _sequence_mask_function(documents, real)
    # Packed documents or left padding (not both) are also blocks of the fused kernel, which only sdpa on the CPU runs.
    blocks_possible = positions.device.type == "cpu" and not block_mask
    ranges = _key_ranges(documents, real) if blocks_possible else None
    mask = _whole_sequence_mask(attend, positions, indices, block_mask, on_demand=ranges is not None)
    # The model gets no mask: its attention (the wrapper) reads the sequence's from here, and nothing else of the
    # model takes it for a [B, T] padding mask (MoE's load-balancing loss would).
    counted = tokens if real is None else tokens & real
    remember_tokens(group, counted[:, order.flatten()], mask, indices, ranges, length)
    return shard


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


def token_order(length: int, context_size: int, ulysses_size: int) -> torch.Tensor:
    """Which tokens of a sequence of `length` (a multiple of the cut) each rank of a sequence group holds: [cp rank,
    Ulysses rank, tokens] global indices. Context parallel cuts the sequence into 2c equal chunks and gives cp rank r
    chunks r and 2c-1-r, so that under causal attention every rank has as many (query, key) pairs to compute (the
    load balancing of Llama 3's context parallel and torch's `context_parallel`); Ulysses cuts that share into k
    contiguous slices. Flattened, it is the order of the tokens gathered over the group in rank order."""
    chunks = torch.arange(length).view(2 * context_size if context_size > 1 else 1, -1)
    shares = torch.cat([chunks[:context_size], chunks.flip(0)[:context_size]], 1) if context_size > 1 else chunks
    return shares.view(context_size, ulysses_size, -1)


# The tokens ([B, T + padding] booleans) of the micro-batch each sequence-parallel group cut last that a
# whole-sequence statistic over the group's tokens (MoE's load-balancing loss, parallel/moe.py) counts.
_COUNTED_TOKENS: dict[int, torch.Tensor] = {}  # by id(group): a group lives as long as the process
# And the mask over the whole sequence of that micro-batch (packed documents, left padding) that its attention reads.
_SEQUENCE_MASKS: dict[int, Any] = {}
# And, under context parallel, the global indices of this rank's queries and of the gathered keys (`token_order`).
_TOKEN_INDICES: dict[int, tuple[torch.Tensor, torch.Tensor] | None] = {}
# And where the mask is packed documents or left padding alone, it as key ranges (each index's own keys).
_KEY_RANGES: dict[int, KeyRanges | None] = {}
# And the micro-batch's own length: the global indices from it on are the padding to a multiple of the cut.
_BATCH_LENGTHS: dict[int, int | None] = {}


def remember_tokens(
    group: ProcessGroup,
    counted: torch.Tensor,
    mask: Any = None,
    indices: tuple[torch.Tensor, torch.Tensor] | None = None,
    key_ranges: KeyRanges | None = None,
    length: int | None = None,
) -> None:
    """Record which tokens of the micro-batch just cut for `group` ([B, T + padding] booleans, in the order the
    group's ranks hold them) such a statistic counts: the real ones, or all where the model gets the padding mask
    itself (a VL micro-batch); the mask its attention applies over the whole sequence (a dense [B, 1, queries, keys],
    one made on demand, or a BlockMask; None: causal alone); and, under context parallel, the global index of each
    query this rank attends for and of each key in gathered order (None: both are the whole sequence in order), and
    where the mask is packed documents or left padding alone, it as key ranges (`_key_ranges`); and the micro-batch's
    own `length` before the padding to a multiple of the cut (None: no such padding is masked apart)."""
    _COUNTED_TOKENS[id(group)] = counted
    _SEQUENCE_MASKS[id(group)] = mask
    _TOKEN_INDICES[id(group)] = indices
    _KEY_RANGES[id(group)] = key_ranges
    _BATCH_LENGTHS[id(group)] = length


def token_indices(group: ProcessGroup) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (queries, keys) global indices `remember_tokens` recorded for `group` last (None: the sequence in order)."""
    return _TOKEN_INDICES.get(id(group))


def gathered_order(group: ProcessGroup) -> torch.Tensor | None:
    """The global index of each token of the micro-batch cut last, gathered over `group` in rank order (None: that
    order is the sequence's)."""
    indices = token_indices(group)
    return None if indices is None else indices[1]


def sequence_mask(group: ProcessGroup) -> Any:
    """The mask over the whole sequence `remember_tokens` recorded for `group` last (None: causal alone)."""
    return _SEQUENCE_MASKS.get(id(group))


def counted_tokens(group: ProcessGroup) -> torch.Tensor | None:
    """The tokens `remember_tokens` recorded for `group` last; None before any."""
    return _COUNTED_TOKENS.get(id(group))


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


def _all_gathered(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keys or values [batch, heads, seq/c, dim] all-gathered along the sequence over `group`, in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


class _GatherKeys(torch.autograd.Function):
    """Keys or values [batch, heads, seq/c, dim] all-gathered along the sequence over the context-parallel group,
    in rank order. Its gradient: each rank's block gets the sum of every rank's gradient of it (a reduce-scatter,
    written as an all-to-all and a sum, which gloo runs too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gathered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        send = torch.stack(grad.chunk(ctx.group.size(), dim=2)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received.sum(0), None


class _RankBlock(NamedTuple):
    """What a rank keeps for the backward in place of a gathered key or value (or a view of one: a row of the
    batch): its own block of it, and where the saved tensor lies in the gathered one."""

    block: torch.Tensor
    group: ProcessGroup
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt


@contextmanager
def _gathered_again_in_backward(
    group: ProcessGroup | None, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """Around the attention over keys and values all-gathered over the context-parallel `group` (`pairs`: each
    gathered tensor and this rank's block of it): whatever the attention saves of them for its backward is kept as
    the rank's block and gathered again when the backward reads it, as ring attention passes the blocks around again
    in its backward (torch's `context_parallel`). What a layer keeps for backward then shrinks with c (the gathered
    keys and values were the one part that did not), at one more all-gather of them per layer. Saved-tensor hooks do
    not nest (the innermost pair takes everything saved inside it): where another pair is active (recompute's, which
    drops what the attention saves until the backward; activation offload's, which moves it), ours would keep what
    that one drops or moves, so everything is left to it."""
    if group is None or _other_saved_tensors_hooks():
        yield
        return

    def pack(tensor: torch.Tensor) -> Any:
        for full, block in pairs:
            if tensor is full or tensor._base is full:  # the blocks of packed rows save a row's view
                return _RankBlock(block, group, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, _gather_again):
        try:
            yield
        finally:
            pairs.clear()  # the hooks outlive the call (each saved tensor holds them): not the gathered tensors


def _other_saved_tensors_hooks() -> bool:
    """Whether saved-tensor hooks are active around this call. torch 2.6 and 2.7 lack the (private) query: there the
    answer is yes, which keeps the gathered tensors, as before."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def _gather_again(saved: Any) -> torch.Tensor:
    """A saved tensor as the backward reads it: a gathered one (or its view) from the ranks' blocks again, laid out as
    the one the forward gathered (`torch.cat`'s contiguous result)."""
    if not isinstance(saved, _RankBlock):
        return saved
    return _all_gathered(saved.block, saved.group).as_strided(saved.size, saved.stride, saved.offset)


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
            attention_mask, ranges = sequence_mask(group), _KEY_RANGES.get(id(group))
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
                batch_length = _BATCH_LENGTHS.get(id(group))
                mask = _inner_mask(inner, flex_mask, attention_mask, indices, length, window, query, batch_length)
                output, _ = inner_attention(module, query, key, value, mask, **kwargs)  # [batch, seq, heads/k, dim]
        # The attention weights (eager) cover this rank's heads only; training never reads them.
        if ulysses is not None:  # sequence out, heads in
            output = _AllToAll.apply(output, ulysses, 1, 2, *reversed(exchange))
        return output, None

    return attention
