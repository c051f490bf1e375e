"""MindSpeed-MM's flat `fsdp2_config.yaml` (`--fsdp2-config-path`), read as its `Fsdp2Config` dataclass
(mindspeed_mm/models/transformers/base_model.py) reads it: every field of that class is mapped, or noted where it
changes nothing here; its defaults where they differ from fsdp2kit's (sharding_size 1 = replicate on every rank,
pinned offload memory, no explicit backward prefetch) are applied and noted. MindSpeed-MM drops keys it does not
know; fsdp2kit refuses them, so that a typo never disappears."""

from __future__ import annotations

from typing import Any

from fsdp2kit.config.dialects.translation import (
    STRATEGY_CONFIG,
    Rule,
    Translation,
    Written,
    already_read,
    apply_rules,
    converted,
    ignored,
    to,
    whole_ranks,
)
from fsdp2kit.config.schema import pattern_class
from fsdp2kit.errors import UserError

# Fsdp2Config's defaults that differ from fsdp2kit's.
DEFAULTS = {"sharding_size": 1, "num_to_backward_prefetch": 0}


def _sharding_size(translation: Translation, key: Written, value: Any) -> None:
    """MindSpeed-MM builds a [world/sharding_size, sharding_size] mesh and refuses a size that does not divide the
    world; `auto` is the world (plain FSDP) and 1 replicates on every rank."""
    to(f"{STRATEGY_CONFIG}.fsdp_size")(translation, key, value)
    if value != "auto":
        translation.set(f"{STRATEGY_CONFIG}.fsdp_size_exact", True, key)


def _sub_modules_to_wrap(translation: Translation, key: Written, value: Any) -> None:
    """Module paths (`model.layers.{*}`) or class paths (`package.module.DecoderLayer`, wrapping every instance)."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected a list of module or class paths")
    classes = [name for p in paths if (name := pattern_class(p)) is not None]
    modules = [p for p in paths if pattern_class(p) is None]
    if modules:
        translation.set(f"{STRATEGY_CONFIG}.sub_modules_to_wrap", modules, key)
    if classes:
        translation.set(f"{STRATEGY_CONFIG}.wrap_policy.transformer_layer_cls_to_wrap", classes, key)
        translation.note(
            f"mapped class paths of {key} → {STRATEGY_CONFIG}.wrap_policy.transformer_layer_cls_to_wrap={classes}"
        )


def _module_paths(native: str) -> Rule:
    """Module paths, or class paths standing for every module of that class (matched by class name)."""

    def rule(translation: Translation, key: Written, value: Any) -> None:
        paths = [value] if isinstance(value, str) else value
        if isinstance(paths, list) and (classes := [p for p in paths if pattern_class(str(p))]):
            translation.note(f"{key}: class paths {classes} stand for every module of that class")
        to(f"{STRATEGY_CONFIG}.{native}")(translation, key, value)

    return rule


def _offload(translation: Translation, key: Written, value: Any) -> None:
    to(f"{STRATEGY_CONFIG}.offload_policy")(translation, key, value)


def expert_module_patterns(key: Written, value: Any) -> list[str]:
    """The experts modules MindSpeed-MM splits by expert parallelism (`moe_modules`, `ep_plan.apply_modules`): fsdp2kit
    splits the fused `experts` module of every MoE block, so each pattern must name such modules."""
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected a list of module paths")
    others = [p for p in paths if p.rsplit(".", 1)[-1] != "experts"]
    if others:
        raise UserError(
            f"{key.file}: '{key}' = {others[0]!r} is not supported: fsdp2kit splits the fused experts of every MoE "
            "block (module paths ending in .experts, such as model.layers.{*}.mlp.experts)"
        )
    return paths


def expert_parallel(translation: Translation, size: Written, value: Any, modules: Written, paths: Any) -> bool:
    """MindSpeed-MM splits the experts when `size` > 1 and `modules` lists them; either alone splits nothing (noted).
    Returns whether expert parallelism is on."""
    if paths and value is not None and value != 1:
        expert_module_patterns(modules, paths)
        to(f"{STRATEGY_CONFIG}.ep_size")(translation, size, value)
        translation.note(f"{modules}: fsdp2kit splits the fused experts of every MoE block, as these paths name them")
        return True
    if value is not None and value != 1:
        translation.ignore(size, f"{modules} lists no module: MindSpeed-MM splits none")
    elif value is not None:
        to(f"{STRATEGY_CONFIG}.ep_size")(translation, size, value)
    if paths is not None:
        translation.ignore(modules, f"used only with {size} > 1")
    return False


def experts_sharded_over_the_rest(translation: Translation, size: Written, why: str, key: str) -> None:
    """MindSpeed-MM's default: each expert is sharded over world / expert_parallel_size ranks (one expert replica).
    fsdp2kit's efsdp_size is a number, fixed before the world size is known: 1 replicates the experts instead."""
    translation.note(
        f"{why}: MindSpeed-MM shards each expert over the world / {size} ranks that hold the same experts; fsdp2kit "
        f"keeps efsdp_size 1 (each of them holds the experts whole: the same training, more memory); set {key} to "
        "world / ep_size to shard them as MindSpeed-MM does"
    )


