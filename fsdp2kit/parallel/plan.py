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
from fsdp2kit.parallel.moe import expert_class_choices, is_moe_block, separately_wrapped_experts
from fsdp2kit.parallel.vision import projector_modules, translate_vl_path

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


def modules_of_classes(model: nn.Module, class_names: list[str], key: str) -> list[str]:
    found: list[str] = []
    for class_name in class_names:
        hits = [n for n, m in model.named_modules() if n and type(m).__name__ == class_name]
        if not hits:
            present = sorted({type(m).__name__ for m in model.modules()})
            raise UserError(f"{key}: class '{class_name}' matches no module of the model; its classes are {present}")
        found.extend(hits)
    order = [n for n, _ in model.named_modules()]
    return sorted(set(found), key=order.index)


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
    compiled_modules: list[str]  # torch.compile on each decoder layer's forward (training.compile)
    tiled_mlp_modules: list[str]
    tiled_num_shards: int
    expert_patch: bool  # every rank runs every separately sharded expert (fsdp2kit.parallel.moe)
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
    vision_patch: bool = False  # every forward runs the vision tower, on a dummy image if need be (parallel/vision.py)
    adapters: AdapterPlan | None = None  # filled by fsdp2kit.models.lora.plan_adapters
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
    return list(getattr(model, "_no_split_modules", None) or [])


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
    moe_blocks = [name for name in mlps if is_moe_block(model.get_submodule(name))]
    if moe_blocks:
        notes.append(
            f"apply_tiled_mlp: {len(moe_blocks)} mixture-of-experts blocks are not tiled (router outputs "
            "feed the auxiliary loss)"
        )
    tiled = [name for name in mlps if name not in moe_blocks]
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


def _moe_experts(model: nn.Module, class_names: list[str]) -> list[str]:
    present = {type(m).__name__ for m in model.modules()}
    unknown = [name for name in class_names if name not in present]
    if unknown and (choices := expert_class_choices(model)):
        raise UserError(
            f"strategy_config.wrap_policy.moe_experts: class '{unknown[0]}' matches no module of the model; "
            f"for its experts name {choices}"
        )
    return modules_of_classes(model, class_names, "strategy_config.wrap_policy.moe_experts")


def _expert_patch(model: nn.Module, experts: list[str], requested: bool, notes: list[str]) -> bool:
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


def _recomputes_router_loss(model: nn.Module, recompute: list[str]) -> bool:
    """Whether a recomputed module holds an MoE block whose router logits feed the model's auxiliary loss."""
    return bool(getattr(getattr(model, "config", None), "output_router_logits", False)) and any(
        is_moe_block(module) for name in recompute for module in model.get_submodule(name).modules()
    )


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


