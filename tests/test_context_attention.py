"""The blockwise causal attention of context parallel (parallel/context_attention.py), in one process: a rank's
queries (chunks r and 2c-1-r of 2c) over the keys gathered in cp-rank order give the output and the query, key and
value gradients of sdpa with the dense mask by global index, for every rank of c = 2 and 4 and Ulysses 2 x CP 2:
causal, with and without grouped key/value heads; within packed documents; around left padding; under a sliding
window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers.integrations.sdpa_attention import repeat_kv

from fsdp2kit.parallel import context_attention
from fsdp2kit.parallel.context_attention import KeyRanges, blockwise_causal_attention, query_runs, window_tiles
from fsdp2kit.parallel.document_attention import document_flex_attention
from fsdp2kit.parallel.sequence_layout import token_order
from fsdp2kit.parallel.sequence_masks import _FlexSequenceMask, _key_ranges, _sequence_mask_function

HEADS, DIM, LENGTH = 4, 8, 48


def rank_layout(context: int, ulysses: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global indices of cp rank `rank`'s queries (its whole share, as Ulysses gathers it) and of the keys."""
    order = token_order(LENGTH, context, ulysses)
    return order[rank].flatten(), order.flatten()


def assert_blockwise_equals_sdpa(
    indices: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
    generator: torch.Generator,
    ranges: KeyRanges | None = None,
    window: int | None = None,
    kv_heads: int = 2,
) -> None:
    """Blockwise attention of random float64 q, k, v over a rank's `indices` (queries, gathered keys) against sdpa
    with the dense boolean `mask` [rows, 1, queries, keys]: the output and the q, k, v gradients to 1e-10."""
    queries, keys = indices
    rows = mask.shape[0]
    q = torch.randn(rows, HEADS, queries.numel(), DIM, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(rows, kv_heads, LENGTH, DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    grad = torch.randn(rows, queries.numel(), HEADS, DIM, dtype=torch.float64, generator=generator)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    got = blockwise_causal_attention(q, k, v, indices, 0.3, ranges, window)
    got_grads = torch.autograd.grad(got, leaves, grad)
    repeats = HEADS // kv_heads
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, repeats), repeat_kv(v, repeats), mask, scale=0.3)
    expected_grads = torch.autograd.grad(expected.transpose(1, 2), leaves, grad)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-10, rtol=0)
    for name, a, b in zip("qkv", got_grads, expected_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0, msg=f"d{name}")


def causal(indices: tuple[torch.Tensor, torch.Tensor], rows: int = 2) -> torch.Tensor:
    """The causal mask by global index, [rows, 1, queries, keys]."""
    queries, keys = indices
    return (queries[:, None] >= keys[None, :])[None, None].expand(rows, 1, -1, -1)


def packed_documents() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of packed documents (a document ends inside a rank's chunk, at a chunk's edge, and one spans several
    chunks; row 0's 12-token document ends at 24, a chunk's edge at c = 2): each token's document, and its start."""
    lengths = [[5, 7, 12, 3, 21], [24, 1, 23]]
    documents = torch.stack([torch.repeat_interleave(torch.arange(len(n)), torch.tensor(n)) for n in lengths])
    return documents, torch.stack([torch.searchsorted(row, row, side="left") for row in documents])


def test_query_runs_are_the_rank_chunks():
    queries, _ = rank_layout(4, 1, 1)  # chunks 1 and 6 of 8, 6 tokens each
    assert query_runs(queries) == [(6, 6, 0, -1, 0), (36, 6, 0, -1, 0)]
    assert query_runs(torch.arange(5, 9)) == [(5, 4, 0, -1, 0)]
    starts = torch.tensor([0] * 8 + [8] * 32 + [40] * 8)  # documents [0, 8), [8, 40), [40, 48)
    assert query_runs(queries, starts) == [(6, 2, 0, -1, 0), (8, 4, 8, -1, 0), (36, 4, 8, -1, 0), (40, 2, 40, -1, 0)]
    # 9 tokens of left padding, real tokens [9, 39), right padding after: the padding runs see [9, 9) and [9, 39)
    ranges = _key_ranges(None, ((torch.arange(LENGTH) >= 9) & (torch.arange(LENGTH) < 39))[None])
    assert ranges is not None and ranges.padding_ends is not None
    runs = query_runs(queries, ranges.starts[0], ranges.padding_ends[0])
    assert runs == [(6, 3, 9, 9, 0), (9, 3, 9, -1, 0), (36, 3, 9, -1, 0), (39, 3, 9, 39, 0)]


