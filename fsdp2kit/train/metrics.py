"""Per-step measurements: model FLOPs per token and the device's peak FLOP/s (for MFU)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fsdp2kit.parallel.moe import routed_shares

# Dense bf16 peak FLOP/s of common accelerators (no sparsity): MFU's denominator (H100 SXM: 989 TFLOP/s).
PEAK_FLOPS = {
    "H100": 989e12,
    "H200": 989e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
    "B200": 2250e12,
}


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token, in the convention of PaLM (appendix B) and torchtitan, so that MFU compares across
    systems: 6 per weight that multiplies (2 forward, 4 backward: the input's and the weight's gradients), 4 per
    frozen one (no weight gradient), routed experts in the share of tokens they see (num_experts_per_tok / experts),
    and attention's score and value matmuls, 12 x layers x (heads x head_dim) x seq_len (heads x head_dim is the
    hidden size in most models). The input embedding table is a lookup, not a matmul: it counts only where the
    LM head multiplies by it (tied)."""
    hf: Any = model  # a transformers model: its embeddings and config
    head = hf.get_output_embeddings()
    multiplied = {id(p) for p in head.parameters()} if head is not None else set()
    lookup = {id(p) for p in hf.get_input_embeddings().parameters()} - multiplied
    shares = routed_shares(model)
    params = {id(p): p for p in model.parameters() if id(p) not in lookup}
    weights = sum((6 if p.requires_grad else 4) * p.numel() * shares.get(key, 1.0) for key, p in params.items())
    text = hf.config.get_text_config()
    heads = getattr(text, "num_attention_heads", 0) or 0
    head_dim = getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0)
    return weights + 12.0 * getattr(text, "num_hidden_layers", 0) * heads * head_dim * seq_len


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
