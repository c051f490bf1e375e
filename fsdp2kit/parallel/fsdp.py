"""`apply_fsdp`: one `fully_shard` per planned group, bottom-up, then the root; mixed precision, reshard, offload,
ignored parameters and explicit prefetch as the plan says."""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.mesh import divisors
from fsdp2kit.parallel.plan import ShardingPlan
from fsdp2kit.parallel.replica_reduce import reduce_across_replicas, replicas_reduce_asynchronously, shard_group_of_one


def _mp_policy(plan: ShardingPlan, master_dtype: torch.dtype, cast_inputs: bool, root: bool) -> MixedPrecisionPolicy:
    """output_dtype is the dtype of the model's outputs, so only the root casts to it: inner groups that did would
    hand the next module (e.g. the LM head) inputs of another dtype than its weights."""
    param_dtype = torch_dtype(plan.param_dtype)
    reduce_dtype = torch_dtype(plan.reduce_dtype)
    return MixedPrecisionPolicy(
        param_dtype=None if param_dtype == master_dtype else param_dtype,
        reduce_dtype=None if reduce_dtype == param_dtype else reduce_dtype,
        output_dtype=torch_dtype(plan.output_dtype) if root else None,
        cast_forward_inputs=cast_inputs,
    )


def _check_reshard(reshard: bool | int, mesh: DeviceMesh) -> None:
    shard_size = mesh.size(mesh.ndim - 1)  # the shard dimension is the last one ([fsdp] or [ddp, fsdp])
    if not isinstance(reshard, bool) and (reshard < 1 or shard_size % reshard):
        raise UserError(
            f"strategy_config.reshard_after_forward = {reshard}: an integer must divide the shard group "
            f"size {shard_size}; valid: true, false or one of {divisors(shard_size)}"
        )


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh, plan: ShardingPlan, meshes: dict[str, DeviceMesh] | None = None
) -> list[FSDPModule]:
    """Shard `model` in place; returns the non-root shard groups in forward order. The groups the plan puts on
    another mesh (`plan.group_meshes`: the experts under expert parallelism) are sharded over `meshes[its name]`."""
    if plan.offload and not torch.cuda.is_available():
        raise UserError(
            "strategy_config.offload_policy: CPU offload needs an accelerator (CUDA) and this machine "
            "has none; set offload_policy: false"
        )
    _check_reshard(plan.reshard_after_forward, mesh)
    master_dtype = next(model.parameters()).dtype
    ignored = {p for name in plan.ignored_modules for p in model.get_submodule(name).parameters()}
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=plan.pin_memory) if plan.offload else OffloadPolicy()
    replicated = replicas_reduce_asynchronously(mesh)
    common: dict[str, Any] = dict(
        mesh=shard_group_of_one(mesh) if replicated else mesh,
        reshard_after_forward=plan.reshard_after_forward,
        offload_policy=offload,
        ignored_params=ignored or None,
    )

    def shard(names: tuple[str, ...]) -> None:
        cast_inputs = plan.cast_forward_inputs and not set(names) & set(plan.no_cast_modules)
        policy = _mp_policy(plan, master_dtype, cast_inputs, root=False)
        modules = [model.get_submodule(n) for n in names]
        own_mesh = plan.group_meshes.get(names[0])
        options = dict(common, mp_policy=policy)
        if own_mesh is not None:  # an integer reshard_after_forward names a group size of the dense mesh
            reshard = plan.reshard_after_forward
            options.update(mesh=(meshes or {})[own_mesh], reshard_after_forward=reshard is not False)
        fully_shard(modules[0] if len(modules) == 1 else modules, **options)

    groups: list[FSDPModule]
    if plan.custom:
        groups = _own_groups(
            model, dict(common, mp_policy=_mp_policy(plan, master_dtype, plan.cast_forward_inputs, False))
        )
    else:
        for names in reversed(plan.groups):  # bottom-up: inner groups before the modules that contain them
            shard(names)
        groups = [cast(FSDPModule, model.get_submodule(names[0])) for names in plan.groups]
    # The root keeps whatever no group took (embeddings, final norm, head). It is never resharded after forward:
    # backward needs it at once (FSDP's own default, which an explicit reshard_after_forward would override).
    # Its inputs are not cast when a vision encoder must see its pixel values in full precision.
    root_cast = plan.cast_forward_inputs and not plan.no_cast_modules
    fully_shard(
        model,
        mp_policy=_mp_policy(plan, master_dtype, root_cast, root=True),
        **dict(common, reshard_after_forward=False),
    )
    if replicated:
        dense = [g for g, names in zip(groups, plan.groups, strict=True) if names[0] not in plan.group_meshes]
        reduce_across_replicas([*dense, cast(FSDPModule, model)], mesh, torch_dtype(plan.reduce_dtype) == master_dtype)
    _set_prefetch(groups, plan.forward_prefetch, plan.backward_prefetch)
    return groups


def _own_groups(model: nn.Module, options: dict[str, Any]) -> list[FSDPModule]:
    """The model's own `_fully_shard` decides the groups; one entry per fully_shard call (a group of several modules
    shares one FSDP state)."""
    model._fully_shard(options)  # type: ignore[operator]  # the model's own method
    states: dict[int, FSDPModule] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule) and module is not model:
            states.setdefault(id(module._get_fsdp_state()), module)
    return list(states.values())


