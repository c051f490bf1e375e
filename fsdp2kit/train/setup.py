"""From a config to a sharded model: the steps `train`, `infer` and `check` share."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.distributed import Runtime
from fsdp2kit.models.build import (
    TORCH_DTYPES,
    ModelSource,
    build_meta_model,
    check_sequence_length,
    materialise,
    resolve_model,
)
from fsdp2kit.models.lora import add_input_grad_hooks, inject_lora, plan_adapters
from fsdp2kit.models.vl import is_vision_language
from fsdp2kit.parallel.compile import compile_modules
from fsdp2kit.parallel.fsdp import apply_fsdp
from fsdp2kit.parallel.mesh import MeshLayout, build_mesh, mesh_layout, sequence_parallel_group
from fsdp2kit.parallel.moe import apply_expert_patch, split_experts
from fsdp2kit.parallel.plan import ShardingPlan, build_plan
from fsdp2kit.parallel.recompute import apply_recompute
from fsdp2kit.parallel.tiled_mlp import apply_tiled_mlp
from fsdp2kit.parallel.ulysses import apply_ulysses
from fsdp2kit.parallel.vision import apply_vision_patch, apply_vision_ulysses


@dataclass
class ShardedModel:
    model: nn.Module
    plan: ShardingPlan
    layout: MeshLayout
    source: ModelSource
    sp_group: ProcessGroup | None  # this rank's Ulysses sequence-parallel group; None without


def build_sharded_model(cfg: JobConfig, runtime: Runtime, training: bool, materialize: bool = True) -> ShardedModel:
    """Meta-device model -> split experts, Ulysses attention, LoRA adapters -> plan -> freeze -> recompute,
    TiledMLP, expert patch, vision patch -> fully_shard -> (materialise each rank's shards). Training keeps fp32
    master weights and computes in `param_dtype` (default: model.dtype); a LoRA base is frozen, so it stays in
    model.dtype."""
    strategy = cfg.strategy_args.strategy_config
    source = resolve_model(cfg.model, cfg.data.tokenizer)
    check_sequence_length(source.hf_config, cfg.data.seq_len)
    layout = mesh_layout(runtime.world_size, strategy, cfg.model.ulysses_size)
    mesh = build_mesh(runtime.device.type, layout)
    sp_group = sequence_parallel_group(layout)
    lora = cfg.model.lora if cfg.model.lora_enabled else None
    master_dtype = "fp32" if training and lora is None else cfg.model.dtype
    model = build_meta_model(source, cfg.model.model_copy(update={"dtype": master_dtype}))
    split_experts(model, strategy.wrap_policy.moe_experts)  # where moe_experts names a per-expert class
    if sp_group is not None:
        apply_ulysses(model, sp_group)
        if is_vision_language(source.hf_config):
            apply_vision_ulysses(model, sp_group)
    if lora is not None:
        inject_lora(model, lora, TORCH_DTYPES[lora.dtype] if lora.dtype else None)
    plan = build_plan(model, strategy, cfg.model, compile_layers=training and cfg.training.compile)
    if lora is not None:
        plan.adapters = plan_adapters(model, plan, lora)
        add_input_grad_hooks(model, plan.adapters.input_grad_hooks)
    frozen = set(plan.frozen_parameters)
    for name, param in model.named_parameters():
        param.requires_grad_(training and name not in frozen)
    apply_recompute(model, plan.recompute_modules, plan.use_reentrant)
    apply_tiled_mlp(model, plan.tiled_mlp_modules, plan.tiled_num_shards)
    if plan.expert_patch:
        apply_expert_patch(model)
    compile_modules(model, plan.compiled_modules)
    if plan.vision_patch:
        apply_vision_patch(model)
    apply_fsdp(model, mesh, plan)
    if materialize:
        adapter = lora.adapter if lora is not None else None
        materialise(model, source, runtime.device, cfg.training.seed, cfg.model.weights_loading, adapter)
    if not training:
        model.eval()
    return ShardedModel(model, plan, layout, source, sp_group)


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of the full (unsharded) model."""
    seen: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, sum(p.numel() for p in seen.values()) - trainable
