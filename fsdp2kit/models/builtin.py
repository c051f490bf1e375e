"""Built-in tiny model configs: real `transformers` architectures, small enough to train on a laptop CPU."""

from __future__ import annotations

from typing import Any

from fsdp2kit.data.builtin import VOCAB_SIZE
from fsdp2kit.models.vl import BUILTIN_VL_MODELS

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "initializer_range": 0.02,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "tiny-llama": {"model_type": "llama", **_COMMON, "tie_word_embeddings": False},
    "tiny-qwen3": {"model_type": "qwen3", **_COMMON, "head_dim": 64, "tie_word_embeddings": True},
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe",
        **_COMMON,
        "tie_word_embeddings": False,  # head_dim: 256 / 4 = 64 by default
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 128,
        "decoder_sparse_step": 1,
        "output_router_logits": True,
        "router_aux_loss_coef": 0.001,
    },
    **BUILTIN_VL_MODELS,
}