def stays_gathered(model: nn.Module) -> bool:
    """Whether every shard group keeps its gathered parameters after forward (reshard_after_forward false: ZeRO-2,
    NO_SHARD). Then nothing more is held if they stay gathered between the micro-batches of a step too, since the
    next forward gathers them all again and holds them to its end; FSDP1's SHARD_GRAD_OP does the same."""
    states = fsdp_states(model)
    return bool(states) and all(_live_reshard(state) in (False, None) for state in states)


def before_micro_batch(model: nn.Module, last: bool, sync_each_batch: bool, gathered: bool) -> None:
    """Gradients reduced after the last micro-batch of a step only (or after each, `sync_each_batch`); where the
    groups stay gathered (`stays_gathered`), they are released after the last one only: one gather (or, on a shard
    group of one, one copy) per step instead of one per micro-batch."""
    cast(FSDPModule, model).set_requires_gradient_sync(sync_each_batch or last)
    if gathered:
        cast(FSDPModule, model).set_reshard_after_backward(last)


def discard_unreduced_grads(model: nn.Module) -> None:
    """Drop the gradients FSDP holds unsharded between the micro-batches of a step (gradient sync off until the
    last): after a step that failed part-way, the next starts from none. Its sharded `.grad`s are the optimizer's."""
    for state in fsdp_states(model):
        group = state._fsdp_param_group  # (private) the group's parameters with their unsharded gradients
        for param in group.fsdp_params if group is not None else []:
            param.unsharded_accumulated_grad = None  # the reduce-dtype accumulation
            unsharded = getattr(param, "_unsharded_param", None)  # set at the first all-gather
            if unsharded is not None:
                unsharded.grad = None


def shard_device(plan: ShardingPlan, device: torch.device) -> torch.device:
    """Where this rank's shards live: on the host under CPU offload (FSDP copies each group to `device` for its
    all-gather and its gradients back, and the optimizer steps the shards on the host), else on `device`."""
    return torch.device("cpu") if plan.offload else device


def _set_prefetch(groups: list[FSDPModule], forward: int, backward: int) -> None:
    """Explicit prefetch along the forward order (FSDP2's own default is 1 implicit backward prefetch)."""
    if len(groups) < 2:
        return
    for i, group in enumerate(groups):
        if forward:
            group.set_modules_to_forward_prefetch(groups[i + 1 : i + 1 + forward])
        if backward != 1:
            group.set_modules_to_backward_prefetch(list(reversed(groups[max(0, i - backward) : i])))


def fsdp_states(model: nn.Module) -> list[Any]:
    """Each `fully_shard` call's (private) state, once, in module order: a group of several modules shares one."""
    return list(dict.fromkeys(m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)))


def describe_groups(model: nn.Module) -> list[dict]:
    """Each `fully_shard` call as FSDP recorded it, read back from its (private) state so that `fsdp2kit check`
    shows what was done, not what was meant. A group is named by its first module ('' is the root)."""
    names = {id(m): n for n, m in model.named_modules()}
    states = fsdp_states(model)

    def name(state: Any) -> str:
        return names[id(state._modules[0])]

    def dtype(value: torch.dtype) -> str:
        return str(value).removeprefix("torch.")

    master = next(model.parameters()).dtype
    groups = []
    for state in states:
        policy = state._mp_policy
        param_dtype = policy.param_dtype or master  # FSDP's defaults: compute in the master dtype,
        reduce_dtype = policy.reduce_dtype or param_dtype  # reduce in the compute dtype
        groups.append(
            {
                "modules": [names[id(m)] for m in state._modules],
                "reshard_after_forward": _live_reshard(state),
                "param_dtype": dtype(param_dtype),
                "reduce_dtype": dtype(reduce_dtype),
                "output_dtype": policy.output_dtype and dtype(policy.output_dtype),
                "cast_forward_inputs": policy.cast_forward_inputs,
                "forward_prefetch": [name(s) for s in state._states_to_forward_prefetch],
                "backward_prefetch": [name(s) for s in state._states_to_backward_prefetch],
                "gradient_reduce": _gradient_reduce(state),
            }
        )
    return groups


def _gradient_reduce(state: Any) -> str | None:
    """How the group's gradients meet: FSDP's reduce-scatter over the shard group, its all-reduce over the replicas
    (HSDP), or the replicas' all-reduce issued without waiting (NO_SHARD on gloo: parallel/replica_reduce.py)."""
    group = state._fsdp_param_group  # one a state (fully_shard once a module): torch 2.11's attribute, 2.13's property
    if group is None:
        return None
    if group._all_reduce_hook is not None:
        return "all-reduce across the replicas, overlapped with backward"
    shard, replicas = group.mesh_info.shard_mesh_size, getattr(group.mesh_info, "replicate_mesh_size", 1)
    steps = [f"reduce-scatter over {shard} ranks"] if shard > 1 else []
    steps += [f"all-reduce over {replicas} replicas"] if replicas > 1 else []
    return ", then ".join(steps) or "none (one rank)"


def _live_reshard(state: Any) -> bool | int | None:
    """True (reshard to the full shard group), False, or the size of the smaller group; None: no parameters."""
    group = state._fsdp_param_group
    if group is None:
        return None
    if group.post_forward_mesh_info is None:
        return False
    size = group.post_forward_mesh_info.shard_mesh_size
    return True if size == group.mesh_info.shard_mesh_size else size