@pytest.mark.parametrize("kv_heads", [HEADS, 2])
@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_blockwise_equals_sdpa_with_the_dense_mask(context, ulysses, kv_heads):
    generator = torch.Generator().manual_seed(context * 10 + kv_heads)
    for rank in range(context):
        indices = rank_layout(context, ulysses, rank)
        assert_blockwise_equals_sdpa(indices, causal(indices), generator, kv_heads=kv_heads)


@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_blockwise_within_packed_documents_equals_sdpa_with_the_document_mask(context, ulysses):
    """Each row its own documents: the runs cut at each document's start and its earlier keys from that start give
    sdpa's output and gradients with the block-diagonal causal mask."""
    documents, starts = packed_documents()
    generator = torch.Generator().manual_seed(context + ulysses)
    for rank in range(context):
        indices = rank_layout(context, ulysses, rank)
        queries, keys = indices
        mask = causal(indices) & (documents[:, queries, None] == documents[:, None, keys])[:, None]
        assert_blockwise_equals_sdpa(indices, mask, generator, KeyRanges(starts))


def test_window_tiles_cut_the_runs_a_window_cuts(monkeypatch):
    assert window_tiles([(36, 6, 0, -1, 0)], 4) == [(36, 4, 0, -1, 4), (40, 2, 0, -1, 4)]
    assert window_tiles([(2, 3, 0, -1, 0), (8, 4, 8, -1, 0)], 5) == [(2, 3, 0, -1, 0), (8, 4, 8, -1, 0)]
    assert window_tiles([(6, 3, 9, 9, 0)], 2) == [(6, 3, 9, 9, 0)]  # padding keeps its blocks (no window with it)
    assert window_tiles([(6, 6, 0, -1, 0)], None) == [(6, 6, 0, -1, 0)]
    monkeypatch.setattr(context_attention, "BAND_TILE_QUERIES", 3)  # tiles shorter than the window
    assert window_tiles([(36, 6, 0, -1, 0)], 4) == [(36, 3, 0, -1, 4), (39, 3, 0, -1, 4)]


@pytest.mark.parametrize("tile", [context_attention.BAND_TILE_QUERIES, 3])
@pytest.mark.parametrize("window", [4, 7, 30])
@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_blockwise_under_a_sliding_window_equals_sdpa_with_the_band_mask(context, ulysses, window, tile, monkeypatch):
    """Windows shorter than a rank's chunk, than two chunks, and longer than most documents, in tiles of the window
    and shorter; in one document a row and within packed ones: the band tiles give sdpa's output and gradients with
    the mask the dense path builds (`_full_sequence_mask`: 0 <= query - key < window, and the document's)."""
    monkeypatch.setattr(context_attention, "BAND_TILE_QUERIES", tile)
    documents, starts = packed_documents()
    generator = torch.Generator().manual_seed(context + ulysses + window)
    for packed in (False, True):
        for rank in range(context):
            indices = rank_layout(context, ulysses, rank)
            queries, keys = indices
            distance = queries[:, None] - keys[None, :]
            mask = ((distance >= 0) & (distance < window))[None, None].expand(2, 1, -1, -1)
            if packed:
                mask = mask & (documents[:, queries, None] == documents[:, None, keys])[:, None]
            assert_blockwise_equals_sdpa(indices, mask, generator, KeyRanges(starts) if packed else None, window)


def left_padded_rows() -> torch.Tensor:
    """Which tokens are real in RL's rows: a prompt left-padded by 7 (its response right-padded after index 40); by 13
    and no right padding; none padded; a row of padding alone."""
    index = torch.arange(LENGTH)
    return torch.stack([(index >= 7) & (index < 41), index >= 13, index >= 0, index < 0])


