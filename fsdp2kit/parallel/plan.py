"""Which modules get their own `fully_shard`, which are recomputed, ignored or frozen, and with which policies.

The plan is computed from the (meta-device) model and the strategy section alone, so `fsdp2kit check` can print
exactly what `apply_fsdp` will do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch.nn as nn

from fsdp2kit.config.schema import ModelConfig, StrategyConfig, pattern_class
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.expert_parallel import EXPERT_MESH, expert_parallel_plan
from fsdp2kit.parallel.module_paths import modules_of_classes
from fsdp2kit.parallel.moe import expert_modules, needs_expert_patch, reentrant_allowed, without_moe_blocks
from fsdp2kit.parallel.vision import default_projector_groups, translate_vl_path, uncast_modules

_SEGMENT_RANGE = re.compile(r"\{(\d+)-(\d+)\}")
_SEGMENT_LIST = re.compile(r"\{(\d+(?:\s*,\s*\d+)*)\}")


def _segment_regex(segment: str) -> str:
    if segment in ("{*}", "*"):
        return r"[^.]+"
    if match := _SEGMENT_RANGE.fullmatch(segment):
        low, high = int(match.group(1)), int(match.group(2))
        return "(?:" + "|".join(str(i) for i in range(low, high + 1)) + ")"
    if match := _SEGMENT_LIST.fullmatch(segment):
        return "(?:" + "|".join(s.strip() for s in match.group(1).split(",")) + ")"
    return re.escape(segment)


def compile_pattern(pattern: str) -> re.Pattern:
    """MindSpeed-MM's module-path syntax: `model.layers.{*}`, `model.layers.{0-23}`, `model.layers.{1,3,5}`."""
    return re.compile(r"\.".join(_segment_regex(s) for s in pattern.split(".")))


def match_modules(model: nn.Module, patterns: list[str], key: str, notes: list[str] | None = None) -> list[str]:
    """Module paths (in forward/definition order) matched by any pattern (a class path: every module of that class);
    a pattern matching nothing is an error, unless it names a VL model's tower or language model as another stack
    does (`translate_vl_path`, noted)."""
    names = [name for name, _ in model.named_modules() if name]
    matched: set[str] = set()
    for pattern in patterns:
        if (class_name := pattern_class(pattern)) is not None:  # `package.module.DecoderLayer`: its every module
            matched.update(modules_of_classes(model, [class_name], f"strategy_config.{key}"))
            continue
        regex = compile_pattern(pattern)
        hits = [n for n in names if regex.fullmatch(n)]
        translated = None if hits else translate_vl_path(model, pattern)
        if translated:
            hits = [n for n in names if compile_pattern(translated).fullmatch(n)]
            if hits and notes is not None:
                notes.append(f"strategy_config.{key}: '{pattern}' read as '{translated}'")
        if not hits:
            example = next((n for n in names if n.count(".") == pattern.count(".")), names[0] if names else "")
            raise UserError(
                f"strategy_config.{key}: pattern '{pattern}' matches no module of the model "
                f"(module paths look like '{example}')"
            )
        matched.update(hits)
    return [n for n in names if n in matched]


def _is_ancestor(parent: str, child: str) -> bool:
    return parent == "" or child.startswith(parent + ".")


@dataclass
class AdapterPlan:
    """LoRA adapters (model.lora): where they live and what they cost, for `check` and the memory planner."""

    rank: int
    alpha: float
    dtype: str  # of the adapters' stored weights
    modules: list[str]  # the layers peft wrapped, and the modules to save
    groups: dict[str, int]  # shard group (its first module; '' the root) -> adapter parameters in it
    parameters: int  # trainable: adapters + modules to save
    parameter_bytes: int
    optimizer_state_bytes: int  # AdamW: exp_avg and exp_avg_sq, each the size of its parameter
    input_grad_hooks: list[str]  # modules whose outputs are made to require grad (reentrant recompute)


