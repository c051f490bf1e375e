"""Packed documents by sdpa, one call per document or tile of short ones (parallel/document_sdpa.py), the CPU's
default path: a model built by fsdp2kit switches to it, and its logits and gradients equal transformers' dense
document mask's (fp32); what it cannot take (padding, a sliding window that cuts a document, a mask of another
shape, dropout) goes through the dense mask unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import process_group, sharded_model
from test_strategy import tiny_llama

from fsdp2kit.parallel import document_attention, document_sdpa
from fsdp2kit.parallel.document_sdpa import DOCUMENT_SDPA, TILE_TOKENS, Tile, document_spans, tiles

VOCAB = 256
# Each row's documents: short ones that share a tile, ones longer than a tile alone, one that fills a tile.
DOCUMENTS = [[3, 5, 80, 72], [100, 2, 2, 56]]
LENGTH = 160


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (len(DOCUMENTS), LENGTH), generator=torch.Generator().manual_seed(2))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    return ids, positions


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("document_sdpa") / "model", vocab=VOCAB, layers=2)


def job(model_dir: Path) -> object:
    from fsdp2kit.config.load import validate

    return validate({"model": {"name_or_path": str(model_dir)}}, "config")


def logits_and_grads(model_dir: Path, **inputs: torch.Tensor) -> tuple[str, torch.Tensor, dict[str, torch.Tensor]]:
    """fsdp2kit's training model (FSDP, one rank) on `inputs`: its attention, logits and every parameter's gradient
    of the logits' weighted sum."""
    with process_group(1) as runtime:
        model = sharded_model(job(model_dir), runtime, training=True).model
        logits = model(**inputs, use_cache=False).logits
        weights = torch.linspace(-1, 1, logits.numel()).view_as(logits)
        (logits * weights).sum().backward()
        grads = {name: p.grad.full_tensor().clone() for name, p in model.named_parameters()}
        return model.config._attn_implementation, logits.detach(), grads


def test_by_documents_equals_the_dense_mask(llama_dir, monkeypatch):
    """The default CPU build attends by documents; its logits and gradients equal the dense mask's, and the
    documents are what the comparison sees (without them the logits differ)."""
    ids, positions = packed_batch()
    calls = []
    attend = document_sdpa.document_sdpa_attention

    def counted(module, query, key, value, attention_mask, **kwargs):
        calls.append(getattr(attention_mask, "document_spans", None))
        return attend(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(document_sdpa, "document_sdpa_attention", counted)
    by_documents = logits_and_grads(llama_dir, input_ids=ids, position_ids=positions)
    assert by_documents[0] == DOCUMENT_SDPA
    assert calls and all(spans is not None for spans in calls)  # every layer took the documents' path
    assert [[(a, b) for a, b, _ in row] for row in calls[0]] == [[(0, 8), (8, 88), (88, 160)], [(0, 100), (100, 160)]]
    monkeypatch.setattr(document_attention, "document_path", lambda *_: (None, "the dense mask"))
    dense = logits_and_grads(llama_dir, input_ids=ids, position_ids=positions)
    assert dense[0] == "sdpa"
    torch.testing.assert_close(by_documents[1], dense[1], rtol=1e-5, atol=1e-5)
    for name, grad in dense[2].items():  # float32 sums in another order: within 1e-6 of the tensor's largest
        scale = float(grad.abs().max())
        torch.testing.assert_close(by_documents[2][name], grad, rtol=1e-5, atol=1e-6 * scale, msg=name)
    mixed = logits_and_grads(llama_dir, input_ids=ids)[1]  # one causal sequence a row
    assert (mixed - dense[1]).abs().max() > 1e-2


def test_tiles_merge_short_documents_and_keep_long_ones_alone():
    bounds = [0, 3, 8, 88, 100, 102, 104, 160, 230]
    found = tiles(bounds, torch.device("cpu"))
    assert [(t.start, t.end) for t in found] == [(0, 8), (8, 88), (88, 104), (104, 160), (160, 230)]
    assert [t.mask is None for t in found] == [False, True, False, True, True]
    small = found[0].mask[0, 0]  # documents [0, 3) and [3, 8): each causal, neither sees the other
    expected = torch.zeros(8, 8, dtype=torch.bool)
    expected[:3, :3] = torch.ones(3, 3).tril().bool()
    expected[3:, 3:] = torch.ones(5, 5).tril().bool()
    assert torch.equal(small, expected)
    assert all(t.end - t.start <= TILE_TOKENS or t.mask is None for t in found)


def block_diagonal(lengths: list[int]) -> torch.Tensor:
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(len(documents))
    return ((index[:, None] >= index) & (documents[:, None] == documents))[None, None]


def test_only_a_block_diagonal_causal_mask_is_read_as_documents():
    mask = block_diagonal([5, 7, 4])
    assert [[tuple(t)[:2] for t in row] for row in document_spans(mask)] == [[(0, 16)]]
    assert document_spans(mask.float()) is None  # an additive mask
    padded = mask.clone()
    padded[..., 3] = False  # a key masked out (padding inside a document)
    assert document_spans(padded) is None
    window = mask & (torch.arange(16)[:, None] - torch.arange(16) < 3)  # a window that cuts the documents
    assert document_spans(window) is None
    full = torch.ones(1, 1, 16, 16, dtype=torch.bool)  # bidirectional
    assert document_spans(full) is None
    assert document_spans(torch.zeros(1, 1, 16, 16, dtype=torch.bool)) is None  # queries with no key
    assert document_spans(torch.cat([mask, mask], 1)) is None  # a mask per head
    long = block_diagonal([600, 300, 124])  # checked in chunks of rows
    assert [[tuple(t)[:2] for t in row] for row in document_spans(long)] == [[(0, 600), (600, 900), (900, 1024)]]


def test_what_the_documents_path_cannot_apply_goes_through_the_dense_mask():
    """Dropout, or a mask without spans: transformers' sdpa with the mask, as without fsdp2kit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(0)
    query, key, value = torch.randn(1, 4, 16, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    mask = block_diagonal([6, 10])
    mask.document_spans = [[Tile(0, 6, None), Tile(6, 16, None)]]
    expected = sdpa_attention_forward(module, query, key, value, mask)[0]
    torch.testing.assert_close(document_sdpa.document_sdpa_attention(module, query, key, value, mask)[0], expected)
    torch.manual_seed(1)
    dropped = document_sdpa.document_sdpa_attention(module, query, key, value, mask, dropout=0.5)[0]
    torch.manual_seed(1)
    torch.testing.assert_close(dropped, sdpa_attention_forward(module, query, key, value, mask, dropout=0.5)[0])