@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_blockwise_over_left_padded_rows_equals_sdpa_with_the_padding_mask(context, ulysses):
    """Left padding and the right padding after a response: every token's output and the q/k/v gradients equal
    sdpa's with the dense mask `shard_sequence` builds for such rows (a padding token attends to the real keys
    before it; before the prompt to none: sdpa's 0 and no gradient), padding tokens included."""
    real = left_padded_rows()
    ranges = _key_ranges(None, real)
    attend = _sequence_mask_function(None, real)
    assert ranges is not None and attend is not None
    generator = torch.Generator().manual_seed(context * 3 + ulysses)
    for rank in range(context):
        indices = rank_layout(context, ulysses, rank)
        queries, keys = indices
        mask = attend(torch.arange(4)[:, None, None], None, queries[:, None], keys[None, :])[:, None]
        assert_blockwise_equals_sdpa(indices, mask, generator, ranges)


def test_padding_between_real_tokens_or_beside_documents_keeps_the_dense_mask():
    """Key ranges describe one run of real tokens a row (and documents without padding): a row whose real tokens
    are two runs, or left padding beside packed documents, get none (the dense mask attends)."""
    index = torch.arange(LENGTH)
    two_runs = torch.stack([(index >= 4) & (index < 20) | (index >= 30), index >= 2])
    assert _key_ranges(None, two_runs) is None
    documents = (index >= 24).long()[None].expand(2, -1)
    assert _key_ranges(documents, left_padded_rows()[:2]) is None
    assert _key_ranges(documents, None) is not None and _key_ranges(None, None) is None


def test_bf16_inputs_merge_in_float32():
    """bf16 in, bf16 out and gradients, within bf16's rounding of the float64 results."""
    queries, keys = rank_layout(2, 1, 0)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, HEADS, queries.numel(), DIM, dtype=torch.float64, generator=generator)
    k, v = (torch.randn(1, 2, LENGTH, DIM, dtype=torch.float64, generator=generator) for _ in range(2))
    grad = torch.randn(1, queries.numel(), HEADS, DIM, dtype=torch.float64, generator=generator)
    low = [t.bfloat16().requires_grad_() for t in (q, k, v)]
    got = blockwise_causal_attention(*low, (queries, keys), None)
    got_grads = torch.autograd.grad(got, low, grad.bfloat16())
    exact = [t.requires_grad_() for t in (q, k, v)]
    mask = queries[:, None] >= keys[None, :]
    expected = F.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), mask).transpose(1, 2)
    expected_grads = torch.autograd.grad(expected, exact, grad)
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    torch.testing.assert_close(got.double(), expected, atol=2e-2, rtol=0)
    for a, b in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(a.double(), b, atol=5e-2, rtol=2e-2)


@pytest.mark.cuda
def test_cuda_keeps_the_dense_mask_and_agrees_with_the_cpu_blockwise_path():
    """On CUDA the blockwise path does not apply (blockwise_applies: CPU only) and CP attends through sdpa with the
    dense rectangular mask; that path on the GPU gives what the CPU's blockwise path gives (fp32)."""
    from fsdp2kit.parallel.context_attention import blockwise_applies

    queries, keys = rank_layout(2, 1, 1)
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(1, HEADS, queries.numel(), DIM, generator=generator)
    k, v = (torch.randn(1, HEADS, LENGTH, DIM, generator=generator) for _ in range(2))
    assert blockwise_applies(None, q, None, LENGTH, False) and not blockwise_applies(
        None, q.cuda(), None, LENGTH, False
    )
    cpu = blockwise_causal_attention(q, k, v, (queries, keys), None)
    mask = (queries[:, None] >= keys[None, :]).cuda()
    gpu = F.scaled_dot_product_attention(q.cuda(), k.cuda(), v.cuda(), mask).transpose(1, 2)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-5, rtol=1e-5)


def flex_over_rank(
    made: object, mask: object, indices: tuple[torch.Tensor, torch.Tensor], window: int | None, qkv: list
) -> torch.Tensor:
    """FlexAttention of a rank's queries over the gathered keys through the block mask CP's wrapper makes on CUDA
    (`_FlexSequenceMask` `made`, from `mask`: a rule of global indices, None for causal, or a rectangular tensor)."""
    block_mask = made(mask, qkv[0].shape[0], indices, LENGTH, window, qkv[0].device)  # type: ignore[operator]
    return document_flex_attention(torch.nn.Module(), *qkv, block_mask, scaling=0.3)[0]