@dataclass
class ShardingPlan:
    """Everything `apply_fsdp` and `apply_recompute` will do, in plain data."""

    groups: list[tuple[str, ...]]  # each tuple is one fully_shard call; forward order; the root is not listed
    ignored_modules: list[str]
    recompute_modules: list[str]
    activation_offload_modules: list[str]  # forward order: their saved activations wait in host memory (CUDA)
    compiled_modules: list[str]  # torch.compile on each decoder layer's forward (training.compile)
    tiled_mlp_modules: list[str]
    tiled_num_shards: int
    expert_patch: bool  # every rank runs every separately sharded expert (fsdp2kit.parallel.moe)
    expert_parallel: list[str]  # experts modules split over the ranks of an EP group, each its own shard group
    group_meshes: dict[str, str]  # group (its first module) -> the mesh it is sharded over, if not the dense one
    frozen_parameters: list[str]
    reshard_after_forward: bool | int
    param_dtype: str | None
    reduce_dtype: str | None
    output_dtype: str | None
    cast_forward_inputs: bool
    no_cast_modules: list[str]  # vision encoders: inputs are not cast (precision of pixel values)
    offload: bool
    pin_memory: bool
    forward_prefetch: int
    backward_prefetch: int
    use_reentrant: bool
    custom: bool = False  # the model's own `_fully_shard` decides the groups
    notes: list[str] = field(default_factory=list)


def _size_based(model: nn.Module, min_num_params: int, taken: set[str]) -> list[str]:
    """Accelerate's SIZE_BASED_WRAP: bottom-up, wrap a module once its not-yet-wrapped parameters reach the limit."""
    chosen: list[str] = []

    def visit(name: str, module: nn.Module) -> int:
        count = sum(p.numel() for p in module.parameters(recurse=False))
        for child_name, child in module.named_children():
            count += visit(f"{name}.{child_name}" if name else child_name, child)
        if name and (name in taken or count >= min_num_params):
            if name not in taken:
                chosen.append(name)
            return 0
        return count

    visit("", model)
    return chosen


def _layer_classes(model: nn.Module) -> list[str]:
    """transformers' `_no_split_modules` classes that the model holds: a family's list may name its sibling's
    (5.2's Gemma3ForCausalLM names the Siglip tower of Gemma3's vision-language model)."""
    present = {type(module).__name__ for module in model.modules()}
    return [name for name in getattr(model, "_no_split_modules", None) or [] if name in present]


def _embedding_modules(model: nn.Module) -> tuple[str | None, str | None]:
    names = {id(m): n for n, m in model.named_modules()}
    get_inputs = getattr(model, "get_input_embeddings", None)  # transformers models have both; a plain module neither
    get_outputs = getattr(model, "get_output_embeddings", None)
    inputs = get_inputs() if get_inputs is not None else None
    outputs = get_outputs() if get_outputs is not None else None
    return names.get(id(inputs)), names.get(id(outputs))


def _tied(model: nn.Module, embed: str | None, head: str | None) -> bool:
    if embed is None or head is None:
        return False
    return model.get_submodule(embed).weight is model.get_submodule(head).weight


def _no_selection_keys(strategy: StrategyConfig, model_class: str) -> None:
    """A model with its own plan (`_fully_shard`) chooses its shard groups itself; keys that would choose
    others are a contradiction, not something to ignore silently."""
    policy = strategy.wrap_policy
    chosen = {
        "sub_modules_to_wrap": strategy.sub_modules_to_wrap,
        "wrap_policy.transformer_layer_cls_to_wrap": policy.transformer_layer_cls_to_wrap,
        "wrap_policy.min_num_params": policy.min_num_params,
        "wrap_policy.wrap_embeddings": policy.wrap_embeddings is True,
        "wrap_policy.wrap_lm_output": policy.wrap_lm_output,
        "wrap_policy.no_wrap": policy.no_wrap,
        "wrap_policy.moe_experts": policy.moe_experts,
    }
    for key, value in chosen.items():
        if value:
            raise UserError(
                f"strategy_config.{key}: {model_class} defines its own sharding plan (_fully_shard), "
                "which chooses the shard groups; drop this key"
            )


def _tiled_mlps(model: nn.Module, groups: list[tuple[str, ...]], notes: list[str]) -> list[str]:
    """The `mlp` of every decoder layer (the `_no_split_modules` classes). Mixture-of-experts blocks are left
    whole: their router logits feed the auxiliary loss and must keep their autograd graph."""
    layers = modules_of_classes(model, _layer_classes(model), "strategy_config.apply_tiled_mlp: decoder layer")
    mlps = [
        f"{layer}.mlp" for layer in layers if isinstance(getattr(model.get_submodule(layer), "mlp", None), nn.Module)
    ]
    tiled = without_moe_blocks(model, mlps, notes)
    if not tiled:
        raise UserError(
            "strategy_config.apply_tiled_mlp: the model's decoder layers have no dense `mlp` module to tile"
        )
    # A shard group inside a tiled MLP would be all-gathered once per tile, in forward and again in backward.
    for name in (n for group in groups for n in group):
        inside = next((mlp for mlp in tiled if name.startswith(mlp + ".")), None)
        if inside:
            raise UserError(
                f"strategy_config.apply_tiled_mlp: '{name}' is a shard group inside the tiled MLP "
                f"'{inside}'; shard the MLP as a whole or turn apply_tiled_mlp off"
            )
    return tiled


