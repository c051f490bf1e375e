"""Write a sharded model as an HF safetensors folder (config, weights, tokenizer) that `transformers` loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from fsdp2kit.models.build import TORCH_DTYPES

MAX_SHARD_SIZE = "2GB"


def export_hf(model: nn.Module, out_dir: Path, tokenizer_path: Path, dtype: str, is_main: bool) -> None:
    """All ranks take part in gathering; only rank 0 holds the full state dict, on CPU."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not is_main:
        return
    hf_config = model.config
    tied = getattr(model, "_tied_weights_keys", None) or {}
    if getattr(hf_config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k not in tied}
    write_hf_folder(state, out_dir, hf_config, tokenizer_path, TORCH_DTYPES[dtype])


def write_hf_folder(state: dict[str, torch.Tensor], out_dir: Path, hf_config, tokenizer_path: Path | None,
                    dtype: torch.dtype) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(dtype).contiguous() for k, v in state.items()}
    split = split_torch_state_dict_into_shards(state, max_shard_size=MAX_SHARD_SIZE)
    for file, names in split.filename_to_tensors.items():
        save_file({n: state[n] for n in names}, str(out_dir / file), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": split.tensor_to_filename}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_config.dtype = dtype
    hf_config.save_pretrained(out_dir)
    if tokenizer_path is not None:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out_dir)