def sdpa_over_rank(mask: torch.Tensor, qkv: list) -> torch.Tensor:
    q, k, v = qkv
    repeats = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, repeats), repeat_kv(v, repeats), mask, scale=0.3)


def flex_cases(indices: tuple[torch.Tensor, torch.Tensor]) -> list[tuple[object, int | None, torch.Tensor]]:
    """What CP's FlexAttention path is given for a rank (the batch's mask as `shard_sequence` or a VL model hands it,
    the layer's window) and the dense [rows, 1, queries, keys] mask sdpa would apply instead: causal, packed
    documents, left-padded rows (as a rule and as a VL model's rectangular tensor), each with and without a window."""
    queries, keys = indices
    documents, _ = packed_documents()
    real = left_padded_rows()
    padding = _sequence_mask_function(None, real)
    assert padding is not None
    padded = padding(torch.arange(4)[:, None, None], None, queries[:, None], keys[None, :])[:, None]
    distance = queries[:, None] - keys[None, :]
    cases = []
    for window in (None, 7):
        band = (distance < window) if window else torch.ones_like(distance, dtype=torch.bool)
        cases += [
            (None, window, causal(indices, 4) & band),
            (
                _sequence_mask_function(documents, None),
                window,
                causal(indices) & band & (documents[:, queries, None] == documents[:, None, keys])[:, None],
            ),
            (padding, window, padded & band),
            (padded, window, padded & band),
        ]
    return cases


@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2)])
def test_flex_block_mask_of_a_rank_equals_sdpa_with_the_dense_mask(context, ulysses):
    """CP's CUDA path (FlexAttention, model.attn_implementation auto): the block mask of each rank's rows over the
    gathered keys, read at global indices, gives sdpa's output with the dense mask, for every mask it is handed and
    under a window (forward: torch has no CPU backward for FlexAttention; the cuda test compares gradients). One
    `_FlexSequenceMask` serves every rank and case, as one model's layers share it: it must not hand a mask made for
    other rows or another rule."""
    made = _FlexSequenceMask()
    generator = torch.Generator().manual_seed(context * 5 + ulysses)
    for rank in range(context):
        indices = rank_layout(context, ulysses, rank)
        for mask, window, dense in flex_cases(indices):
            rows = dense.shape[0]
            q = torch.randn(rows, HEADS, indices[0].numel(), DIM, generator=generator)
            k, v = (torch.randn(rows, 2, LENGTH, DIM, generator=generator) for _ in range(2))
            got = flex_over_rank(made, mask, indices, window, [q, k, v])
            expected = sdpa_over_rank(dense, [q, k, v]).transpose(1, 2)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=f"rank {rank} window {window}")


def test_flex_block_mask_skips_the_blocks_no_query_sees():
    """At 1024 tokens and CP 2, rank 0 holds tokens [0, 256) and [768, 1024): its 4 x 8 blocks of 128 x 128 (the keys
    in gathered order) are computed where a query sees a key, 1 + 2 for the front chunk's two query blocks (causal
    from the first key) and 7 + 8 for its mirror's, so 14 of 32 never are (a dense mask computes all)."""
    order = token_order(1024, 2, 1)
    made, cpu = _FlexSequenceMask(), torch.device("cpu")
    block_mask = made(None, 1, (order[0].flatten(), order.flatten()), 1024, None, cpu)
    assert block_mask.shape[-2:] == (512, 1024)
    assert block_mask.sparsity() == 100 * 14 / 32
    # Rank 1's rows (chunks 1 and 2: 3 + 4 + 5 + 6 blocks) by the same maker: its own mask, as much work (balanced).
    other = made(None, 1, (order[1].flatten(), order.flatten()), 1024, None, cpu)
    assert other.sparsity() == block_mask.sparsity() and not torch.equal(other.kv_indices, block_mask.kv_indices)


