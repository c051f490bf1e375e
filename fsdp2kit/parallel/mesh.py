"""The device mesh: 1-D `[fsdp]`, or HSDP `[ddp, fsdp]` (replicate across ddp, shard within fsdp)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.errors import UserError


@dataclass(frozen=True)
class MeshLayout:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]

    @property
    def world_size(self) -> int:
        size = 1
        for dim in self.shape:
            size *= dim
        return size


def mesh_layout(world_size: int, strategy: StrategyConfig, ulysses_size: int = 1) -> MeshLayout:
    """ROLL's rule: fsdp_size auto, <= 1 or >= world -> pure FSDP; otherwise HSDP (world/fsdp_size, fsdp_size).
    FSDP1/Accelerate names: NO_SHARD replicates everywhere; HYBRID_SHARD shards within a node by default."""
    if ulysses_size > 1:
        raise UserError("model.ulysses_size > 1: Ulysses sequence parallel is not available in this version; use 1")
    size = strategy.fsdp_size
    if strategy.sharding_strategy == "NO_SHARD":
        if size not in ("auto", None, 0, 1) and size < world_size:
            raise UserError(f"strategy_config.sharding_strategy NO_SHARD replicates on every rank; drop fsdp_size={size}")
        return MeshLayout((world_size, 1), ("ddp", "fsdp"))
    if strategy.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and size in ("auto", None):
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if size in ("auto", None) or size <= 1 or size >= world_size:
        return MeshLayout((world_size,), ("fsdp",))
    if world_size % size:
        raise UserError(f"strategy_config.fsdp_size = {size} does not divide the world size {world_size}; "
                        f"valid: 'auto' or one of {[d for d in range(1, world_size + 1) if world_size % d == 0]}")
    return MeshLayout((world_size // size, size), ("ddp", "fsdp"))


def build_mesh(device_type: str, layout: MeshLayout) -> DeviceMesh:
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.dim_names)
