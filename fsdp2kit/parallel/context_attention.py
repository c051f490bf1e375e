"""Plain causal attention of a context-parallel rank's queries over the gathered keys, block by block, keeping no
scores (`model.context_parallel_size`, the sdpa path on CPU).

Under context parallel a rank's queries are contiguous runs of global token indices (parallel/sequence_layout.py:
`token_order`: cp rank r holds chunks r and 2c-1-r of 2c), its keys every token of the sequence. Where attention is
plain causal, the queries of a run that starts at global index s see every key before s in full and the keys of
their own run causally, and no later key: two blocks a fused kernel computes without a mask, returning each query's
log-sum-exp beside the output (the CPU flash kernel), merged by online softmax (out = sum_i exp(lse_i - lse) out_i,
lse = logaddexp of the blocks'), as ring attention and torch's `context_parallel` (torch/distributed/tensor/
experimental/_attention.py) merge theirs. A dense [T/c, T] mask would send sdpa to the math kernel, which keeps the
[heads, T/c, T] scores. Backward: the kernel's backward of each block, given the merged output and log-sum-exp,
is that block's exact share of dq, dk and dv (the flash / ring-attention backward): dq sums over the blocks, dk and
dv go back to the key positions each block read.

Packed documents are the same blocks per document: a run is cut where a document starts, and its earlier block
begins at its document's first token instead of the sequence's (each row of the batch has its own documents).
Left-padded rows (RL's prompts) are blocks too: their real tokens one document from the first real one; a padding
token attends to the real keys before it (as the dense mask and one rank's have it: the whole row's after the
prompt, one block in full), and one before the prompt to no key: no block, its output 0 and its log-sum-exp -inf,
as sdpa gives a row with no key, and no gradient.
Under a sliding window that cuts a run's keys, the run is cut into tiles, each attending to its band of keys through
the same kernel with a small additive mask (`window_tiles`).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch._subclasses.fake_tensor import is_fake

# The fused CPU kernel that returns the log-sum-exp ([B, H, L], float32 for reduced precision), and its backward.
_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def has_attention_sinks(module: Any) -> bool:
    """Whether an attention module carries learned sinks (GPT-OSS's `sinks`: an extra logit per head in the softmax),
    which neither the fused kernels' blocks nor DOCUMENT_FLEX apply."""
    return isinstance(getattr(module, "sinks", None), torch.Tensor)


def blockwise_applies(
    module: Any, query: torch.Tensor, attention_mask: Any, length: int, padded: bool, **kwargs: Any
) -> bool:
    """Whether the attention sdpa would compute for these queries over the `length` gathered keys is causal (within
    the key ranges of documents or left padding, whose mask the caller leaves out; under a sliding window, where no
    row is `padded`) with nothing the fused kernel lacks: no other mask (padding between real tokens), no dropout,
    softcap, position bias or attention sinks; on the CPU (CUDA keeps sdpa with the dense mask), with real tensors
    (`plan` traces on fake ones the memory of a CUDA run, which makes the dense mask)."""
    causal, window = kwargs.get("is_causal"), kwargs.get("sliding_window")
    conditions = (
        attention_mask is None,
        query.device.type == "cpu" and not is_fake(query),
        query.shape[2] > 1,
        window is None or length <= window or not padded,
        not kwargs.get("dropout"),
        kwargs.get("softcap") is None,
        kwargs.get("position_bias") is None,
        not has_attention_sinks(module),
        getattr(module, "is_causal", True) if causal is None else causal,
    )
    return all(conditions)


def blockwise_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    indices: tuple[torch.Tensor, torch.Tensor],
    scaling: float | None,
    key_ranges: KeyRanges | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of `query` [B, H, L, D] over `key`, `value` [B, H_kv, T, D] (gathered), where `indices`
    holds the global index of each query and each key (the keys: every index below T once), as sdpa would compute it
    with the dense causal mask by those indices; within packed documents or around left padding as `key_ranges`
    gives each row's; under a sliding `window` (a query sees the keys less than `window` before it; no padding).
    Out [B, L, H, D], as transformers' attention functions return it."""
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    order = torch.argsort(indices[1].to(key.device))  # the gathered position of each global index
    queries = indices[0].cpu()
    if key_ranges is None:  # one set of runs for every row
        output = _CausalBlocks.apply(query, key, value, order, window_tiles(query_runs(queries), window), scale)
    else:
        starts, ends = key_ranges.starts.cpu(), key_ranges.padding_ends
        rows = []
        for b in range(query.shape[0]):
            runs = window_tiles(query_runs(queries, starts[b], None if ends is None else ends[b].cpu()), window)
            rows.append(_CausalBlocks.apply(*(t[b : b + 1] for t in (query, key, value)), order, runs, scale))
        output = torch.cat(rows)
    return output.transpose(1, 2).contiguous()


class KeyRanges(NamedTuple):
    """The keys each global index of a batch's rows attends to, as ranges: `starts` [B, T], its document's first
    index (a real token sees that document causally up to itself); `padding_ends` [B, T] (None: no padding), -1 at
    a real token, and at a padding token of a left-padded row where the real keys it sees end: it attends to
    [start, end), none where that is empty."""

    starts: torch.Tensor
    padding_ends: torch.Tensor | None = None


# A run of queries: (first global index, length, first global index of its keys: its document's first, or 0; -1 for
# real tokens, else the end of the real keys the run's padding tokens see; the sliding window, 0: none).
Run = tuple[int, int, int, int, int]
# A block's keys: up to each query, all, up to each query and less than the window before it.
CAUSAL, FULL, BANDED = "causal", "full", "banded"


def query_runs(
    queries: torch.Tensor, document_starts: torch.Tensor | None = None, padding_ends: torch.Tensor | None = None
) -> list[Run]:
    """The runs of consecutive global indices in `queries`, in order, cut where a document starts (by
    `document_starts` [T], each global index's document's first index; None: one document) and where padding
    (`padding_ends` [T], KeyRanges') begins or ends."""
    cut = queries.diff() != 1
    first = document_starts[queries] if document_starts is not None else torch.zeros_like(queries)
    end = padding_ends[queries] if padding_ends is not None else torch.full_like(queries, -1)
    cut |= (first.diff() != 0) | (end.diff() != 0)
    bounds = [0, *(torch.nonzero(cut).flatten() + 1).tolist(), queries.numel()]
    starts, firsts, ends = (t[bounds[:-1]].tolist() for t in (queries, first, end))
    return [(starts[i], bounds[i + 1] - bounds[i], firsts[i], ends[i], 0) for i in range(len(starts))]


# Queries a banded tile holds at most: its mask is tile x (tile + window - 1), and a query's work is that row.
BAND_TILE_QUERIES = 1024


def window_tiles(runs: list[Run], window: int | None) -> list[Run]:
    """The runs under a sliding `window`: where it cuts keys off a run (its last query sees fewer than all of its
    document's keys before it), cut into tiles of at most `window` (and BAND_TILE_QUERIES) queries, each attending
    to its band alone."""
    if window is None:
        return runs
    tiles = []
    size = min(window, BAND_TILE_QUERIES)
    for start, length, first, end, _ in runs:
        if end >= 0 or start + length - first <= window:  # every query sees its whole document up to itself
            tiles.append((start, length, first, end, 0))
            continue
        stop = start + length
        tiles += [(a, min(size, stop - a), first, end, window) for a in range(start, stop, size)]
    return tiles


def _blocks(start: int, length: int, first: int, end: int, window: int) -> list[tuple[slice, str]]:
    """The key blocks (a range of global indices and how its keys are seen) the run of queries [start, start +
    length) attends to: real tokens their own keys causally and every earlier key of their document (from `first`)
    in full, or under a window that cuts them off the keys less than `window` before them from `first` on, one
    banded block; padding tokens the real keys [first, end) in full, no block where there are none."""
    own = slice(start, start + length)
    if window:
        return [(slice(max(first, start - window + 1), start + length), BANDED)]
    if end < 0:
        return [(own, CAUSAL), (slice(first, start), FULL)] if start > first else [(own, CAUSAL)]
    return [(slice(first, end), FULL)] if end > first else []


def _band(queries: slice, keys: slice, window: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The additive [1, 1, queries, keys] mask (the kernel takes its inputs' dtype) of the keys each query sees under
    the window: at or before it, less than `window` before it."""
    distance = torch.arange(queries.start, queries.stop, device=device)[:, None] - torch.arange(
        keys.start, keys.stop, device=device
    )
    seen = (distance >= 0) & (distance < window)
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))[None, None]


def _block_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kind: str, scale: float, band: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's output and log-sum-exp: the fused kernel's (with the `band` of a banded block)."""
    return _FLASH_CPU(query, key, value, 0.0, kind == CAUSAL, attn_mask=band, scale=scale)


def _block_backward(
    grad: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kind: str,
    scale: float,
    band: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block's share of dq, dk and dv given the merged output and log-sum-exp: the kernel's backward."""
    return _FLASH_CPU_BACKWARD(grad, query, key, value, out, lse, 0.0, kind == CAUSAL, attn_mask=band, scale=scale)


def _block_keys(keys: torch.Tensor, positions: torch.Tensor, heads: int) -> torch.Tensor:
    """The gathered keys (or values) at `positions`, in that order, their heads repeated to the query heads
    (transformers' `repeat_kv`, as its sdpa does under a mask): a block's, made when the kernel needs it, so that
    only the gathered [B, H_kv, T, D] ones are kept for the backward."""
    from transformers.integrations.sdpa_attention import repeat_kv

    return repeat_kv(keys[:, :, positions], heads // keys.shape[1])


def _run_forward(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, order: torch.Tensor, run: Run, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One run's output and log-sum-exp, its blocks merged by online softmax in float32 (or the inputs' float64); a
    run of no block (padding before the prompt) has no key: 0 and -inf, sdpa's output for a row with none."""
    merged: tuple[torch.Tensor, torch.Tensor] | None = None
    precision = torch.promote_types(query.dtype, torch.float32)
    heads = query.shape[1]
    for keys, kind in _blocks(*run):
        k, v = (_block_keys(t, order[keys], heads) for t in (key, value))
        out, lse = _block_forward(query, k, v, kind, scale, _band_of(run, keys, kind, query))
        out, lse = out.to(precision), lse.to(precision)
        if merged is not None:
            total = torch.logaddexp(merged[1], lse)
            out = merged[0] * (merged[1] - total).exp()[..., None] + out * (lse - total).exp()[..., None]
            lse = total
        merged = (out, lse)
    if merged is None:
        return torch.zeros_like(query), query.new_full(query.shape[:-1], -math.inf, dtype=precision)
    return merged[0].to(query.dtype), merged[1]


def _heads_summed(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A block's key (or value) gradient over the repeated heads [B, H, n, D], summed back to the key/value heads."""
    batch, heads, length, dim = grad.shape
    return grad.view(batch, kv_heads, heads // kv_heads, length, dim).sum(2)


class _CausalBlocks(torch.autograd.Function):
    """The queries' runs (`query_runs`) over their blocks (`_blocks`) of the gathered keys and values (`order`: the
    gathered position of each global index); the backward the kernel's per block with the merged output and
    log-sum-exp, each block's key and value gradients added at the gathered positions it read."""

    @staticmethod
    def forward(
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        order: torch.Tensor,
        runs: list[Run],
        scale: float,
    ) -> torch.Tensor:
        blocks = [_run_forward(query[:, :, rows], key, value, order, run, scale) for rows, run in _run_rows(runs)]
        out, lse = (torch.cat(parts, 2) for parts in zip(*blocks, strict=True))
        ctx.save_for_backward(query, key, value, order, out, lse)
        ctx.runs, ctx.scale = runs, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, order, out, lse = ctx.saved_tensors
        precision = torch.promote_types(query.dtype, torch.float32)
        dq = torch.zeros_like(query, dtype=precision)
        dk, dv = torch.zeros_like(key, dtype=precision), torch.zeros_like(value, dtype=precision)
        grad, heads = grad.contiguous(), query.shape[1]
        for rows, run in _run_rows(ctx.runs):
            for keys, kind in _blocks(*run):
                k, v = (_block_keys(t, order[keys], heads) for t in (key, value))
                parts = (grad[:, :, rows], query[:, :, rows], k, v, out[:, :, rows], lse[:, :, rows])
                gq, gk, gv = _block_backward(*parts, kind, ctx.scale, _band_of(run, keys, kind, query))
                dq[:, :, rows] += gq
                dk.index_add_(2, order[keys], _heads_summed(gk.to(precision), key.shape[1]))
                dv.index_add_(2, order[keys], _heads_summed(gv.to(precision), value.shape[1]))
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None, None


def _band_of(run: Run, keys: slice, kind: str, query: torch.Tensor) -> torch.Tensor | None:
    """A banded block's mask (None for the others)."""
    start, length, _, _, window = run
    return _band(slice(start, start + length), keys, window, query.dtype, query.device) if kind == BANDED else None


def _run_rows(runs: list[Run]) -> list[tuple[slice, Run]]:
    """Each run with the rows of the query tensor that hold it."""
    offsets = [0]
    for _, length, _, _, _ in runs:
        offsets.append(offsets[-1] + length)
    return [(slice(offsets[i], offsets[i + 1]), run) for i, run in enumerate(runs)]
