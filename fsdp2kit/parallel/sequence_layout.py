"""Which tokens of a sequence each rank of a sequence-parallel group holds, and what the group's attention reads of
the micro-batch it cut last: the one place the layout of `model.ulysses_size` and `model.context_parallel_size` is
decided, so that the cut (`shard_sequence`), the attention (parallel/ulysses.py), VL batches (parallel/vision.py) and
the way back to sequence order (`strategy.py:gather_sequence`) agree on it.

Ulysses gives each of its k ranks a contiguous 1/k of every sample; context parallel cuts the sequence into 2c chunks
and gives cp rank r chunks r and 2c-1-r, which balances causal attention's work over the ranks (`token_order`).
`shard_sequence` cuts a collated micro-batch so and records beside the group (`remember_tokens`) what is read of the
whole sequence later: the tokens a group-wide statistic counts (MoE's load-balancing loss), the mask over the whole
sequence (parallel/sequence_masks.py), under context parallel the global index of each query and gathered key, the
mask as key ranges (parallel/context_attention.py's blocks) and the micro-batch's length before its padding.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.context_attention import KeyRanges
from fsdp2kit.parallel.mesh import sequence_subgroups
from fsdp2kit.parallel.sequence_masks import _documents, _key_ranges, _sequence_mask_function, _whole_sequence_mask


def token_order(length: int, context_size: int, ulysses_size: int) -> torch.Tensor:
    """Which tokens of a sequence of `length` (a multiple of the cut) each rank of a sequence group holds: [cp rank,
    Ulysses rank, tokens] global indices. Context parallel cuts the sequence into 2c equal chunks and gives cp rank r
    chunks r and 2c-1-r, so that under causal attention every rank has as many (query, key) pairs to compute (the
    load balancing of Llama 3's context parallel and torch's `context_parallel`); Ulysses cuts that share into k
    contiguous slices. Flattened, it is the order of the tokens gathered over the group in rank order."""
    chunks = torch.arange(length).view(2 * context_size if context_size > 1 else 1, -1)
    shares = torch.cat([chunks[:context_size], chunks.flip(0)[:context_size]], 1) if context_size > 1 else chunks
    return shares.view(context_size, ulysses_size, -1)


def shard_sequence(
    batch: dict[str, torch.Tensor], group: ProcessGroup, block_mask: bool = False
) -> dict[str, torch.Tensor]:
    """This rank's share of every sample of a collated micro-batch (`token_order`): input ids, labels (shifted
    already, before the cut) and the global position ids (rotary embeddings need them; without them 0..T-1, as the
    model numbers a batch on one rank, padding included: a padding query's scores, which eager's gradient reads,
    are then one rank's too), the sequence padded at the end to a multiple of the cut with non-target tokens. Packed
    documents get their block-diagonal causal mask over the whole sequence, and so does padding that comes before a
    real token (left-padded prompts): no real token attends to it. Right padding needs no mask under causal
    attention (parallel/sequence_masks.py), so the 2-D mask of a right-padded batch is dropped. Under context parallel
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


def sequence_key_ranges(group: ProcessGroup) -> KeyRanges | None:
    """The key ranges `remember_tokens` recorded for `group` last (None: the mask is not one of them, or none)."""
    return _KEY_RANGES.get(id(group))


def unpadded_length(group: ProcessGroup) -> int | None:
    """The micro-batch's own length `remember_tokens` recorded for `group` last (None: no padding masked apart)."""
    return _BATCH_LENGTHS.get(id(group))