def effective_reshard(strategy: StrategyConfig) -> bool | int:
    by_name = {
        "SHARD_GRAD_OP": False,
        "_HYBRID_SHARD_ZERO2": False,
        "FULL_SHARD": True,
        "HYBRID_SHARD": True,
        "NO_SHARD": False,
    }
    if strategy.sharding_strategy is None:
        return strategy.reshard_after_forward
    implied = by_name[strategy.sharding_strategy]
    if "reshard_after_forward" in strategy.model_fields_set and strategy.reshard_after_forward != implied:
        raise UserError(
            f"strategy_config.reshard_after_forward = {strategy.reshard_after_forward} contradicts "
            f"sharding_strategy {strategy.sharding_strategy} (which means {implied}); give one of them"
        )
    return implied


def _selected_modules(model: nn.Module, strategy: StrategyConfig, notes: list[str]) -> tuple[list[str], list[str]]:
    """The modules that get their own fully_shard, by pattern, class (default: `_no_split_modules`, and a VL
    model's projectors), expert class and size; and among them the experts."""
    selected = match_modules(model, strategy.sub_modules_to_wrap, "sub_modules_to_wrap", notes)
    policy = strategy.wrap_policy
    classes = policy.transformer_layer_cls_to_wrap
    if not (classes or strategy.sub_modules_to_wrap or policy.min_num_params or policy.no_wrap):
        classes = _layer_classes(model)  # a VL model's list names its vision block too
        selected += default_projector_groups(model, notes)
    selected += modules_of_classes(model, classes, "strategy_config.wrap_policy.transformer_layer_cls_to_wrap")
    experts = expert_modules(model, policy.moe_experts)
    selected += experts
    if policy.min_num_params:
        selected += _size_based(model, policy.min_num_params, set(selected))
    return selected, experts


def _embedding_modules_to_wrap(model: nn.Module, strategy: StrategyConfig) -> list[str]:
    """The input embeddings and LM head, where wrap_embeddings / wrap_lm_output give them their own group."""
    embed, head = _embedding_modules(model)
    extra: list[str] = []
    wrap_embeddings = strategy.wrap_policy.wrap_embeddings
    if wrap_embeddings is True or (wrap_embeddings == "untied" and embed is not None and not _tied(model, embed, head)):
        if embed is None:
            raise UserError("strategy_config.wrap_policy.wrap_embeddings: the model exposes no input embeddings")
        extra.append(embed)
    if strategy.wrap_policy.wrap_lm_output:
        if head is None:
            raise UserError("strategy_config.wrap_policy.wrap_lm_output: the model exposes no output embeddings")
        extra.append(head)
    return extra


def _shard_groups(model: nn.Module, selected: list[str], extra: list[str], notes: list[str]) -> list[tuple[str, ...]]:
    """One group per selected module, in forward order; tied embeddings and LM head share one."""
    order = [n for n, _ in model.named_modules()]
    groups: list[tuple[str, ...]] = [(n,) for n in sorted(set(selected), key=order.index)]
    if not extra:
        return groups
    embed, head = _embedding_modules(model)
    # A weight shared by the embeddings and the LM head must live in one shard group, or the tie breaks.
    if embed is not None and head is not None and _tied(model, embed, head):
        groups.append((embed, head))
        notes.append(f"tied weights: '{embed}' and '{head}' share one shard group")
    else:
        groups += [(n,) for n in extra]
    return sorted(groups, key=lambda g: order.index(g[0]))


def _refuse_ignored_overlap(sharded: list[str], ignored: list[str]) -> None:
    overlap = [n for n in sharded if any(_is_ancestor(i, n) or _is_ancestor(n, i) for i in ignored)]
    if overlap:
        raise UserError(
            f"strategy_config.ignored_modules: '{overlap[0]}' is both ignored and sharded "
            "(or contains an ignored module)"
        )


