"""Mixture of experts under FSDP2 (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS).

transformers 5 keeps the experts of a MoE block in one fused module (`Qwen3MoeExperts`: 3-D `gate_up_proj` and
`down_proj` parameters). `wrap_policy.moe_experts: [Qwen3MoeExperts]` shards that module as its own group: it is
called on every rank in every layer, so its collectives always match. Naming the per-expert class instead
(`[Qwen3MoeMLP]`, as ROLL does) first splits each fused module into one `Qwen3MoeMLP` per expert
(`split_experts`), with the per-expert parameter names of Qwen3-MoE checkpoints (`mlp.experts.<i>.gate_proj.weight`),
so that each expert can be its own shard group and only one expert's weights are ever gathered at a time.

A separately sharded expert all-gathers its weights when it is called and reduce-scatters its gradient in
backward. Ranks whose tokens go to different experts would call different experts: their collectives no longer
pair up, and the job hangs (gloo aborts on the size mismatch) or, where the counts agree, silently mixes up experts.
`apply_expert_patch` makes every rank call every expert in every layer, in the same order, giving an expert that
got no token a dummy token whose output is weighted by zero: the results and gradients are exactly those of the
unpatched block.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.errors import UserError
from fsdp2kit.parallel.forward_patch import Forward, replace_forward
from fsdp2kit.parallel.module_paths import model_class_name, modules_of_classes
from fsdp2kit.parallel.sequence_layout import counted_tokens


class MixtralBlockSparseTop2MLP(nn.Module):
    """One Mixtral expert as transformers 4 held it and Mixtral checkpoints store it (`w1` gate, `w3` up, `w2`
    down), under the class name ROLL's Mixtral settings give; transformers 5 has only the fused `MixtralExperts`."""

    def __init__(self, config: Any, intermediate_size: int) -> None:
        from transformers.activations import ACT2FN

        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.w2 = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.w2(self.act_fn(self.w1(hidden_states)) * self.w3(hidden_states))


# Fused experts class -> the class of one expert (a name in the fused class's modeling file, or ours): each computes
# what one expert of the fused module does (down(act(gate(x)) * up(x)), no bias) with the parameter names of the
# family's per-expert checkpoints. GPT-OSS (biases, a clamped activation) has none: its experts shard as one group.
SPLITTABLE_EXPERTS: dict[str, str | type[nn.Module]] = {
    "Qwen3MoeExperts": "Qwen3MoeMLP",
    "Qwen2MoeExperts": "Qwen2MoeMLP",
    "OlmoeExperts": "OlmoeMLP",
    "DeepseekV3Experts": "DeepseekV3MLP",
    "MixtralExperts": MixtralBlockSparseTop2MLP,
}
# A split expert's weight -> (its fused experts tensor, which half of the fused rows: 0 first, 1 second, None all)
_FUSED_ROWS = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", None),
}
_SPLIT_NAME = re.compile(rf"(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<kind>{'|'.join(_FUSED_ROWS)})\.weight")


def _per_expert_class_name(fused: str) -> str | None:
    expert = SPLITTABLE_EXPERTS.get(fused)
    return expert if isinstance(expert, str) or expert is None else expert.__name__


def _per_expert_class(module: nn.Module) -> type[nn.Module]:
    expert = SPLITTABLE_EXPERTS[type(module).__name__]
    return expert if isinstance(expert, type) else getattr(importlib.import_module(type(module).__module__), expert)


class ExpertList(nn.ModuleList):
    """One module per expert in place of a fused experts module, called like it:
    (hidden_states [tokens, hidden], top_k_index [tokens, k], top_k_weights [tokens, k])."""

    run_every_expert = False  # apply_expert_patch

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for index, expert in enumerate(self):
            tokens, slot = torch.where(top_k_index == index)
            weights = top_k_weights[tokens, slot]
            if len(tokens) == 0:
                if not self.run_every_expert:
                    continue
                # The patch: token 0 goes through this expert too, weighted by zero, so that this rank joins the
                # expert's all-gather in forward and its reduce-scatter in backward like the ranks that use it.
                tokens = torch.zeros(1, dtype=torch.long, device=hidden_states.device)
                weights = torch.zeros(1, dtype=top_k_weights.dtype, device=top_k_weights.device)
            outputs = expert(hidden_states[tokens]) * weights[:, None]
            out.index_add_(0, tokens, outputs.to(out.dtype))
        return out


