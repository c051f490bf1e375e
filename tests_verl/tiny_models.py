"""The tiny models the verl tests load: a 2-layer Qwen2 built with from_config (a causal LM for the actor and the
reference, the same body with a one-label token-classification head for the critic), saved with fsdp2kit's built-in
tokenizer (verl's HFModelConfig loads one)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from fsdp2kit.data.builtin import tokenizer_dir

SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def tiny_qwen2(folder: Path, critic: bool = False) -> Path:
    config = Qwen2Config(vocab_size=512, num_hidden_layers=2, max_position_embeddings=256, **SIZES)
    if critic:
        config.num_labels = 1
    torch.manual_seed(3)
    model = (Qwen2ForTokenClassification if critic else Qwen2ForCausalLM)(config)
    model.save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, folder / file.name)
    return folder