# MindSpeed's --context-parallel-algo (mindspeed/arguments.py, _add_cp_args and its checks): which of the
# context-parallel ranks attend by Ulysses (all-to-all over heads) and which by ring attention. The adaptive variants
# schedule the same ring differently.
CP_ALGOS = ("ulysses_cp_algo", "megatron_cp_algo", "hybrid_cp_algo", "adaptive_cp_algo", "hybrid_adaptive_cp_algo")


def context_parallel(translation: Translation, where: Written, values: dict[str, Any]) -> None:
    """`context_parallel_size` split by `context_parallel_algo` as MindSpeed splits it: Ulysses (ulysses_cp_algo),
    ring (megatron_cp_algo, adaptive_cp_algo), or both (hybrid_*: `ulysses_degree_in_cp` Ulysses ranks, consecutive,
    times context_parallel_size / ulysses_degree_in_cp ring ranks across them; mindspeed/core/parallel_state.py lays
    the ring ranks at stride ulysses_degree_in_cp, as fsdp2kit lays [dp, cp, sp])."""
    size_key, algo_key = where.child("context_parallel_size"), where.child("context_parallel_algo")
    degree_key = where.child("ulysses_degree_in_cp")
    algo, degree = values.get("context_parallel_algo"), values.get("ulysses_degree_in_cp")
    if algo not in CP_ALGOS:
        raise UserError(f"{where.file}: '{algo_key}' = {algo!r} is not valid: expected one of {', '.join(CP_ALGOS)}")
    size = converted(size_key, values.get("context_parallel_size", 1), whole_ranks)
    hybrid = size > 1 and algo.startswith("hybrid")
    if degree is not None and not hybrid:
        translation.ignore(degree_key, f"used only with {algo_key} hybrid_cp_algo and {size_key} > 1")
    if size == 1:
        translation.ignore(algo_key, f"{size_key} is 1: nothing is split")
    elif hybrid:
        if degree is None:
            raise UserError(
                f"{where.file}: '{algo_key}' = {algo!r} needs '{degree_key}', the Ulysses ranks of each "
                f"context-parallel group (MindSpeed's rule); give a divisor of '{size_key}' = {size}"
            )
        _hybrid(translation, size_key, size, degree_key, converted(degree_key, degree, whole_ranks))
        translation.note(f"{algo_key}={algo!r}: {size_key} split as MindSpeed splits it (Ulysses x ring)")
    else:
        native = "model.ulysses_size" if algo == "ulysses_cp_algo" else "model.context_parallel_size"
        to(native)(translation, size_key, size)
        translation.note(f"{algo_key}={algo!r}: {size_key}={size} read as {native}")


def _hybrid(translation: Translation, size_key: Written, size: int, degree_key: Written, degree: int) -> None:
    """MindSpeed refuses a Ulysses degree that does not divide the context-parallel size or leaves one ring rank."""
    ring, remainder = divmod(size, degree)
    if remainder or ring <= 1:
        valid = [str(d) for d in range(2, size) if size % d == 0]
        raise UserError(
            f"{degree_key.file}: '{degree_key}' = {degree} is not valid: it must divide '{size_key}' = {size} and be "
            f"smaller (MindSpeed's rule for hybrid context parallel); valid: {', '.join(valid) or 'none'}"
        )
    translation.set("model.ulysses_size", degree, degree_key)
    translation.set("model.context_parallel_size", ring, size_key)
    translation.note(
        f"mapped {size_key}={size} → model.ulysses_size={degree} ({degree_key}) x model.context_parallel_size={ring}"
    )