def build_plan(
    model: nn.Module, strategy: StrategyConfig, model_cfg: ModelConfig, compile_layers: bool = False
) -> ShardingPlan:
    if strategy.pin_memory and not strategy.offload_policy:
        raise UserError("strategy_config.pin_memory: true only applies with offload_policy: true")

    notes: list[str] = []
    ignored = match_modules(model, strategy.ignored_modules, "ignored_modules", notes)
    custom = callable(getattr(model, "_fully_shard", None))
    if custom:
        _no_selection_keys(strategy, type(model).__name__)
    selected: list[str] = []
    experts: list[str] = []
    if not custom:
        selected += match_modules(model, strategy.sub_modules_to_wrap, "sub_modules_to_wrap", notes)
        classes = strategy.wrap_policy.transformer_layer_cls_to_wrap
        policy = strategy.wrap_policy
        if not (classes or strategy.sub_modules_to_wrap or policy.min_num_params or policy.no_wrap):
            classes = _layer_classes(model)  # a VL model's list names its vision block too
            if getattr(getattr(model, "config", None), "vision_config", None) is not None:
                projectors = projector_modules(model)
                selected += projectors
                notes += [
                    f"vision projector '{name}': its own shard group (ROLL and MindSpeed-MM leave it in the root's)"
                    for name in projectors
                ]
        selected += modules_of_classes(model, classes, "strategy_config.wrap_policy.transformer_layer_cls_to_wrap")
        experts = _moe_experts(model, strategy.wrap_policy.moe_experts)
        selected += experts
        if strategy.wrap_policy.min_num_params:
            selected += _size_based(model, strategy.wrap_policy.min_num_params, set(selected))
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

    overlap = [n for n in selected + extra if any(_is_ancestor(i, n) or _is_ancestor(n, i) for i in ignored)]
    if overlap:
        raise UserError(
            f"strategy_config.ignored_modules: '{overlap[0]}' is both ignored and sharded "
            "(or contains an ignored module)"
        )

    order = [n for n, _ in model.named_modules()]
    names = sorted(set(selected), key=order.index)
    groups: list[tuple[str, ...]] = [(n,) for n in names]
    if extra:
        # A weight shared by the embeddings and the LM head must live in one shard group, or the tie breaks.
        if embed is not None and head is not None and _tied(model, embed, head):
            groups.append((embed, head))
            notes.append(f"tied weights: '{embed}' and '{head}' share one shard group")
        else:
            groups += [(n,) for n in extra]
        groups.sort(key=lambda g: order.index(g[0]))
    expert_patch = _expert_patch(model, experts, strategy.apply_expert_patch, notes)
    if strategy.num_to_backward_prefetch == 0:
        notes.append("num_to_backward_prefetch 0 acts as 1: FSDP2 always prefetches the previous group in backward")

    recompute = match_modules(model, strategy.recompute_modules, "recompute_modules", notes)
    if model_cfg.gradient_checkpointing:
        recompute = sorted(
            set(recompute) | set(modules_of_classes(model, _layer_classes(model), "model.gradient_checkpointing")),
            key=order.index,
        )
    use_reentrant = strategy.use_reentrant
    if use_reentrant and _recomputes_router_loss(model, recompute):
        use_reentrant = False
        notes.append(
            "use_reentrant: false: reentrant checkpointing runs the first forward without autograd, so the "
            "router logits of recomputed MoE blocks would give the auxiliary loss no gradient"
        )

    # Parameters the model itself marks frozen: with LoRA, peft leaves only the adapters trainable.
    frozen: list[str] = [n for n, p in model.named_parameters() if not p.requires_grad]
    for prefix in model_cfg.freeze_module_prefix:
        hits = [n for n, _ in model.named_parameters() if n == prefix or n.startswith(prefix.rstrip(".") + ".")]
        translated = None if hits else translate_vl_path(model, prefix.rstrip("."))
        if translated:  # ROLL's `freeze_module_prefix: vision_model`
            hits = [n for n, _ in model.named_parameters() if n.startswith(translated + ".")]
            notes.append(f"model.freeze_module_prefix: '{prefix}' read as '{translated}'")
        if not hits:
            raise UserError(f"model.freeze_module_prefix: '{prefix}' is the prefix of no parameter")
        frozen += hits

    tiled_mlps = _tiled_mlps(model, groups, notes) if strategy.apply_tiled_mlp else []
    model_dtype = model_cfg.dtype
    param_dtype = strategy.param_dtype or model_dtype
    return ShardingPlan(
        groups=groups,
        ignored_modules=ignored,
        recompute_modules=recompute,
        compiled_modules=modules_of_classes(model, _layer_classes(model), "training.compile") if compile_layers else [],
        tiled_mlp_modules=tiled_mlps,
        tiled_num_shards=strategy.tiled_num_shards,
        expert_patch=expert_patch,
        frozen_parameters=sorted(set(frozen), key=[n for n, _ in model.named_parameters()].index),
        reshard_after_forward=effective_reshard(strategy),
        param_dtype=param_dtype,
        reduce_dtype=strategy.reduce_dtype or param_dtype,
        output_dtype=strategy.output_dtype,
        cast_forward_inputs=strategy.cast_forward_inputs,
        no_cast_modules=[n for g in groups for n in g if re.search(r"vision|visual", n)],
        offload=strategy.offload_policy,
        pin_memory=strategy.pin_memory,
        forward_prefetch=strategy.num_to_forward_prefetch,
        backward_prefetch=strategy.num_to_backward_prefetch,
        use_reentrant=use_reentrant,
        custom=custom,
        vision_patch=getattr(getattr(model, "config", None), "vision_config", None) is not None,
        notes=notes,
    )
