"""From the model, strategy and data sections to a sharded model on this rank: the steps `train`, `infer`, `check`
and `plan` share. The sharding plan is built on the meta device and applied as it is; `materialize=False` stops
there (the plan and the FSDP groups, no weights), which is what `check` prints."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from fsdp2kit.config.schema import DataConfig, ModelConfig, StrategyConfig
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import UserError
from fsdp2kit.models.build import (
    ModelSource,
    build_meta_model,
    materialise,
    resolve_model,
)
from fsdp2kit.models.variant import ModelVariant, pick_variant
from fsdp2kit.parallel.activation_offload import PinnedHost, apply_activation_offload
from fsdp2kit.parallel.compile import compile_modules
from fsdp2kit.parallel.document_attention import attend_documents
from fsdp2kit.parallel.expert_parallel import apply_expert_parallel, check_expert_sizes, expert_meshes
from fsdp2kit.parallel.float8 import apply_float8, grouped_matmul_modules
from fsdp2kit.parallel.fsdp import apply_fsdp, shard_device
from fsdp2kit.parallel.mesh import MeshLayout, build_expert_mesh, build_mesh, mesh_layout, sequence_parallel_group
from fsdp2kit.parallel.moe import gather_router_logits, routed_expert_count, set_experts_implementation
from fsdp2kit.parallel.plan import ShardingPlan, build_plan
from fsdp2kit.parallel.recompute import apply_recompute
from fsdp2kit.parallel.tensor_parallel import apply_tensor_parallel
from fsdp2kit.parallel.tiled_mlp import apply_tiled_mlp
from fsdp2kit.parallel.token_logprobs import head_name
from fsdp2kit.parallel.ulysses import apply_ulysses


@dataclass
class ShardedModel:
    model: nn.Module
    plan: ShardingPlan
    layout: MeshLayout
    source: ModelSource
    sp_group: ProcessGroup | None  # this rank's sequence group (Ulysses x context parallel); None without
    variant: ModelVariant  # what kind of model it is, and what differs with that


def build_sharded_model(
    model_cfg: ModelConfig,
    strategy: StrategyConfig,
    data: DataConfig,
    runtime: Runtime,
    *,
    training: bool,
    seed: int,
    compile_layers: bool = False,
    materialize: bool = True,
) -> ShardedModel:
    """Meta-device model -> the variant's patches (split experts, LoRA adapters, vision Ulysses), Ulysses attention
    -> plan -> freeze -> float8 linears -> recompute, TiledMLP, the variant's patches (expert, vision) -> fully_shard ->
    (materialise each rank's shards). Training keeps fp32 master weights and computes in `param_dtype` (default:
    model.dtype); a LoRA base is frozen, so it stays in model.dtype. From `data`: the tokenizer (default: the model's
    own; the readers of data check it against the model, `check_data_fits`); fresh weights come from `seed`;
    `compile_layers` (training.compile) compiles each decoder layer when training."""
    source = resolve_model(model_cfg, data.tokenizer)
    variant = pick_variant(source.hf_config, model_cfg, strategy)
    check_expert_sizes(runtime.world_size, strategy, routed_expert_count(source.hf_config))
    sizes = model_cfg.ulysses_size, model_cfg.context_parallel_size, model_cfg.tensor_parallel_size
    layout = mesh_layout(runtime.world_size, strategy, *sizes)
    mesh = build_mesh(runtime.device.type, layout)
    expert_mesh = build_expert_mesh(runtime.device.type, layout)
    sp_group = sequence_parallel_group(layout)
    master_dtype = variant.master_dtype(training, model_cfg.dtype)
    model = build_meta_model(source, model_cfg.model_copy(update={"dtype": master_dtype}))
    variant.head.check_model(model)  # a head fsdp2kit does not serve: refused here, in `check` as in a run
    variant.flex_documents = attend_documents(model, model_cfg, data, runtime.device, variant.attention_config)
    if sp_group is not None:
        apply_ulysses(model, sp_group, variant.attention_config)
        gather_router_logits(model, sp_group)  # the MoE load-balancing loss over the whole sequence (the group's)
    variant.patch_meta(model, sp_group)
    set_experts_implementation(model, strategy.moe_use_grouped_mm)
    plan = build_plan(model, strategy, model_cfg, compile_layers=training and compile_layers)
    variant.after_plan(model, plan)
    frozen = set(plan.frozen_parameters)
    for name, param in model.named_parameters():
        param.requires_grad_(training and name not in frozen)
    _split_layers(model, mesh, layout, model_cfg, variant, plan)
    if training:  # before recompute and compile wrap the layers
        _float8_linears(model, strategy, plan)
    apply_recompute(model, plan.recompute_modules, plan.use_reentrant)
    apply_tiled_mlp(model, plan.tiled_mlp_modules, plan.tiled_num_shards)
    variant.patch_sharded(model, plan)
    apply_expert_parallel(model, plan.expert_parallel, expert_mesh)
    compile_modules(model, plan.compiled_modules)
    _offload_activations(model, plan, runtime.device)
    apply_fsdp(model, mesh[layout.dense_dims] if layout.tp_size > 1 else mesh, plan, expert_meshes(expert_mesh))
    if materialize:
        shards_on = shard_device(plan, runtime.device)
        materialise(model, source, runtime.device, seed, model_cfg.weights_loading, shards_on, variant.tensor_leeway)
        variant.materialise(model, seed)
    if not training:
        model.eval()
    return ShardedModel(model, plan, layout, source, sp_group, variant)


def _split_layers(
    model: nn.Module, mesh: DeviceMesh, layout: MeshLayout, cfg: ModelConfig, variant: ModelVariant, plan: ShardingPlan
) -> None:
    """Tensor parallelism over the mesh's `tp` dimension (none without one), noted in the plan. A model without an
    LM head (a value or reward model's scalar head) is refused: its head's loss is not the vocabulary's."""
    if layout.tp_size == 1:
        return
    if model.get_output_embeddings() is None:  # type: ignore[operator]
        raise UserError(
            f"model.tensor_parallel_size = {layout.tp_size}: tensor parallelism serves causal LMs (the LM head split "
            f"by vocabulary); {type(model).__name__} has no LM head; set model.tensor_parallel_size: 1"
        )
    own_plan: dict[str, str] = dict(cfg.tensor_parallel_plan)
    split = apply_tensor_parallel(model, mesh["tp"], head_name(model), variant.split_modules, own_plan)
    if split:
        whose = "model.tensor_parallel_plan" if own_plan else "the family's transformers TP plan"
        plan.notes.append(
            f"tensor parallel {layout.tp_size}: {len(split)} modules split by {whose}, the LM head by vocabulary "
            "(log-probs and loss on its shards)"
        )


def _float8_linears(model: nn.Module, strategy: StrategyConfig, plan: ShardingPlan) -> None:
    """torchao's float8 on the chosen linears (none unless strategy_config.float8.enabled), noted in the plan with
    what stays in the compute dtype."""
    float8 = apply_float8(model, strategy.float8)
    if float8:
        grouped = grouped_matmul_modules(model)
        plan.notes.append(
            f"float8 ({strategy.float8.recipe}): {len(float8)} linears matmul in float8 (torchao)"
            + (f"; {len(grouped)} fused experts' grouped matmuls stay in the compute dtype" if grouped else "")
        )


def check_expert_parallel(world_size: int, model_cfg: ModelConfig, strategy: StrategyConfig, data: DataConfig) -> None:
    """ep_size against the world and the model's experts (its config's count) together, as the command line checks
    the mesh before it starts the ranks: a refusal offers only the sizes valid for both."""
    if strategy.ep_size > 1:
        source = resolve_model(model_cfg, data.tokenizer)
        check_expert_sizes(world_size, strategy, routed_expert_count(source.hf_config))


def _offload_activations(model: nn.Module, plan: ShardingPlan, device: torch.device) -> None:
    """On CUDA the planned modules' saved activations go to pinned host memory; on a CPU they are in host memory
    already, so nothing moves (noted)."""
    if not plan.activation_offload_modules:
        return
    if device.type == "cuda":
        apply_activation_offload(model, plan.activation_offload_modules, PinnedHost(device), device)
    else:
        plan.notes.append(
            f"activation_offload_modules ({len(plan.activation_offload_modules)} modules): a no-op on {device.type}, "
            "where activations already live in host memory"
        )


def count_parameters(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of the full (unsharded) model."""
    seen: dict[int, torch.Tensor] = {id(p): p for p in model.parameters()}
    trainable = sum(p.numel() for p in seen.values() if p.requires_grad)
    return trainable, sum(p.numel() for p in seen.values()) - trainable