RULES: dict[str, Rule] = {
    "sharding_size": _sharding_size,
    "sub_modules_to_wrap": _sub_modules_to_wrap,
    "ignored_modules": _module_paths("ignored_modules"),
    "recompute_modules": _module_paths("recompute_modules"),
    **{
        key: to(f"{STRATEGY_CONFIG}.{key}")
        for key in (
            "reshard_after_forward",
            "param_dtype",
            "reduce_dtype",
            "output_dtype",
            "cast_forward_inputs",
            "use_reentrant",
            "num_to_forward_prefetch",
            "num_to_backward_prefetch",
        )
    },
    "offload_to_cpu": _offload,
    "pin_memory": lambda translation, key, value: None,  # read with offload_to_cpu (see _pin_memory)
    "align_fsdp_param_groups": ignored(
        "read by MindSpeed-MM's own Qwen3-VL models only; fsdp2kit's groups are unchanged"
    ),
    # read together (_expert_parallel): MindSpeed-MM's create_ep_device_mesh and _init_ep_model
    **dict.fromkeys(("expert_parallel_size", "reshard_local_experts", "moe_modules"), already_read),
}


def _expert_parallel(translation: Translation, data: dict[str, Any], where: Written) -> None:
    """Experts split over expert_parallel_size ranks; reshard_local_experts (default true) shards each expert
    further over the world / expert_parallel_size ranks holding the same experts, false keeps them whole there."""
    size, reshard = where.child("expert_parallel_size"), where.child("reshard_local_experts")
    if not expert_parallel(
        translation, size, data.get("expert_parallel_size"), where.child("moe_modules"), data.get("moe_modules")
    ):
        if data.get("reshard_local_experts") is not None:
            translation.ignore(reshard, f"used only with {size} > 1")
    elif data.get("reshard_local_experts") is False:
        to(f"{STRATEGY_CONFIG}.efsdp_size", lambda _: 1)(translation, reshard, False)
    else:
        why = f"{reshard}={data.get('reshard_local_experts', True)!r}"
        experts_sharded_over_the_rest(translation, size, why, f"{STRATEGY_CONFIG}.efsdp_size")


def _pin_memory(translation: Translation, data: dict[str, Any], where: Written) -> None:
    """MindSpeed-MM pins offloaded memory unless told not to; without offload, pin_memory does nothing."""
    offload, pin = data.get("offload_to_cpu") is True, data.get("pin_memory")
    if offload and pin is None:  # MindSpeed-MM's default, taken back if --set turns offload off
        translation.imply(
            f"{STRATEGY_CONFIG}.pin_memory", True, where.child("offload_to_cpu"), f"{STRATEGY_CONFIG}.offload_policy"
        )
    elif offload:
        translation.set(f"{STRATEGY_CONFIG}.pin_memory", pin, where.child("pin_memory"))
    elif pin is not None:
        translation.ignore(where.child("pin_memory"), "used only with offload_to_cpu")


def translate_file(translation: Translation, data: dict[str, Any], path: str) -> None:
    where = Written(path, "")
    translation.replace(STRATEGY_CONFIG, {}, where)
    translation.note(f"{STRATEGY_CONFIG} read from {path} (MindSpeed-MM fsdp2_config)")
    for key, default in DEFAULTS.items():
        if data.get(key) is None:
            data = {**data, key: default}
            translation.note(f"MindSpeed-MM default {key}={default!r} (the file does not set it)")
    if not data.get("sub_modules_to_wrap"):
        translation.note(
            "sub_modules_to_wrap not given: MindSpeed-MM leaves the shard groups to the model's own _fully_shard; "
            "fsdp2kit gives each decoder layer (_no_split_modules) its own group"
        )
    apply_rules(translation, data, RULES, where)
    _pin_memory(translation, data, where)
    _expert_parallel(translation, data, where)


def is_mindspeed_config(data: dict[str, Any]) -> bool:
    return bool(data) and all(key in RULES for key in data)
