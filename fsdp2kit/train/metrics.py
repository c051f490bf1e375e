"""Per-step measurements: model FLOPs per token and the device's peak FLOP/s (for MFU)."""

from __future__ import annotations

from typing import Any

import torch

# Dense bf16 peak FLOP/s of common accelerators (no sparsity).
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


def flops_per_token(hf_config: Any, num_params: int, seq_len: int) -> float:
    """6N for the weights (forward + backward) plus the attention score/value matmuls: 12 * layers * hidden * seq."""
    layers = getattr(hf_config, "num_hidden_layers", 0)
    hidden = getattr(hf_config, "hidden_size", 0)
    return 6.0 * num_params + 12.0 * layers * hidden * seq_len


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_FLOPS.items() if key in name), None)
