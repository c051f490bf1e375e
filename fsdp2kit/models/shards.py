"""Filling one rank's shard of a parameter from a full tensor, and the per-module seeds of fresh weights:
shared by base-model loading (`models.build`) and adapter loading (`models.lora`)."""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


def local_index(param: DTensor) -> tuple[slice, ...]:
    """Where this rank's shard of a sharded parameter sits in the full tensor."""
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))


@torch.no_grad()
def copy_to_shard(param: torch.Tensor, full: Any) -> None:
    """Copy this rank's part of `full` (a tensor, or a lazy safetensors slice that then reads only those rows) into
    `param`: a sharded DTensor, or a plain tensor that every rank holds whole (an ignored module)."""
    if not isinstance(param, DTensor):
        param.copy_((full if isinstance(full, torch.Tensor) else full[:]).to(param.dtype))
        return
    local = param.to_local()
    if local.numel():
        local.copy_(full[local_index(param)].to(local.dtype))


def module_seed(seed: int, name: str) -> int:
    """The seed of one module's fresh weights: the same at every world size and mesh."""
    return zlib.crc32(f"{seed}:{name}".encode())
