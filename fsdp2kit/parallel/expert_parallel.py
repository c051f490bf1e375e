"""Expert parallelism (`strategy_config.ep_size`), as ROLL and torchtitan lay it out: each group of ep_size
consecutive ranks splits every MoE layer's experts among its ranks, and each token goes to the rank of each expert
it was routed to and back, by all-to-all.

Each fused experts module (`Qwen3MoeExperts`: 3-D `gate_up_proj` / `down_proj`, experts first) keeps its names and
full shapes: its parameters become DTensors sharded by expert over the mesh's `ep` dimension, and FSDP shards each
rank's experts further over `efsdp` (parallel/fsdp.py). So a checkpoint, an export or `full_weights` holds the same
tensors with and without expert parallelism, and DCP reshards them to another ep_size.

The router and everything around the experts run as before, on this rank's tokens. Only the experts' forward is
replaced: the (token, expert) pairs are sorted by expert, sent to the experts' ranks, computed there by the family's
own experts forward (transformers' experts interface: eager loop or grouped GEMMs) on this rank's experts, sent back,
weighted by their routing weights and summed over each token's experts (as torchtitan and ROLL combine them). The
gradients come back by the same two exchanges in the same order on every rank, whatever the routing: a rank that
received no token still joins its experts' gradient reduction, with zero gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._guards import detect_fake_mode
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fsdp2kit.config.schema import ModelConfig, StrategyConfig
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.forward_patch import Forward, replace_forward
from fsdp2kit.parallel.mesh import MeshLayout, divisors
from fsdp2kit.parallel.moe import moe_experts

EXPERT_MESH = "experts"  # the name the plan gives the experts' shard mesh (`expert_meshes`)


def expert_parallel_plan(
    model: nn.Module, strategy: StrategyConfig, model_cfg: ModelConfig, notes: list[str]
) -> list[str]:
    """The experts modules split over the EP ranks; what expert parallelism does not combine with is refused in
    one line."""
    if strategy.ep_size == 1:
        if strategy.efsdp_size > 1:
            notes.append(f"efsdp_size {strategy.efsdp_size} changes nothing: it applies with ep_size > 1 only")
        return []
    if callable(getattr(model, "_fully_shard", None)):
        raise UserError(
            f"strategy_config.ep_size = {strategy.ep_size}: the model shards itself (its own _fully_shard); "
            "set ep_size: 1"
        )
    if model_cfg.lora_enabled:
        raise UserError(
            f"strategy_config.ep_size = {strategy.ep_size}: LoRA (model.lora) with expert parallelism is not "
            "supported; set ep_size: 1"
        )
    if strategy.apply_expert_patch:
        notes.append("apply_expert_patch changes nothing under expert parallelism: each rank runs only its experts")
    return expert_parallel_modules(model, strategy.ep_size, strategy.efsdp_size)


def expert_meshes(expert_mesh: DeviceMesh | None) -> dict[str, DeviceMesh]:
    """The meshes `apply_fsdp` shards the plan's other groups over: what FSDP shards each split expert over, its
    mesh without `ep` (`efsdp`, or `[eddp, efsdp]`: HSDP); none without expert parallelism."""
    if expert_mesh is None:
        return {}
    names = tuple(expert_mesh.mesh_dim_names or ())
    return {EXPERT_MESH: expert_mesh[names[:-1]] if len(names) == 3 else expert_mesh[names[0]]}


def expert_parallel_modules(model: nn.Module, ep_size: int, efsdp_size: int) -> list[str]:
    """The experts modules expert parallelism splits (ep_size > 1); a model it cannot split is refused in one line."""
    experts = moe_experts(model)
    if not experts:
        raise UserError(
            f"strategy_config.ep_size = {ep_size}: the model has no mixture-of-experts layers to split; valid: 1"
        )
    names = []
    for name, module in experts:
        count = getattr(module, "num_experts", None)
        params = list(module.parameters(recurse=False))
        if not isinstance(count, int) or not params or any(p.ndim < 2 or p.shape[0] != count for p in params):
            raise UserError(
                f"strategy_config.ep_size = {ep_size}: '{name}' ({type(module).__name__}) does not hold its experts "
                "as fused tensors (experts first) that expert parallelism splits; set ep_size: 1 (a per-expert "
                "wrap_policy.moe_experts class splits them: name the fused class instead)"
            )
        if count % ep_size:
            raise UserError(
                f"strategy_config.ep_size = {ep_size} does not divide the {count} experts of '{name}'; valid: "
                f"{', '.join(map(str, [1, *_valid_sizes(count, efsdp_size)]))}"
            )
        names.append(name)
    return names


def _valid_sizes(count: int, efsdp_size: int) -> list[int]:
    """The ep_size values > 1 that split `count` experts and this world's ranks (every rank of a run builds the
    plan in its process group); those that split the experts where there is no process group."""
    if not dist.is_initialized():
        return [d for d in divisors(count) if d > 1]
    return expert_parallel_sizes(dist.get_world_size(), efsdp_size, count)


def check_expert_sizes(world_size: int, strategy: StrategyConfig, num_experts: int | None) -> None:
    """ep_size against both what it must divide, the world (efsdp_size x ep_size ranks hold every expert once) and
    each layer's experts (the config's count), before the mesh checks the world alone: a refusal offers only the
    sizes valid for both."""
    ep, efsdp = strategy.ep_size, strategy.efsdp_size
    if ep == 1 or num_experts is None:
        return
    valid = ", ".join(map(str, [1, *expert_parallel_sizes(world_size, efsdp, num_experts)]))
    if world_size % (ep * efsdp):
        raise UserError(
            f"strategy_config.ep_size = {ep} x efsdp_size = {efsdp} does not divide the world size {world_size}; "
            f"valid ep_size with efsdp_size {efsdp} and the {num_experts} experts of each layer: {valid}"
        )
    if num_experts % ep:
        raise UserError(
            f"strategy_config.ep_size = {ep} does not divide the {num_experts} experts of each layer; valid ep_size "
            f"with efsdp_size {efsdp} at world size {world_size}: {valid}"
        )


def expert_parallel_sizes(world_size: int, efsdp_size: int, num_experts: int) -> list[int]:
    """The ep_size values > 1 that split both the world's ranks (efsdp_size x ep_size of them hold every expert once)
    and each layer's experts."""
    if world_size % efsdp_size:
        return []
    return [d for d in divisors(world_size // efsdp_size) if d > 1 and num_experts % d == 0]


def _count(module: nn.Module) -> int:
    return int(module.num_experts)  # type: ignore[arg-type]  # every fused experts module has it (checked above)


def experts_of_rank(num_experts: int, ep_size: int, ep_rank: int) -> range:
    """The experts an EP rank holds: a contiguous block, as DTensor's Shard(0) cuts."""
    local = num_experts // ep_size
    return range(ep_rank * local, (ep_rank + 1) * local)


def describe_expert_parallel(model: nn.Module, names: list[str], layout: MeshLayout) -> dict[str, Any] | None:
    """For `check`: the experts' mesh, the modules split over it and which experts each rank holds (`ep` is the
    mesh's innermost dimension: rank r is EP rank r mod ep_size)."""
    if not names:
        return None
    shape, dim_names = layout.expert_shape
    counts = sorted({_count(model.get_submodule(name)) for name in names})
    return {
        "mesh": {"shape": list(shape), "dim_names": list(dim_names)},
        "modules": names,
        "experts_by_rank": {
            f"{count} experts": [
                list(experts_of_rank(count, layout.ep_size, rank % layout.ep_size)) for rank in range(layout.world_size)
            ]
            for count in counts
        },
    }


def apply_expert_parallel(model: nn.Module, names: list[str], expert_mesh: DeviceMesh | None) -> None:
    """Split each named experts module over the `ep` dimension of `expert_mesh` (its parameters become
    expert-sharded DTensors, on whatever device they are: the meta device before materialising) and send its tokens
    to their experts' ranks."""
    if not names:
        return
    assert expert_mesh is not None  # build_expert_mesh made it, as the layout has ep_size > 1
    ep_mesh = expert_mesh["ep"]
    ep_rank, ep_size = ep_mesh.get_local_rank(), ep_mesh.size()
    for name in names:
        module = model.get_submodule(name)
        rows = experts_of_rank(_count(module), ep_size, ep_rank)
        for key, param in list(module.named_parameters(recurse=False)):
            local = param.detach()[rows.start : rows.stop]
            sharded = DTensor.from_local(
                local, ep_mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride()
            )
            module.register_parameter(key, nn.Parameter(sharded, requires_grad=param.requires_grad))
    replace_forward(model, names, lambda module, forward: _dispatching(module, ep_mesh))


class _LocalExperts:
    """The experts module as its family's forward sees it here: this rank's experts only (their weights as local
    tensors, their count); every other attribute (activation, config, flags) is the module's own."""

    def __init__(self, module: nn.Module, weights: dict[str, torch.Tensor], count: int) -> None:
        self.__dict__.update(_module=module, _weights=weights, num_experts=count)

    def __getattr__(self, name: str) -> Any:
        weights = self.__dict__["_weights"]
        return weights[name] if name in weights else getattr(self.__dict__["_module"], name)


def _exchange(rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
    """Send `send[r]` consecutive rows to rank r of the group; the rows that arrive, in rank order."""
    arrived = rows.new_empty(sum(receive), *rows.shape[1:])
    dist.all_to_all_single(arrived, rows.contiguous(), receive, send, group=group)
    return arrived


class _Exchange(torch.autograd.Function):
    """`_exchange` with its gradient: the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, send: list[int], receive: list[int], group: ProcessGroup) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


class _SumOverEP(torch.autograd.Function):
    """Identity forward; the gradient divided by ep_size. An expert's gradient sums the tokens of the EP group's
    ep_size ranks, and FSDP then averages it over the expert mesh's other ranks: divided by ep_size too, it is
    the average over the world, as every dense gradient is."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, ep_size: int) -> torch.Tensor:
        ctx.ep_size = ep_size
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.ep_size, None


def _routes(experts: torch.Tensor, num_experts: int, group: ProcessGroup) -> tuple[list[int], list[int], torch.Tensor]:
    """(how many pairs go to each EP rank, how many arrive from each, the local expert of each arriving pair, in the
    order they arrive: by source rank, then by expert). One exchange of per-expert counts, read on the host."""
    ep_size = group.size()
    local_count = num_experts // ep_size
    if detect_fake_mode(experts) is not None:  # `plan` traces on fake tensors, which hold no routing: balanced
        pairs = experts.numel()
        send = [pairs // ep_size + (rank < pairs % ep_size) for rank in range(ep_size)]
        arriving_pairs = sum(send)  # every rank sends this rank its share, the same as it sends
        return send, send, torch.arange(arriving_pairs, device=experts.device) % local_count
    counts = torch.bincount(experts, minlength=num_experts)
    arriving = torch.empty_like(counts)  # per source rank, how many pairs come for each of this rank's experts
    dist.all_to_all_single(arriving, counts, group=group)
    send, receive = torch.stack([counts.view(ep_size, -1).sum(1), arriving.view(ep_size, -1).sum(1)]).tolist()
    local_index = torch.arange(local_count, device=experts.device).repeat(ep_size)
    return send, receive, local_index.repeat_interleave(arriving)


def _dispatching(module: nn.Module, ep_mesh: DeviceMesh) -> Forward:
    group, ep_size = ep_mesh.get_group(), ep_mesh.size()
    family_forward = type(module).forward  # transformers' experts interface picks the implementation

    def forward_ep(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        tokens, top_k = top_k_index.shape
        local_count = _count(module) // ep_size
        experts = top_k_index.reshape(-1)
        order = torch.argsort(experts, stable=True)  # the (token, expert) pairs, by expert: by destination rank
        send, receive, local_index = _routes(experts, _count(module), group)
        routed = _Exchange.apply(hidden_states[order // top_k], send, receive, group)
        local = {
            key: _SumOverEP.apply(param.to_local(), ep_size) if isinstance(param, DTensor) else param
            for key, param in module.named_parameters(recurse=False)
        }
        unweighted = torch.ones_like(local_index, dtype=top_k_weights.dtype)[:, None]
        out = family_forward(_LocalExperts(module, local, local_count), routed, local_index[:, None], unweighted)
        if not sum(receive):  # no token here: still one graph through the weights and the exchange, as elsewhere
            out = out + (routed.sum() + sum(w.sum() for w in local.values())) * 0
        back = _Exchange.apply(out, receive, send, group)
        weighted = back * top_k_weights.reshape(-1)[order, None]  # the routing weights, applied where they live
        pairs = torch.empty_like(weighted).index_copy(0, order, weighted)  # back in (token, expert) order
        return pairs.view(tokens, top_k, -1).sum(1).to(hidden_states.dtype)

    return forward_ep