def is_moe_block(module: nn.Module) -> bool:
    return isinstance(getattr(module, "experts", None), nn.Module)


def split_experts(model: nn.Module, class_names: list[str]) -> None:
    """Replace every fused experts module whose per-expert class is in `class_names` by an ExpertList of
    per-expert modules, on the fused module's device and dtype (the meta device before sharding: no memory)."""
    fused = [
        (name, module)
        for name, module in model.named_modules()
        if _per_expert_class_name(type(module).__name__) in class_names
    ]
    for name, module in fused:
        expert_class = _per_expert_class(module)
        parameter = module.gate_up_proj
        # OlmoeMLP takes its size from the config (Olmoe's intermediate_size is the experts'); the others are told
        sized = "intermediate_size" in inspect.signature(expert_class).parameters
        with torch.device(parameter.device):
            experts = ExpertList(
                expert_class(module.config, **({"intermediate_size": module.intermediate_dim} if sized else {}))
                for _ in range(module.num_experts)
            )
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, experts.to(parameter.dtype))


def moe_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every MoE block's experts module, by name."""
    return [
        (f"{name}.experts" if name else "experts", cast(nn.Module, module.experts))
        for name, module in model.named_modules()
        if is_moe_block(module)
    ]


def _fused_experts_modules(model: nn.Module) -> list[nn.Module]:
    """The experts modules that dispatch through transformers' experts interface (`config._experts_implementation`)."""
    return [
        experts
        for _, experts in moe_experts(model)
        if hasattr(getattr(experts, "config", None), "_experts_implementation")
    ]


def set_experts_implementation(model: nn.Module, use_grouped_mm: bool | None) -> None:
    """strategy_config.moe_use_grouped_mm: grouped GEMMs or the per-expert loop for every fused experts module (unset:
    transformers' own choice)."""
    if use_grouped_mm is None:
        return
    experts = _fused_experts_modules(model)
    if not experts:
        raise UserError(
            f"strategy_config.moe_use_grouped_mm: {str(use_grouped_mm).lower()} applies to fused experts and the "
            "model has none (no MoE layers, or wrap_policy.moe_experts split them one module per expert); drop it"
        )
    for module in experts:
        cast(Any, module.config)._experts_implementation = "grouped_mm" if use_grouped_mm else "eager"


def apply_expert_patch(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, ExpertList):
            module.run_every_expert = True


def expert_class_choices(model: nn.Module) -> str | None:
    """What `wrap_policy.moe_experts` can name for this model's experts, in words (None: no known experts)."""
    for module in model.modules():
        if type(module).__name__ in SPLITTABLE_EXPERTS:
            return (
                f"'{type(module).__name__}' (each layer's experts as one shard group) or "
                f"'{_per_expert_class_name(type(module).__name__)}' (each expert alone, with apply_expert_patch: true)"
            )
        if isinstance(module, ExpertList):
            return f"'{type(module[0]).__name__}' (each expert alone, with apply_expert_patch: true)"
    return None


def separately_wrapped_experts(model: nn.Module, names: list[str]) -> list[str]:
    """Those of `names` that are single experts of an ExpertList."""
    return [n for n in names if "." in n and isinstance(model.get_submodule(n.rpartition(".")[0]), ExpertList)]


# A model whose experts are split reads fused experts tensors (a fused model's export, a fused checkpoint): each
# expert's weight is its rows of the fused tensor, read lazily with the slice interface of safetensors. Per-expert
# files need nothing of this: they hold the split model's own names.


