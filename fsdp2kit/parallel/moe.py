"""Mixture of experts under FSDP2 (Qwen3-MoE).

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
import re
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn as nn

from fsdp2kit.errors import UserError
from fsdp2kit.parallel.module_paths import modules_of_classes

# Fused experts class -> the class of one expert, as the checkpoints of the model family store it.
SPLITTABLE_EXPERTS = {"Qwen3MoeExperts": "Qwen3MoeMLP"}

_FUSED_NAME = re.compile(r"(?P<experts>.*\.experts)\.(?P<kind>gate_up_proj|down_proj)")
_SPLIT_NAME = re.compile(r"(?P<experts>.*\.experts)\.(?P<index>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight")


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
        if SPLITTABLE_EXPERTS.get(type(module).__name__) in class_names
    ]
    for name, module in fused:
        expert_class = getattr(
            importlib.import_module(type(module).__module__), SPLITTABLE_EXPERTS[type(module).__name__]
        )
        parameter = module.gate_up_proj
        with torch.device(parameter.device):
            experts = ExpertList(
                expert_class(module.config, intermediate_size=module.intermediate_dim)
                for _ in range(module.num_experts)
            )
        parent, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(parent), attribute, experts.to(parameter.dtype))


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
                f"'{SPLITTABLE_EXPERTS[type(module).__name__]}' (each expert alone, with apply_expert_patch: true)"
            )
        if isinstance(module, ExpertList):
            return f"'{type(module[0]).__name__}' (each expert alone, with apply_expert_patch: true)"
    return None


def separately_wrapped_experts(model: nn.Module, names: list[str]) -> list[str]:
    """Those of `names` that are single experts of an ExpertList."""
    return [n for n in names if "." in n and isinstance(model.get_submodule(n.rpartition(".")[0]), ExpertList)]


# Checkpoints store a Qwen3-MoE block's experts one by one (as transformers writes them); a model may hold them
# fused or split. These read one layout as the other, lazily, with the slice interface of safetensors.


def _full_index(index: Any, ndim: int) -> tuple[slice, ...]:
    index = index if isinstance(index, tuple) else (index,)
    return tuple(index) + (slice(None),) * (ndim - len(index))


class _FusedFromExperts:
    """A fused [experts, rows, cols] tensor stacked from per-expert tensors (gate and up concatenated by rows)."""

    def __init__(self, per_expert: list[list]):
        self.per_expert = per_expert

    def get_shape(self) -> list[int]:
        first = [view.get_shape() for view in self.per_expert[0]]
        return [len(self.per_expert), sum(shape[0] for shape in first), first[0][1]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        experts, rows, cols = _full_index(index, 3)
        return torch.stack(
            [
                torch.cat([view[:] for view in self.per_expert[e]])[rows, cols]
                for e in range(len(self.per_expert))[experts]
            ]
        )


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


def expert_views_from_other_layout(
    model: nn.Module, missing: list[str], stored: set[str], view: Callable[[str], Any]
) -> dict[str, tuple]:
    """For each expert weight in `missing` (model tensors the files lack under that name), a view that reads it from
    the other layout's tensors in `stored`, and the names it reads. `view(name)` opens one stored tensor."""
    found: dict[str, tuple] = {}
    for name in missing:
        if (match := _FUSED_NAME.fullmatch(name)) and type(
            model.get_submodule(match["experts"])
        ).__name__ in SPLITTABLE_EXPERTS:
            prefix = match["experts"]
            kinds = ["gate_proj", "up_proj"] if match["kind"] == "gate_up_proj" else ["down_proj"]
            sources = [
                [f"{prefix}.{e}.{kind}.weight" for kind in kinds] for e in range(model.get_parameter(name).shape[0])
            ]
            if all(source in stored for names in sources for source in names):
                found[name] = (
                    _FusedFromExperts([[view(source) for source in names] for names in sources]),
                    [source for names in sources for source in names],
                )
        elif (match := _SPLIT_NAME.fullmatch(name)) and isinstance(model.get_submodule(match["experts"]), ExpertList):
            source = f"{match['experts']}.{'down_proj' if match['kind'] == 'down_proj' else 'gate_up_proj'}"
            if source in stored:
                fused = view(source)
                rows = fused.get_shape()[1] // (1 if match["kind"] == "down_proj" else 2)
                first_row = rows if match["kind"] == "up_proj" else 0
                found[name] = (_ExpertOfFused(fused, int(match["index"]), first_row, rows), [source])
    return found


def expert_modules(model: nn.Module, class_names: list[str]) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    unknown = [name for name in class_names if name not in present]
    if unknown and (choices := expert_class_choices(model)):
        raise UserError(
            f"strategy_config.wrap_policy.moe_experts: class '{unknown[0]}' matches no module of the model; "
            f"for its experts name {choices}"
        )
    return modules_of_classes(model, class_names, "strategy_config.wrap_policy.moe_experts")


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


def routed_shares(model: nn.Module) -> dict[int, float]:
    """Each routed expert's parameters (by id) with the share of the tokens they compute on: a token runs
    num_experts_per_tok of the block's experts. Parameters not listed (attention, shared experts) run on every token."""
    config: Any = getattr(model, "config", None)
    text = config.get_text_config() if config is not None else None
    top_k = getattr(text, "num_experts_per_tok", None)
    experts = next((getattr(text, key) for key in ROUTED_EXPERT_COUNTS if getattr(text, key, None)), None)
    if not (isinstance(top_k, int) and isinstance(experts, int) and experts > 0):
        return {}
    return {
        id(param): top_k / experts
        for module in model.modules()
        if is_moe_block(module)
        for param in cast(nn.Module, module.experts).parameters()
    }
