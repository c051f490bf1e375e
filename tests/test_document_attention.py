"""Packed documents without a dense mask (parallel/document_attention.py): FlexAttention through the block mask made
from transformers' own mask function equals the dense-mask path and each document run alone (fp32, 1e-5), on a model
built and sharded by fsdp2kit, with padding, and for a family with sliding windows and soft-capped scores; the choice
(FlexAttention on CUDA, with or without Ulysses; the dense mask on a CPU or where sdpa is named) is what check prints.
Under Ulysses and context parallel (2 ranks) no dense mask exists on that path and the outputs equal the dense
path's.
torch has no CPU backward for FlexAttention: the gradients are compared by the cuda-marked tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import launch_two_ranks, process_group, sharded_model
from test_strategy import tiny_llama

from fsdp2kit.parallel import document_attention
from fsdp2kit.parallel.document_attention import (
    DOCUMENT_FLEX,
    attend_documents,
    document_flex_attention,
    document_path,
    use_document_attention,
)

VOCAB, LENGTH = 256, 64
DOCUMENTS = [[20, 30, 14], [40, 24]]  # document lengths of each packed row


def packed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two packed rows of LENGTH tokens whose position ids restart at every document, as the data pipeline packs."""
    ids = torch.randint(3, VOCAB, (len(DOCUMENTS), LENGTH), generator=torch.Generator().manual_seed(1))
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCUMENTS])
    return ids, positions


def each_document_alone(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The logits of every document run as a sequence of its own, joined back into the packed layout."""
    rows = []
    for row, lengths in zip(ids, DOCUMENTS, strict=True):
        pieces = row.split(lengths)
        rows.append(torch.cat([model(input_ids=piece[None], use_cache=False).logits[0] for piece in pieces]))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("documents") / "model", vocab=VOCAB, layers=2)


def job(model_dir: Path, **model: object) -> object:
    from fsdp2kit.config.load import validate

    return validate({"model": {"name_or_path": str(model_dir), **model}}, "config")


@torch.no_grad()
def test_the_block_mask_equals_the_dense_mask_and_each_document_alone(llama_dir, monkeypatch):
    """fsdp2kit's sharded model (FSDP, one rank), switched at build time as on CUDA: packed logits through
    FlexAttention equal the dense document mask's and those of every document on its own."""
    ids, positions = packed_batch()
    monkeypatch.setattr(document_attention, "document_path", lambda *_: (None, "the dense mask"))
    with process_group(1) as runtime:
        model = sharded_model(job(llama_dir), runtime, training=False).model
        assert model.config._attn_implementation == "sdpa"
        dense = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = each_document_alone(model, ids)
        mixed = model(input_ids=ids, use_cache=False).logits  # one causal sequence: documents attend to each other
    monkeypatch.setattr(document_attention, "document_path", lambda *_: (DOCUMENT_FLEX, "as on CUDA"))
    with process_group(1) as runtime:
        model = sharded_model(job(llama_dir), runtime, training=False).model
        assert model.config._attn_implementation == DOCUMENT_FLEX
        flex = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex, alone, rtol=1e-5, atol=1e-5)
    assert (mixed - alone).abs().max() > 1e-2  # the documents' boundaries are what the comparison sees