@pytest.mark.cuda
@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (2, 2)])
def test_flex_block_mask_of_a_rank_trains_as_the_dense_mask_on_cuda(context, ulysses):
    """bf16 on CUDA, compiled FlexAttention through each rank's block mask: output and q, k, v gradients of sdpa with
    the dense mask, within bf16 rounding, for every mask and window of `flex_cases`."""
    made = _FlexSequenceMask()
    generator = torch.Generator().manual_seed(context + ulysses)
    for rank in range(context):
        indices = rank_layout(context, ulysses, rank)
        for mask, window, dense in flex_cases(indices):
            rows = dense.shape[0]
            qkv = [
                torch.randn(rows, HEADS, indices[0].numel(), DIM, generator=generator),
                *(torch.randn(rows, 2, LENGTH, DIM, generator=generator) for _ in range(2)),
            ]
            weights = torch.randn(rows, indices[0].numel(), HEADS, DIM, generator=generator).cuda()
            results = []
            for attend in ("flex", "sdpa"):
                leaves = [t.to("cuda", torch.bfloat16).requires_grad_() for t in qkv]
                cuda_mask = mask.cuda() if isinstance(mask, torch.Tensor) else mask
                if attend == "flex":
                    output = flex_over_rank(made, cuda_mask, tuple(t.cuda() for t in indices), window, leaves)
                else:
                    output = sdpa_over_rank(dense.cuda(), leaves).transpose(1, 2)
                (output.float() * weights).sum().backward()
                results.append([output.float(), *(t.grad.float() for t in leaves)])
            for name, flex, sdpa in zip(("output", "query", "key", "value"), *results, strict=True):
                scale = float(sdpa.abs().max()) or 1.0
                torch.testing.assert_close(flex, sdpa, rtol=0, atol=2e-2 * scale, msg=f"{name} rank {rank}")


def test_the_gpu_benchmark_compares_the_same_attention():
    """benchmarks/context_parallel_gpu.py (issue 48's figures on a lent GPU) runs forward on a CPU at a small length:
    both paths of every rank it measures give the same output (bf16 rounding), and it measures ranks 0 and c-1."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    command = [sys.executable, "benchmarks/context_parallel_gpu.py", "--device", "cpu", "--lengths", "512"]
    command += ["--sizes", "1", "2", "--repeats", "1"]
    done = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300, check=True)
    rows = json.loads(done.stdout)["rows"]
    assert [(row["context_parallel_size"], row["rank"]) for row in rows] == [(1, 0), (2, 0), (2, 1)]
    assert all(row["max_diff_relative"] < 1e-2 for row in rows[1:])


@pytest.mark.cuda
def test_flex_attention_gathers_its_keys_again_in_the_backward_on_cuda():
    """bf16 on CUDA, compiled FlexAttention (4 heads over 2 key/value heads: its grouped kernel saves the keys and
    values it is given) of CP rank 0's queries inside `_gathered_again_in_backward`, over a group of one rank: none
    of the gathered keys and values is alive after the forward, and the output and q, k, v gradients are those of
    the same attention keeping them, to the bit (the backward gathers the same values again)."""
    import gc
    import weakref
    from contextlib import nullcontext

    import torch.distributed as dist
    from conftest import process_group

    from fsdp2kit.parallel.context_parallel import _gathered_again_in_backward, _GatherKeys

    indices = tuple(t.cuda() for t in rank_layout(2, 1, 0))
    generator = torch.Generator().manual_seed(5)
    qkv = [torch.randn(2, HEADS, indices[0].numel(), DIM, generator=generator)]
    qkv += [torch.randn(2, 2, LENGTH, DIM, generator=generator) for _ in range(2)]
    weights = torch.randn(2, indices[0].numel(), HEADS, DIM, generator=generator).cuda()
    with process_group(1):
        results, alive = [], []
        for again in (True, False):
            q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_() for t in qkv)
            gathered = [(_GatherKeys.apply(t, dist.group.WORLD), t) for t in (k, v)]
            refs = [weakref.ref(full) for full, _ in gathered]
            keep = _gathered_again_in_backward(dist.group.WORLD, gathered) if again else nullcontext()
            with keep:
                output = flex_over_rank(_FlexSequenceMask(), None, indices, None, [q, *(f for f, _ in gathered)])
            del gathered
            gc.collect()
            alive.append(sum(ref() is not None for ref in refs))
            (output.float() * weights).sum().backward()
            results.append([output, q.grad, k.grad, v.grad])
    assert alive == [0, 2], alive
    for name, again, kept in zip(("output", "query", "key", "value"), *results, strict=True):
        torch.testing.assert_close(again, kept, rtol=0, atol=0, msg=name)