def _full_index(index: Any, ndim: int) -> tuple[slice, ...]:
    index = index if isinstance(index, tuple) else (index,)
    return tuple(index) + (slice(None),) * (ndim - len(index))


class _ExpertOfFused:
    """One expert's [rows, cols] weight inside a fused [experts, rows, cols] tensor, from row `first_row` on."""

    def __init__(self, fused: Any, expert: int, first_row: int, rows: int) -> None:
        self.fused, self.expert, self.first_row, self.rows = fused, expert, first_row, rows

    def get_shape(self) -> list[int]:
        return [self.rows, self.fused.get_shape()[2]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = _full_index(index, 2)
        start, stop, _ = rows.indices(self.rows)
        return self.fused[self.expert : self.expert + 1, self.first_row + start : self.first_row + stop, cols][0]


def expert_views_from_fused(model: nn.Module, missing: list[str], available: dict[str, Any]) -> dict[str, tuple]:
    """For each split expert's weight in `missing` (model tensors the files do not give), (an opener of a view that
    reads it from the fused tensor in `available`, the stored names it reads). `available` maps model names to
    what the files give (`.open()`, `.sources`)."""
    found: dict[str, tuple] = {}
    for name in missing:
        match = _SPLIT_NAME.fullmatch(name)
        if match is None or not isinstance(model.get_submodule(match["experts"]), ExpertList):
            continue
        tensor, half = _FUSED_ROWS[match["kind"]]
        fused = available.get(f"{match['experts']}.{tensor}")
        if fused is not None:
            found[name] = (partial(_expert_of_fused, fused.open, int(match["index"]), half), fused.sources)
    return found


def _expert_of_fused(open_fused: Callable[[], Any], expert: int, half: int | None) -> _ExpertOfFused:
    fused = open_fused()
    rows = fused.get_shape()[1] // (1 if half is None else 2)
    return _ExpertOfFused(fused, expert, rows * (half or 0), rows)


def refuse_other_expert_layout(model: nn.Module, stored: set[str], cannot_load: str) -> None:
    """A checkpoint (its `stored` model tensor names) that holds an experts module one module per expert where this
    model fuses it, or fused where this model splits it: the same model in the other expert layout, named with the
    key that chooses it (a generic "saved from another model" would send the user looking for another model)."""
    split_stored = any(_SPLIT_NAME.fullmatch(key) for key in stored)
    for name, module in model.named_modules():
        if not any(key.startswith(f"{name}.") for key in stored):
            continue
        own_class = model_class_name(module)  # fully_shard renames a shard group's class
        if isinstance(module, ExpertList) and not split_stored:
            expert = model_class_name(module[0])
            raise UserError(
                f"{cannot_load}: it holds '{name}' fused (each layer's experts as one tensor) and this run splits them "
                f"into one module per expert (strategy_config.wrap_policy.moe_experts: [{expert}]); give the "
                "wrap_policy.moe_experts of the run that saved it"
            )
        if own_class in SPLITTABLE_EXPERTS and split_stored:
            raise UserError(
                f"{cannot_load}: it holds '{name}' as one module per expert (strategy_config.wrap_policy.moe_experts: "
                f"[{_per_expert_class_name(own_class)}] with apply_expert_patch: true) and this run fuses each "
                "layer's experts; give the wrap_policy.moe_experts and apply_expert_patch of the run that saved it"
            )


def expert_modules(model: nn.Module, class_names: list[str]) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    unknown = [name for name in class_names if name not in present]
    if unknown and (choices := expert_class_choices(model)):
        raise UserError(
            f"strategy_config.wrap_policy.moe_experts: class '{unknown[0]}' matches no module of the model; "
            f"for its experts name {choices}"
        )
    found = modules_of_classes(model, class_names, "strategy_config.wrap_policy.moe_experts")
    return list(dict.fromkeys(_with_its_wrappers(name) for name in found))


def _with_its_wrappers(name: str) -> str:
    """An adapted module is `<wrapper>.base_layer` (nested, one wrapper an adapted parameter: peft's ParamWrapper on
    fused experts), and the wrapper reads the module's weights outside the module's forward to add its delta: sharded
    on its own, they would still be shards there. So the experts are sharded with their outermost wrapper."""
    while name.endswith(".base_layer"):
        name = name.removesuffix(".base_layer")
    return name


def needs_expert_patch(model: nn.Module, experts: list[str], requested: bool, notes: list[str]) -> bool:
    """Experts sharded one by one need the patch: without it the job hangs as soon as ranks route differently."""
    single = separately_wrapped_experts(model, experts)
    if single and not requested:
        raise UserError(
            f"strategy_config.apply_expert_patch: wrap_policy.moe_experts shards every expert on its own "
            f"('{single[0]}', ...), and ranks whose tokens go to different experts would wait for each "
            "other's all-gathers forever; set apply_expert_patch: true (every rank runs every expert) or "
            "name the fused experts class instead"
        )
    if requested and not single:
        notes.append(
            "apply_expert_patch changes nothing: no expert is sharded on its own "
            "(wrap_policy.moe_experts names no per-expert class)"
        )
    return requested and bool(single)


def reentrant_allowed(model: nn.Module, recompute: list[str], use_reentrant: bool, notes: list[str]) -> bool:
    """Reentrant checkpointing runs the first forward without autograd: a recomputed MoE block whose router logits
    feed the auxiliary loss needs the non-reentrant kind (noted)."""
    feeds_aux_loss = bool(getattr(getattr(model, "config", None), "output_router_logits", False))
    if (
        use_reentrant
        and feeds_aux_loss
        and any(is_moe_block(module) for name in recompute for module in model.get_submodule(name).modules())
    ):
        notes.append(
            "use_reentrant: false: reentrant checkpointing runs the first forward without autograd, so the "
            "router logits of recomputed MoE blocks would give the auxiliary loss no gradient"
        )
        return False
    return use_reentrant


def without_moe_blocks(model: nn.Module, mlps: list[str], notes: list[str]) -> list[str]:
    """The MLPs TiledMLP may tile: mixture-of-experts blocks are left whole (their router outputs feed the
    auxiliary loss and must keep their autograd graph)."""
    moe_blocks = [name for name in mlps if is_moe_block(model.get_submodule(name))]
    if moe_blocks:
        notes.append(
            f"apply_tiled_mlp: {len(moe_blocks)} mixture-of-experts blocks are not tiled (router outputs "
            "feed the auxiliary loss)"
        )
    return [name for name in mlps if name not in moe_blocks]


ROUTED_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # the families' names for it


def routed_expert_count(config: Any) -> int | None:
    """The routed experts of each MoE layer, as the model's (text) config names them; None for a dense model."""
    text = config.get_text_config() if config is not None else None
    experts = next((getattr(text, key) for key in ROUTED_EXPERT_COUNTS if getattr(text, key, None)), None)
    return experts if isinstance(experts, int) and experts > 0 else None


def routed_shares(model: nn.Module) -> dict[int, float]:
    """Each routed expert's parameters (by id) with the share of the tokens they compute on: a token runs
    num_experts_per_tok of the block's experts. Parameters not listed (attention, shared experts) run on every token."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = routed_expert_count(config)
    if not (isinstance(top_k, int) and experts is not None):
        return {}
    return {
        id(param): top_k / experts
        for module in model.modules()
        if is_moe_block(module)
        for param in cast(nn.Module, module.experts).parameters()
    }


def gather_router_logits(model: nn.Module, group: ProcessGroup) -> None:
    """Under sequence parallel each rank routes its slice of the sequence, but the load-balancing loss multiplies
    per-expert means over all of a micro-batch's tokens: slices' losses do not average to the sequence's. Each router
    (the module transformers records `router_logits` from) hands the recorder the whole sequence's logits,
    all-gathered over `group` (the sequence group, whatever ranks make it) with autograd (`gather_router_rows`),
    while its routing stays on this rank's tokens: every rank computes the sequence's loss, as 1 rank."""

    config: Any = model.config
    if not getattr(config.get_text_config(), "output_router_logits", False):
        return  # no loss reads them: routers keep their own tokens' logits, with no collective
    for recorder in _router_recorders(model):
        routers = _recorded_modules(model, recorder)

        def gathering(module: nn.Module, forward: Forward, index: int = recorder.index) -> Forward:
            def forward_gathered(*args: Any, **kwargs: Any) -> Any:
                outputs = list(cast(tuple, forward(*args, **kwargs)))
                outputs[index] = _sequence_rows(gather_router_rows(outputs[index], group), group)
                return tuple(outputs)

            return forward_gathered

        replace_forward(model, routers, gathering)


def gather_router_rows(local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The group's router logits [ranks, rows, experts], rank r's rows from rank r, with autograd: the gradient of
    each rank's own rows is the sum of the group's gradients of them (reduce-scatter), the gradient of the ranks'
    summed losses, every one of which reads every rank's rows. Collectives on `group` only (torch's
    `distributed.nn.all_gather` backward on gloo scatters from group ranks taken for global ones: a group without
    global rank 0 failed)."""
    return cast(torch.Tensor, _GatherRows.apply(local, group))


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        gathered = local.new_empty((group.size() * local.shape[0], *local.shape[1:]))  # gloo takes this form
        dist.all_gather_into_tensor(gathered, local.contiguous(), group=group)
        return gathered.unflatten(0, (group.size(), local.shape[0]))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        mine = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_tensor(mine, grad.flatten(0, 1).contiguous(), group=ctx.group)
        return mine, None


def once_per_group(loss: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """A router loss that every rank of the sequence `group` computes alike, as a loss the step counts once per group
    (a caller's loss_fn over whole sequences) takes it: its value, with 1/size of its gradient on each rank, as the
    gradients of its gathered logits sum over the group (`gather_router_rows`)."""
    if group is None or group.size() == 1:
        return loss
    share = loss / group.size()
    return share + (loss - share).detach()


def router_modules(model: nn.Module) -> list[str]:
    """The modules transformers records a mixture of experts' router logits from: its routers."""
    return [name for recorder in _router_recorders(model) for name in _recorded_modules(model, recorder)]


def _router_recorders(model: nn.Module) -> list[Any]:
    """transformers' records of where `router_logits` come from, one per model class that declares them."""
    from transformers import PreTrainedModel

    recorders = [
        getattr(module, "_can_record_outputs", None) or {}
        for module in model.modules()
        if isinstance(module, PreTrainedModel)
    ]
    return [r["router_logits"] for r in recorders if "router_logits" in r]


def _recorded_modules(model: nn.Module, recorder: Any) -> list[str]:
    return [
        name
        for name, m in model.named_modules()
        if (isinstance(m, recorder.target_class) if recorder.target_class else type(m).__name__ == recorder.class_name)
    ]


def _sequence_rows(gathered: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """The ranks' router logits [ranks, B x T/ranks, experts] as rows in sequence order, only those of the tokens
    the micro-batch's loss counts (`counted_tokens`: a text batch's padding is left out, as transformers' attention
    mask leaves it out at one rank; a VL batch keeps every row, its padded mask reaching the loss)."""
    counted = counted_tokens(group)
    if counted is None or counted.numel() != gathered.shape[0] * gathered.shape[1]:
        return gathered.flatten(0, 1)  # not a sequence this group cut: every row as it came
    rows, length = counted.shape
    by_sequence = gathered.unflatten(1, (rows, length // gathered.shape[0])).transpose(0, 1).flatten(1, 2)
    return by_sequence[counted.to(gathered.device)]
