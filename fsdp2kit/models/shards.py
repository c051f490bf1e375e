"""Filling one rank's shard of a parameter from a full tensor, and the per-module seeds of fresh weights:
shared by base-model loading (`models.build`) and adapter loading (`models.lora`); and the other way, a rank's
shard of a tensor with where it sits in the whole (`WeightShard`), which weight sync sends without a gather."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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


@dataclass(frozen=True)
class WeightShard:
    """One rank's block of one tensor of the HF folder: `local` is `full[o0 : o0 + l0, o1 : o1 + l1, ...]` for
    `offset` (o0, o1, ...) and `local.shape` (l0, l1, ...). `contributes` is False on a rank whose block another
    rank also holds and sends (HSDP's replicas, a tensor every rank holds whole): it keeps the ranks in step."""

    name: str
    local: torch.Tensor
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    contributes: bool


def shard_of(name: str, tensor: torch.Tensor, dtype: torch.dtype | None) -> WeightShard:
    """This rank's block of a (sharded or whole) tensor and where it sits, from its DTensor placements: a copy (in
    `dtype`), never the live shard, which the next step changes in place."""
    full_shape = tuple(tensor.shape)
    dtype = dtype if tensor.is_floating_point() else None  # the rollout dtype is a float's: an integer stays one
    if not isinstance(tensor, DTensor):  # held whole on every rank: the first rank sends it
        first = not dist.is_initialized() or dist.get_rank() == 0
        return WeightShard(name, tensor.to(dtype or tensor.dtype, copy=True), full_shape, (0,) * tensor.dim(), first)
    local = tensor.to_local()
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    if tuple(shape) != tuple(local.shape):
        raise RuntimeError(
            f"{name}: the local shard {tuple(local.shape)} is not the block {tuple(shape)} its "
            f"placements {tensor.placements} give"
        )
    coordinate = list(tensor.device_mesh.get_coordinate() or ())
    replicas = [c for c, p in zip(coordinate, tensor.placements, strict=True) if p.is_replicate()]
    return WeightShard(name, local.to(dtype or local.dtype, copy=True), full_shape, tuple(offset), not any(replicas))


@dataclass(frozen=True)
class SyncedWeights:
    """One part of the weights a rollout engine can load to follow the model: "model" (every tensor, in the HF
    folder's names) or a variant's own ("adapter": a LoRA run's adapters in peft's file names), whole (`tensors`, a
    collective) or as this rank's blocks (`shards`), and what its loader reads beside them (`config`)."""

    part: str
    tensors: Callable[[torch.dtype | None], Iterator[tuple[str, torch.Tensor]]]
    shards: Callable[[torch.dtype | None], Iterator[WeightShard]]
    config: dict[str, Any] | None = None