def _recompute_plan(
    model: nn.Module, strategy: StrategyConfig, model_cfg: ModelConfig, notes: list[str]
) -> tuple[list[str], bool]:
    """The recomputed modules (recompute_modules, and every decoder layer with gradient_checkpointing) and whether
    checkpointing may be reentrant."""
    recompute = match_modules(model, strategy.recompute_modules, "recompute_modules", notes)
    if model_cfg.gradient_checkpointing:
        order = [n for n, _ in model.named_modules()]
        recompute = sorted(
            set(recompute) | set(modules_of_classes(model, _layer_classes(model), "model.gradient_checkpointing")),
            key=order.index,
        )
    return recompute, reentrant_allowed(model, recompute, strategy.use_reentrant, notes)


def _frozen_parameters(model: nn.Module, prefixes: list[str], notes: list[str]) -> list[str]:
    """Parameters the model itself marks frozen (with LoRA, peft leaves only the adapters trainable) and those under
    model.freeze_module_prefix, in parameter order."""
    names = [n for n, _ in model.named_parameters()]
    frozen: list[str] = [n for n, p in model.named_parameters() if not p.requires_grad]
    for prefix in prefixes:
        hits = [n for n in names if n == prefix or n.startswith(prefix.rstrip(".") + ".")]
        translated = None if hits else translate_vl_path(model, prefix.rstrip("."))
        if translated:  # ROLL's `freeze_module_prefix: vision_model`
            hits = [n for n in names if n.startswith(translated + ".")]
            notes.append(f"model.freeze_module_prefix: '{prefix}' read as '{translated}'")
        if not hits:
            raise UserError(f"model.freeze_module_prefix: '{prefix}' is the prefix of no parameter")
        frozen += hits
    return sorted(set(frozen), key=names.index)


def build_plan(
    model: nn.Module, strategy: StrategyConfig, model_cfg: ModelConfig, compile_layers: bool = False
) -> ShardingPlan:
    """The plan, concern by concern: shard groups, ignored modules, recompute, freezing, TiledMLP, precision,
    reshard and prefetch; the notes say where it deviates from what was written."""
    if strategy.pin_memory and not strategy.offload_policy:
        raise UserError("strategy_config.pin_memory: true only applies with offload_policy: true")
    notes: list[str] = []
    ignored = match_modules(model, strategy.ignored_modules, "ignored_modules", notes)
    custom = callable(getattr(model, "_fully_shard", None))
    if custom:
        _no_selection_keys(strategy, type(model).__name__)
    selected, experts = ([], []) if custom else _selected_modules(model, strategy, notes)
    expert_parallel = expert_parallel_plan(model, strategy, model_cfg, notes)
    selected += [name for name in expert_parallel if name not in selected]
    extra = _embedding_modules_to_wrap(model, strategy)
    _refuse_ignored_overlap(selected + extra, ignored)
    groups = _shard_groups(model, selected, extra, notes)
    expert_patch = needs_expert_patch(model, experts, strategy.apply_expert_patch, notes)
    if strategy.num_to_backward_prefetch == 0:
        notes.append("num_to_backward_prefetch 0 acts as 1: FSDP2 always prefetches the previous group in backward")
    recompute, use_reentrant = _recompute_plan(model, strategy, model_cfg, notes)
    frozen = _frozen_parameters(model, model_cfg.freeze_module_prefix, notes)
    tiled_mlps = _tiled_mlps(model, groups, notes) if strategy.apply_tiled_mlp else []
    param_dtype = strategy.param_dtype or model_cfg.dtype
    return ShardingPlan(
        groups=groups,
        ignored_modules=ignored,
        recompute_modules=recompute,
        activation_offload_modules=match_modules(
            model, strategy.activation_offload_modules, "activation_offload_modules", notes
        ),
        compiled_modules=modules_of_classes(model, _layer_classes(model), "training.compile") if compile_layers else [],
        tiled_mlp_modules=tiled_mlps,
        tiled_num_shards=strategy.tiled_num_shards,
        expert_patch=expert_patch,
        expert_parallel=expert_parallel,
        group_meshes=dict.fromkeys(expert_parallel, EXPERT_MESH),
        frozen_parameters=frozen,
        reshard_after_forward=effective_reshard(strategy),
        param_dtype=param_dtype,
        reduce_dtype=strategy.reduce_dtype or param_dtype,
        output_dtype=strategy.output_dtype,
        cast_forward_inputs=strategy.cast_forward_inputs,
        no_cast_modules=uncast_modules(groups),
        offload=strategy.offload_policy,
        pin_memory=strategy.pin_memory,
        forward_prefetch=strategy.num_to_forward_prefetch,
        backward_prefetch=strategy.num_to_backward_prefetch,
        use_reentrant=use_reentrant,
        custom=custom,
        notes=notes,
    )
