"""MFU's numerator, FLOPs per token, in the PaLM / torchtitan convention, on shapes counted by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp2kit.models.builtin import BUILTIN_MODELS
from fsdp2kit.train.metrics import flops_per_token

# The Llama-3.2-1B shape of issue 31: 1.50B parameters, an untied 128256 x 2048 head.
LLAMA_1B = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    tie_word_embeddings=False,
)


def meta_model(model_type: str, **settings) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **settings))


def test_the_1b_llama_counts_6_per_weight_without_the_input_embedding_plus_attention():
    model = meta_model("llama", **LLAMA_1B)
    layer = 2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192 + 2 * 2048  # q, o; k, v (8 of 32 heads); MLP; norms
    weights = 16 * layer + 2048 + 128256 * 2048  # the layers, the final norm, the head
    assert sum(p.numel() for p in model.parameters()) == weights + 128256 * 2048 == 1_498_482_688
    assert flops_per_token(model, 2048) == 6 * weights + 12 * 16 * 2048 * 2048 == 8_220_192_768
    # What was logged before: 6 x all parameters, the embedding table's lookup counted as a matmul (0.304 where
    # this convention gives 0.255 on the H100 run).
    assert 0.304 * flops_per_token(model, 2048) / (6 * 1_498_482_688 + 12 * 16 * 2048 * 2048) == pytest.approx(
        0.255, abs=1e-3
    )


def test_a_tied_head_multiplies_by_the_table_and_frozen_weights_count_4():
    settings = dict(BUILTIN_MODELS["tiny-qwen3"], num_hidden_layers=2)
    model = meta_model(settings.pop("model_type"), **settings)  # tie_word_embeddings: True, head_dim 64 x 4 heads
    total = sum(p.numel() for p in model.parameters())  # the tied table once
    attention = 12 * 2 * 4 * 64 * 512
    assert flops_per_token(model, 512) == 6 * total + attention
    frozen = model.model.layers[0]
    for param in frozen.parameters():
        param.requires_grad_(False)
    assert flops_per_token(model, 512) == 6 * total - 2 * sum(p.numel() for p in frozen.parameters()) + attention


def test_routed_experts_count_in_the_share_of_tokens_they_see():
    settings = dict(BUILTIN_MODELS["tiny-qwen3-moe"], num_hidden_layers=2)
    model = meta_model(settings.pop("model_type"), **settings)  # 4 experts, 2 per token
    experts = sum(p.numel() for layer in model.model.layers for p in layer.mlp.experts.parameters())
    dense = sum(p.numel() for p in model.parameters()) - experts - model.model.embed_tokens.weight.numel()
    assert experts > 0
    assert flops_per_token(model, 256) == 6 * dense + 6 * experts * 2 / 4 + 12 * 2 * 4 * 64 * 256