@torch.no_grad()
def test_padding_and_a_sliding_window_with_soft_capped_scores():
    """A Gemma-2 (sliding-window layers, soft-capped attention scores) on left-padded rows: FlexAttention equals
    transformers' eager attention on every real token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gemma2",
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        attn_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    ids, positions = packed_batch()
    padding = torch.ones_like(ids)
    padding[1, :10] = 0
    dense_packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    dense_padded = model(input_ids=ids, attention_mask=padding, use_cache=False).logits
    use_document_attention(model, None)
    torch.testing.assert_close(
        model(input_ids=ids, position_ids=positions, use_cache=False).logits, dense_packed, rtol=1e-5, atol=1e-5
    )
    flex_padded = model(input_ids=ids, attention_mask=padding, use_cache=False).logits
    real = padding.bool()
    torch.testing.assert_close(flex_padded[real], dense_padded[real], rtol=1e-5, atol=1e-5)


def test_what_flex_attention_cannot_apply_is_refused():
    query = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="attention dropout 0.1"):
        document_flex_attention(torch.nn.Linear(1, 1), query, query, query, object(), dropout=0.1)
    with pytest.raises(ValueError, match="s_aux"):
        document_flex_attention(torch.nn.Linear(1, 1), query, query, query, object(), s_aux=torch.zeros(2))


CUDA, CPU = torch.device("cuda"), torch.device("cpu")
FLEX, SDPA = "document_flex", "document_sdpa"


@pytest.mark.parametrize(
    "requested, documents, ulysses, device, current, flex, switch, says",
    [
        ("auto", True, 1, CUDA, "sdpa", True, FLEX, "FlexAttention with a document block mask"),
        ("auto", True, 1, CPU, "sdpa", True, SDPA, "sdpa by documents (the fused causal kernel per document"),
        ("sdpa", True, 1, CPU, "sdpa", False, SDPA, "sdpa by documents"),
        ("auto", True, 1, CPU, "document_sdpa", True, SDPA, "sdpa by documents"),
        ("eager", True, 1, CPU, "eager", True, None, "eager with a dense [T, T] document mask (model.attn_impl"),
        ("auto", True, 2, CUDA, "sdpa", True, FLEX, "block mask over the gathered sequence (Ulysses) (no [T, T]"),
        ("auto", True, 2, CUDA, "ulysses_document_flex_group1", True, None, "block mask over the gathered sequence"),
        ("auto", True, 2, CPU, "ulysses_sdpa_group1", True, None, "dense [T, T] document mask over the gathered"),
        ("sdpa", True, 1, CUDA, "sdpa", True, None, "model.attn_implementation: sdpa; auto picks FlexAttention"),
        ("auto", True, 1, CUDA, "eager", False, None, "the family has no FlexAttention"),
        ("flash_attention_2", True, 1, CUDA, "flash_attention_2", True, None, "variable-length"),
        ("auto", False, 1, CUDA, "sdpa", True, None, None),
    ],
)
def test_the_path_is_chosen_by_platform_and_request(requested, documents, ulysses, device, current, flex, switch, says):
    chosen, description = document_path(requested, documents, ulysses, device, current, flex)
    assert chosen == switch
    assert description is None if says is None else says in description


@pytest.mark.parametrize(
    "requested, documents, device, current, flex, switch, says",
    [
        ("auto", True, CUDA, "sdpa", True, FLEX, "FlexAttention with a block mask of each rank's queries"),
        ("auto", False, CUDA, "sdpa", True, FLEX, "FlexAttention with a block mask of each rank's queries"),
        ("auto", True, CUDA, "ulysses_document_flex_group1", True, None, "block mask of each rank's queries"),
        ("sdpa", True, CUDA, "sdpa", True, None, "dense [T/2, T] document mask over the gathered keys (model."),
        ("sdpa", False, CUDA, "sdpa", True, None, None),
        ("auto", True, CUDA, "eager", False, None, "(the family has no FlexAttention"),
        ("auto", True, CPU, "ulysses_sdpa_group1", True, None, "sdpa by blocks of the fused kernel within documents"),
        ("auto", True, CPU, "eager", True, None, "dense [T/2, T] document mask over the gathered keys (FlexAtt"),
        ("auto", False, CPU, "sdpa", True, None, None),
    ],
)
def test_context_parallel_attends_through_flex_attention_on_cuda(
    requested, documents, device, current, flex, switch, says
):
    """Under context parallel (2) a rank's rows need a mask with or without documents: FlexAttention takes it on
    CUDA by default (a block mask of the rank's queries), the CPU's sdpa its blocks, else the dense [T/c, T] one."""
    chosen, description = document_path(requested, documents, 1, device, current, flex, 2)
    assert chosen == switch
    assert description is None if says is None else says in description


def test_a_model_with_attention_sinks_keeps_sdpa():
    """GPT-OSS's family has FlexAttention, but DOCUMENT_FLEX refuses its sinks: the route does not switch to it on
    CUDA (packed documents, or context parallel), where it would fail at the first forward."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.config.schema import DataConfig, ModelConfig
    from fsdp2kit.parallel.document_attention import document_route

    settings = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 4}
    config = AutoConfig.for_model("gpt_oss", **settings, num_key_value_heads=2, head_dim=8, num_local_experts=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")  # GPT-OSS has no sdpa
    assert model._supports_flex_attn
    for parallel in ({}, {"context_parallel_size": 2}):
        cfg = ModelConfig(name_or_path="x", **parallel)
        switched, says = document_route(model, cfg, DataConfig(pack=True, document_mask=True), CUDA)
        assert switched is None and "attention sinks" in str(says)


def test_check_names_the_path(llama_dir):
    """On this CPU: sdpa by documents; without document masking, nothing."""
    from fsdp2kit.check import describe

    with process_group(1) as runtime:
        described = describe(job(llama_dir), runtime)
    assert described["document_attention"].startswith("sdpa by documents (the fused causal kernel per document")
    assert described["attn_implementation"] == "document_sdpa"
    no_documents = job(llama_dir)
    no_documents.data.document_mask = False
    with process_group(1) as runtime:
        assert describe(no_documents, runtime)["document_attention"] is None
    no_documents.model.remove_padding = True  # the Strategy API packs its padded rows into documents
    with process_group(1) as runtime:
        assert describe(no_documents, runtime)["document_attention"] == described["document_attention"]


def ulysses_attention(inner: str, documents: bool, window: int | None, qkv: list[torch.Tensor]) -> torch.Tensor:
    """The Ulysses wrapper around `inner` in the current world of one rank (the exchange moves nothing), on the packed
    batch's documents (`shard_sequence`'s mask: a BlockMask for DOCUMENT_FLEX, else dense) or plain causal rows."""
    import torch.distributed as dist

    from fsdp2kit.parallel.sequence_layout import sequence_mask, shard_sequence
    from fsdp2kit.parallel.ulysses import _ulysses_attention

    ids, positions = (t.to(qkv[0].device) for t in packed_batch())
    group = dist.group.WORLD
    batch = {"input_ids": ids, "labels": ids, **({"position_ids": positions} if documents else {})}
    shard_sequence(batch, group, block_mask=inner == DOCUMENT_FLEX)  # leaves its mask (or none) beside the group
    mask = sequence_mask(group)
    assert (mask is None) != documents
    assert mask is None or type(mask).__name__ == ("BlockMask" if inner == DOCUMENT_FLEX else "DenseMaskOnDemand")
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 1
    output = _ulysses_attention(inner, group)(module, *qkv, None, sliding_window=window, scaling=0.25)[0]
    assert getattr(mask, "_mask", None) is None  # sdpa on the CPU attended by blocks: the dense mask never made
    return output


@pytest.mark.parametrize("window", [None, 8])
def test_ulysses_block_masks_equal_its_dense_masks_with_sliding_windows(window):
    """The Ulysses wrapper around FlexAttention equals it around sdpa on the same heads, for packed documents (a
    BlockMask vs the dense mask) and plain causal rows, with and without a sliding window shorter than the sequence."""
    qkv = list(torch.randn(3, 2, 4, LENGTH, 16, generator=torch.Generator().manual_seed(0)))
    with process_group(1):
        for documents in (True, False):
            sdpa, flex = (ulysses_attention(inner, documents, window, qkv) for inner in ("sdpa", DOCUMENT_FLEX))
            torch.testing.assert_close(flex, sdpa, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_ulysses_and_context_parallel_attend_through_block_masks_as_through_the_dense_mask(llama_dir, tmp_path):
    """2 gloo ranks, model.ulysses_size 2 and model.context_parallel_size 2: with FlexAttention picked (as on CUDA)
    the wrapper runs it over the gathered sequence, and no dense mask exists: under Ulysses the batch carries a
    BlockMask, under CP the documents' rule, of which the wrapper makes the block mask of each rank's rows. The
    logits equal the dense path's (this CPU's pick) and those of every document run alone by transformers (fp32,
    1e-5). A training forward at CP 2 keeps none of the keys and values it gathered (the backward gathers them
    again, and runs), unless a caller's saved-tensor hooks are active, which then get them."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "seen.pt"
    launch_two_ranks("document_ulysses_worker.py", llama_dir, out, timeout=300)
    seen = torch.load(out, weights_only=False)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        alone = each_document_alone(model, packed_batch()[0])
    for parallel, flex_mask in (("ulysses_size", "BlockMask"), ("context_parallel_size", "function")):
        dense, flex = seen[f"dense {parallel}"], seen[f"flex {parallel}"]
        assert (dense["mask"], flex["mask"]) == ("DenseMaskOnDemand", flex_mask)
        assert not dense["mask_made"]  # sdpa on the CPU attended by blocks (parallel/context_attention.py)
        assert dense["attention"].startswith("ulysses_sdpa")
        assert flex["attention"].startswith(f"ulysses_{DOCUMENT_FLEX}")
        torch.testing.assert_close(flex["logits"], dense["logits"], rtol=1e-5, atol=1e-5, msg=parallel)
        torch.testing.assert_close(flex["logits"], alone, rtol=1e-5, atol=1e-5, msg=parallel)
    # What a CP rank keeps for the backward: its block of the keys and values, none of the gathered ones (the attention
    # gathers them again in its backward: context_parallel.py `_gathered_again_in_backward`); under a caller's
    # saved-tensor hooks (recompute's, offload's), everything goes to those, the gathered [.., T, ..] ones too.
    kept = seen["kept context_parallel_size"]
    assert kept["gathered"] > 0 and kept["alive"] == 0 and kept["finite"], kept
    assert kept["length"] in kept["hooked"] and kept["length"] // 2 in kept["hooked"], kept


@pytest.mark.cuda
def test_flex_attention_trains_as_the_dense_mask_on_cuda(llama_dir):
    """bf16 on CUDA: loss and gradients of a packed batch through compiled FlexAttention equal the dense mask's
    within bf16 rounding; the build picks it by default there."""
    from transformers import AutoModelForCausalLM

    ids, positions = (t.cuda() for t in packed_batch())
    cfg = job(llama_dir)
    results = []
    for flex in (False, True):
        model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
        if flex:  # the build's own step, with the defaults (model.attn_implementation: auto)
            attend_documents(model, cfg.model, cfg.data, torch.device("cuda"), None)
            assert model.config._attn_implementation == DOCUMENT_FLEX
        loss = model(input_ids=ids, position_ids=positions, labels=ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (dense_loss, dense_grads), (flex_loss, flex_grads) = results
    torch.testing.assert_close(flex_loss, dense_loss, rtol=1e-2, atol=1e-2)
    for name, grad in dense_grads.items():
        scale = float(grad.abs().max()) or 1.0
        torch.testing.assert_close(flex_grads[name], grad, rtol=0, atol=3e-2 * scale, msg=name)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 8])
def test_ulysses_flex_attention_trains_as_the_dense_mask_on_cuda(window):
    """bf16 on CUDA, the Ulysses wrapper in a world of one rank (nccl): compiled FlexAttention through the block mask
    compiled from the documents gives the outputs and query/key/value gradients of sdpa through the dense mask
    within bf16 rounding, with and without a sliding window."""
    import torch.distributed as dist

    from fsdp2kit.distributed import destroy_process_group

    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 2, 4, LENGTH, 16, generator=generator).to("cuda", torch.bfloat16).unbind(0)
    weights = torch.randn(2, LENGTH, 4, 16, generator=generator).cuda()
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        results = []
        for inner in ("sdpa", DOCUMENT_FLEX):
            leaves = [t.clone().requires_grad_() for t in qkv]
            output = ulysses_attention(inner, True, window, leaves).float()
            (output * weights).sum().backward()
            results.append([output, *(t.grad.float() for t in leaves)])
    finally:
        destroy_process_group()
    for name, dense, flex in zip(("output", "query", "key", "value"), *results, strict=True):
        scale = float(dense.abs().max()) or 1.0
        torch.testing.assert_close(flex, dense, rtol=0, atol=2e-2 * scale, msg=name)
