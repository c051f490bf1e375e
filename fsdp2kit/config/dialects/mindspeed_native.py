"""MindSpeed-MM's native FSDP2 trainer YAML (`mindspeed_mm/fsdp/train/trainer.py`, the route its
docs/zh/features/fsdp2.md recommends), read as its parameter classes (`mindspeed_mm/fsdp/params/*.py`) and the code
that applies them read it: six sections `parallel`, `data`, `model`, `features`, `training`, `tools`.

Each section's keys go through a rule table as the other dialects' do; MindSpeed-MM's defaults where the file is silent
and they differ from fsdp2kit's are applied and noted. Older files put `features` keys under `model` (and `recompute`
under `parallel`); both places are read. A `--set` key that is not a native key but names a key of this file
(`features.enable_activation_offload=false`) is applied to the file before it is read.
"""

from __future__ import annotations

import copy
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from fsdp2kit.config.dialects.mindspeed import context_parallel, expert_parallel, experts_sharded_over_the_rest
from fsdp2kit.config.dialects.translation import (
    NO_FSDP2_MEANING,
    STRATEGY_CONFIG,
    Rule,
    Translation,
    Written,
    already_read,
    apply_rules,
    chat_template_name,
    file_trust_remote_code,
    ignored,
    section,
    to,
    unknown_key,
    unsupported,
    whole_ranks,
)
from fsdp2kit.config.dialects.translation import (
    file_overrides as split_overrides,
)
from fsdp2kit.config.schema import JobConfig, pattern_class
from fsdp2kit.errors import UserError

SECTIONS = ("parallel", "data", "model", "features", "training", "tools")
PARAMS = "mindspeed_mm/fsdp/params"  # where MindSpeed-MM defines each key, for notes
KERNELS = "an NPU/fused-kernel choice of the same computation"

# MindSpeed-MM's defaults (params/*.py) that differ from fsdp2kit's, applied where the file is silent.
DEFAULTS: dict[str, dict[str, Any]] = {
    "parallel": {"fsdp_plan": {"num_to_backward_prefetch": 0, "apply_modules": []}},
    "model": {"attn_implementation": "flash_attention_2"},
    "training": {"lr": 5e-5, "lr_decay_style": "constant", "train_iters": 10000},
}


def is_native_file(raw: dict[str, Any]) -> bool:
    """fsdp2kit's own files have no `parallel`, `features` or `tools` section; MindSpeed-MM's always have one."""
    return any(isinstance(raw.get(key), dict) for key in ("parallel", "features", "tools"))


def _written(raw: dict[str, Any], parts: list[str]) -> bool:
    """Whether the file writes the key at this dotted path."""
    node: Any = raw
    for part in parts:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _is_native_key(parts: list[str]) -> bool:
    """Whether a dotted path names a key of fsdp2kit's schema (then `--set` sets it after translation)."""
    model: type[BaseModel] = JobConfig
    for part in parts:
        fields = {**model.model_fields, **{a: model.model_fields[n] for a, n in getattr(model, "ALIASES", {}).items()}}
        if part not in fields:
            return False
        annotation = fields[part].annotation
        nested = [
            t
            for t in (annotation, *typing.get_args(annotation))
            if isinstance(t, type) and not isinstance(t, types.GenericAlias) and issubclass(t, BaseModel)
        ]
        if not nested:
            return True
        model = nested[0]
    return True


def file_overrides(raw: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--set` items naming a key of this file's own sections (one the file writes, or one that is not a native key)
    change the file before it is read, so `--set features.enable_activation_offload=false` turns off what the file
    turned on and `--set model.model_name_or_path=X` replaces the file's own key (as a native alias it would stand
    beside the translated model.name_or_path, a conflict the user never wrote)."""
    return split_overrides(
        raw, overrides, lambda parts: parts[0] in SECTIONS and (_written(raw, parts) or not _is_native_key(parts))
    )


# ---------------------------------------------------------------- parallel


def _fully_shard_size(translation: Translation, key: Written, value: Any) -> None:
    """`auto` is the world (no tensor parallelism here); an integer must divide the world, and 1 is DDP (MindSpeed-MM
    wraps the model in DistributedDataParallel): fsdp2kit's exact fsdp_size."""
    to(f"{STRATEGY_CONFIG}.fsdp_size")(translation, key, value)
    if value != "auto":
        translation.set(f"{STRATEGY_CONFIG}.fsdp_size_exact", True, key)


def _module_patterns(value: Any) -> list[str]:
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
        raise ValueError("expected a list of module paths such as model.layers.{*}")
    return paths


def _apply_modules(translation: Translation, key: Written, value: Any) -> None:
    """MindSpeed-MM shards exactly the matched modules and the root, bottom-up; none listed: the root alone. Its
    `mtp` head exists only with model.mtp_num_layers > 0 (MindSpeed-MM's own Qwen3.5 class; transformers' has none),
    and a pattern that matches nothing is skipped there as long as another one matches."""
    patterns = _module_patterns(value)
    kept = [p for p in patterns if p.split(".", 1)[0] != "mtp"]
    if len(kept) < len(patterns):
        translation.note(
            f"{key}: {[p for p in patterns if p not in kept]} dropped: MindSpeed-MM's multi-token-prediction head, "
            "built only with model.mtp_num_layers > 0"
        )
    classes = [name for p in kept if (name := pattern_class(p)) is not None]
    modules = [p for p in kept if pattern_class(p) is None]
    if classes:
        translation.set(f"{STRATEGY_CONFIG}.wrap_policy.transformer_layer_cls_to_wrap", classes, key)
    if modules:
        translation.set(f"{STRATEGY_CONFIG}.sub_modules_to_wrap", modules, key)
    if not kept:
        translation.set(f"{STRATEGY_CONFIG}.wrap_policy.no_wrap", True, key)
        translation.note(f"mapped {key}=[] → {STRATEGY_CONFIG}.wrap_policy.no_wrap=True (the root alone)")
    else:
        translation.note(f"mapped {key} → {STRATEGY_CONFIG}.sub_modules_to_wrap (only these and the root)")


def _cpu_offload(translation: Translation, key: Written, value: Any) -> None:
    """MindSpeed-MM's CPUOffloadPolicy pins host memory (`CPUOffloadPolicy(pin_memory=True)`)."""
    to(f"{STRATEGY_CONFIG}.offload_policy")(translation, key, value)
    if value is True:
        translation.imply(f"{STRATEGY_CONFIG}.pin_memory", True, key, f"{STRATEGY_CONFIG}.offload_policy")


FSDP_PLAN: dict[str, Rule] = {
    "apply_modules": _apply_modules,
    "ignored_modules": to(f"{STRATEGY_CONFIG}.ignored_modules", _module_patterns),
    **{
        name: to(f"{STRATEGY_CONFIG}.{name}")
        for name in (
            "param_dtype",
            "reduce_dtype",
            "output_dtype",
            "cast_forward_inputs",
            "reshard_after_forward",
            "num_to_forward_prefetch",
            "num_to_backward_prefetch",
        )
    },
    "cpu_offload": _cpu_offload,
    "hook_modules": ignored(
        "MindSpeed's patched fully_shard runs these modules' sub-groups under one hook; the shard groups are the same"
    ),
    "pregather": unsupported("MindSpeed-MM's pre-gathering of all parameters before each step", harmless=(False,)),
}


def _tp_plan(translation: Translation, key: Written, value: Any) -> None:
    """`tp_plan`'s lists of module patterns split by output columns (`colwise_parallel`) or input rows
    (`rowwise_parallel`): model.tensor_parallel_plan, in place of the family's own plan. MindSpeed-MM's FSDP2 trainer
    defines them but applies none (it refuses tensor_parallel_size > 1); fsdp2kit applies them as written."""
    if not isinstance(value, dict):
        raise UserError(f"{key.file}: '{key}' must be a mapping of colwise_parallel / rowwise_parallel lists")
    plan: dict[str, str] = {}
    for name, patterns in value.items():
        style = {"colwise_parallel": "colwise", "rowwise_parallel": "rowwise"}.get(name)
        if name == "sequence_parallel" and patterns:
            raise UserError(
                f"{key.file}: '{key.child(name)}' is not supported: fsdp2kit keeps the norms and activations "
                "between the split layers whole on every tensor-parallel rank; leave it empty"
            )
        if style is None and name != "sequence_parallel":
            raise UserError(f"{key.file}: unknown key '{key.child(name)}'; valid: colwise_parallel, rowwise_parallel")
        plan.update(dict.fromkeys(patterns or [], style))
    if plan:
        translation.set("model.tensor_parallel_plan", plan, key)
        translation.note(f"mapped {key} → model.tensor_parallel_plan ({len(plan)} patterns), in place of the family's")


def _recompute_pair(translation: Translation, key: Written, values: dict[str, Any], older: str | None) -> None:
    """`recompute: true` checkpoints the modules of `recompute_plan.apply_modules` (non-reentrant unless the plan says
    otherwise); the plan alone changes nothing (features/apply_features.py)."""
    plan = values.get("recompute_plan")
    if older is not None and (values.get("recompute") is not None or plan is not None):
        translation.note(f"{key.path}.recompute: read as features.recompute ({older})")
    if values.get("recompute") is not True:
        if values.get("recompute") is not None:
            translation.ignore(key.child("recompute"), "recompute is off")
        if plan is not None:
            translation.ignore(key.child("recompute_plan"), "used only with recompute: true")
        return
    if not isinstance(plan, dict) or not plan.get("apply_modules"):
        raise UserError(f"{key.file}: '{key.child('recompute')}' = True needs recompute_plan.apply_modules")
    where = key.child("recompute_plan")
    to(f"{STRATEGY_CONFIG}.recompute_modules", _module_patterns)(
        translation, where.child("apply_modules"), plan["apply_modules"]
    )
    to(f"{STRATEGY_CONFIG}.use_reentrant")(translation, where.child("use_reentrant"), plan.get("use_reentrant", False))
    translation.note(f"{key.child('recompute')}=True: the modules of {where.child('apply_modules')} are recomputed")
    unknown = set(plan) - {"apply_modules", "use_reentrant"}
    if unknown:
        raise UserError(f"{key.file}: unknown key '{where.child(sorted(unknown)[0])}'")


PARALLEL: dict[str, Rule] = {
    "fully_shard_parallel_size": _fully_shard_size,
    "data_parallel_size": ignored(
        "MindSpeed-MM refuses any value but world / (ulysses × ring × tensor sizes), which fsdp2kit derives"
    ),
    "fsdp_plan": section(FSDP_PLAN),
    "tensor_parallel_size": to("model.tensor_parallel_size", whole_ranks),
    "tp_plan": _tp_plan,
    "ring_attention_size": to("model.context_parallel_size"),
    "ulysses_parallel_size": to("model.ulysses_size"),
    **dict.fromkeys(("context_parallel_size", "context_parallel_algo", "ulysses_degree_in_cp"), already_read),
    **dict.fromkeys(("expert_parallel_size", "expert_fully_shard_parallel_size", "ep_plan"), already_read),
    **dict.fromkeys(("recompute", "recompute_plan"), already_read),
}


def _ep_dispatcher(translation: Translation, key: Written, value: Any) -> None:
    """How MindSpeed-MM exchanges the tokens with the experts' ranks (params/parallel_args.py EPPlanConfig)."""
    if value not in ("alltoall", "allgather", "mc2"):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected alltoall, allgather or mc2")
    translation.ignore(key, "fsdp2kit sends each token to its experts' ranks by all-to-all (the same result)")


EP_PLAN: dict[str, Rule] = {
    "apply_modules": already_read,
    "dispatcher": _ep_dispatcher,
    "use_npu_fused_ops": ignored(KERNELS),
    "apply_efsdp_modules": already_read,
}


def _expert_parallel(translation: Translation, key: Written, values: dict[str, Any]) -> None:
    """MindSpeed-MM splits the experts of ep_plan.apply_modules over expert_parallel_size ranks and FSDP-shards those
    modules (ep_plan.apply_efsdp_modules, default the same) over expert_fully_shard_parallel_size ranks (default:
    world / expert_parallel_size): distributed/torch_parallelize.py apply_ep_modules, parallel_state.py."""
    plan = values.get("ep_plan") or {}
    if not isinstance(plan, dict):
        raise UserError(f"{key.file}: '{key.child('ep_plan')}' must be a mapping of keys, not {plan!r}")
    size, shard, where = (key.child(k) for k in ("expert_parallel_size", "expert_fully_shard_parallel_size", "ep_plan"))
    modules = where.child("apply_modules")
    if unknown := sorted(set(plan) - set(EP_PLAN)):
        raise UserError(unknown_key(where.child(unknown[0]), list(EP_PLAN)))
    if not expert_parallel(translation, size, values.get("expert_parallel_size"), modules, plan.get("apply_modules")):
        unused = [shard] if values.get("expert_fully_shard_parallel_size") is not None else []
        unused += [where.child(name) for name in plan if name != "apply_modules" and plan[name] is not None]
        for name in unused:
            translation.ignore(name, f"used only with {size} > 1")
        return
    efsdp = plan.get("apply_efsdp_modules")
    if efsdp and efsdp != plan["apply_modules"]:
        raise UserError(
            f"{key.file}: '{where.child('apply_efsdp_modules')}' = {efsdp!r} is not supported: fsdp2kit shards the "
            f"experts it splits over the expert mesh, those of {modules}; drop it"
        )
    if values.get("expert_fully_shard_parallel_size") is None:
        experts_sharded_over_the_rest(translation, size, f"{shard} not given", str(shard))
    else:
        to(f"{STRATEGY_CONFIG}.efsdp_size")(translation, shard, values["expert_fully_shard_parallel_size"])
    apply_rules(translation, plan, EP_PLAN, where)


def _context_parallel(translation: Translation, where: Written, values: dict[str, Any]) -> None:
    """Older files' `context_parallel_size` is the ring size (ParallelArguments before ring_attention_size, at
    Ascend/MindSpeed-MM 4fbb3722: "Size for context parallelism(ring)"). With MindSpeed's `context_parallel_algo`
    beside it (its Megatron route's argument, which the FSDP2 trainer does not read) it is split as MindSpeed splits
    it: Ulysses and ring attention give the same result, only the layout differs."""
    if values.get("context_parallel_algo") is not None:
        context_parallel(translation, where, values)
        return
    size, size_key = values.get("context_parallel_size"), where.child("context_parallel_size")
    if size is not None:
        to("model.context_parallel_size")(translation, size_key, size)
        translation.note(f"{size_key}: older files' name of ring_attention_size")
    if values.get("ulysses_degree_in_cp") is not None:
        translation.ignore(where.child("ulysses_degree_in_cp"), "used only with context_parallel_algo hybrid_cp_algo")


# ---------------------------------------------------------------- features (and their older place under model)


# What MindSpeed-MM's models call their output embeddings (a path's last part): transformers' lm_head under any
# wrapper (language_model.lm_head in Kimi-K2.5, thinker.lm_head in Qwen3-Omni), Megatron's output_layer.
OUTPUT_EMBEDDINGS = ("lm_head", "output_layer")


def _chunk_loss(translation: Translation, key: Written, values: dict[str, Any]) -> None:
    """MindSpeed-MM computes the LM head and loss in chunks of chunkloss_plan.chunk_size tokens (the same loss); so
    does fsdp2kit's training.loss_chunk_tokens. Off, fsdp2kit still chunks above a 32k vocabulary (`auto`)."""
    plan = values.get("chunkloss_plan") or {}
    on = values.get("enable_chunk_loss") is True or values.get("enable_dynamic_chunk_loss") is True
    if not isinstance(plan, dict):
        raise UserError(f"{key.file}: '{key.child('chunkloss_plan')}' must be a mapping of keys, not {plan!r}")
    module = plan.get("apply_module", "lm_head")
    if on and (not isinstance(module, str) or module.rsplit(".", 1)[-1] not in OUTPUT_EMBEDDINGS):
        raise UserError(
            f"{key.file}: '{key.child('chunkloss_plan.apply_module')}' = {module!r} is not supported: fsdp2kit "
            "chunks the output embeddings (lm_head), named as MindSpeed-MM's models name them: lm_head, "
            "language_model.lm_head, thinker.lm_head, output_layer"
        )
    if values.get("enable_chunk_loss") is True:
        size = plan.get("chunk_size", 1024)
        to("training.loss_chunk_tokens")(translation, key.child("chunkloss_plan.chunk_size"), size)
        head = "" if module == "lm_head" else ", read as the model's LM head"
        translation.note(
            f"{key.child('enable_chunk_loss')}=True: the LM head ({key.child('chunkloss_plan.apply_module')}="
            f"{module!r}{head}) and the loss run in chunks of training.loss_chunk_tokens tokens"
        )
    elif values.get("enable_dynamic_chunk_loss") is True:
        translation.ignore(key.child("enable_dynamic_chunk_loss"), "fsdp2kit sizes its chunks itself (auto)")
    for name in ("chunkloss_plan", "enable_chunk_loss"):
        if values.get(name) is not None and not on:
            translation.ignore(key.child(name), "fsdp2kit chunks the loss above a 32k vocabulary (auto)")


def _activation_offload(translation: Translation, key: Written, values: dict[str, Any]) -> None:
    """`enable_activation_offload: true` sends what the modules of `activation_offload_plan.apply_modules` save for
    backward to host memory (features/memory/async_offload.py): fsdp2kit's activation_offload_modules."""
    plan = values.get("activation_offload_plan")
    if values.get("enable_activation_offload") is not True:
        for name in ("enable_activation_offload", "activation_offload_plan"):
            if values.get(name) is not None:
                translation.ignore(key.child(name), "activation offload is off")
        return
    where = key.child("activation_offload_plan")
    if not isinstance(plan, dict) or not plan.get("apply_modules"):
        raise UserError(f"{key.file}: '{key.child('enable_activation_offload')}' = True needs {where}.apply_modules")
    unknown = set(plan) - {"apply_modules"}
    if unknown:
        raise UserError(f"{key.file}: unknown key '{where.child(sorted(unknown)[0])}'")
    modules = where.child("apply_modules")
    to(f"{STRATEGY_CONFIG}.activation_offload_modules", _module_patterns)(translation, modules, plan["apply_modules"])
    translation.note(
        f"{key.child('enable_activation_offload')}=True: what the modules of {modules} save for backward waits in "
        "pinned host memory (CUDA; a no-op on a CPU)"
    )


LOSS_TYPES = {
    "default": "MindSpeed-MM divides each micro-batch's loss by its own target tokens and averages the micro-batches; "
    "fsdp2kit divides by the target tokens of the whole step (equal when micro-batches hold as many)",
    "raw": "the model's own loss (a token mean per micro-batch); fsdp2kit divides by the target tokens of the whole "
    "step (equal when micro-batches hold as many)",
    "per_token_loss": "",
}


def _loss_type(translation: Translation, key: Written, value: Any) -> None:
    if value not in LOSS_TYPES:
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not supported: valid: {', '.join(LOSS_TYPES)} "
            "(per_sample_loss is not available in fsdp2kit)"
        )
    if LOSS_TYPES[value]:
        translation.note(f"{key}={value!r}: {LOSS_TYPES[value]}")
    else:
        translation.ignore(key, "fsdp2kit divides by the target tokens of the whole step, as per_token_loss does")


LOSS_CFG: dict[str, Rule] = {
    "loss_type": _loss_type,
    "router_aux_loss_coef": unsupported(
        "MindSpeed-MM then asks the model for router logits; set output_router_logits and router_aux_loss_coef in "
        "the model's config (model.config) instead",
        harmless=(0, 0.0),
    ),
    "router_aux_loss_offload": unsupported("an NPU memory switch of the auxiliary loss", harmless=(False,)),
}


def _ep_balance(translation: Translation, key: Written, value: Any) -> None:
    """MindSpeed-MM's EP load balancing copies busy experts to idle ranks for a step (docs/zh/features/EP_balance.md):
    the same experts and gradients, computed elsewhere. fsdp2kit keeps each expert on its rank."""
    if value is True:
        translation.note(
            f"{key}=True: MindSpeed-MM's load balancing (copies of busy experts on idle ranks) is not done: each "
            "expert computes on its own rank (the same training, without the balancing)"
        )
    else:
        translation.ignore(key, "EP load balancing is off")


FEATURE_PAIRS = ("recompute", "recompute_plan", "enable_chunk_loss", "enable_dynamic_chunk_loss", "chunkloss_plan")
FEATURES: dict[str, Rule] = {
    **dict.fromkeys(FEATURE_PAIRS, already_read),
    **dict.fromkeys(("enable_activation_offload", "activation_offload_plan"), already_read),
    "loss_cfg": section(LOSS_CFG),
    "enable_chunk_mbs": ignored(
        "MindSpeed-MM splits each micro-batch inside the listed layers to save activation memory; the step's "
        "result is the same"
    ),
    "chunkmbs_plan": ignored("read only with enable_chunk_mbs"),
    "enable_ep_balance": _ep_balance,
    "ep_balance_plan": ignored("settings of enable_ep_balance, MindSpeed-MM's EP load balancing"),
    "skip_moe_pad_tokens": unsupported("MoE routing that skips padding tokens is not available", harmless=(False,)),
}


def _read_features(translation: Translation, values: Any, where: Written, older: str | None = None) -> None:
    """The feature switches read with their plans (features/apply_features.py)."""
    if not isinstance(values, dict):
        raise UserError(f"{where.file}: '{where}' must be a mapping of keys, not {values!r}")
    _recompute_pair(translation, where, values, older)
    _chunk_loss(translation, where, values)
    _activation_offload(translation, where, values)


# ---------------------------------------------------------------- model


def _attention(value: Any) -> str:
    """flash_attention_2/3 are kernels of the same attention: fsdp2kit runs flash_attention_2 where flash-attn is
    installed on CUDA, else transformers' choice for the family (check says which). native-sparse is another
    attention."""
    names = {"sdpa": "sdpa", "eager": "eager", "flash_attention_2": "flash_attention_2"}
    names["flash_attention_3"] = "flash_attention_2"
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)} (native-sparse is MindSpeed-MM's own attention)")
    return names[value]


MODEL: dict[str, Rule] = {
    "model_name_or_path": to("model.name_or_path"),
    "trust_remote_code": file_trust_remote_code,
    "attn_implementation": to("model.attn_implementation", _attention),
    "freeze": to("model.freeze_module_prefix", _module_patterns),
    "model_id": ignored("MindSpeed-MM's model registry name; fsdp2kit builds the class config.json names"),
    "mtp_num_layers": unsupported(
        "MindSpeed-MM's multi-token-prediction head is not available in fsdp2kit (transformers' models have none)",
        harmless=(0,),
    ),
    "mtp_loss_scaling_factor": ignored("used only with mtp_num_layers > 0"),
    **dict.fromkeys(
        ("gdn_implementation", "causal_conv1d_implementation", "use_grouped_expert_matmul", "kda_implementation"),
        ignored(KERNELS),
    ),
    **dict.fromkeys(
        ("skip_gdn_recompute", "skip_flash_attn_recompute", "skip_kda_recompute"),
        ignored(
            "MindSpeed-MM keeps these kernels' outputs instead of recomputing them; fsdp2kit recomputes the "
            "whole module (the same gradients)"
        ),
    ),
    **dict.fromkeys((*FEATURE_PAIRS, "enable_activation_offload", "activation_offload_plan"), already_read),
    "loss_cfg": section(LOSS_CFG),
}


# ---------------------------------------------------------------- data


def _dataset_files(value: Any) -> str | list[str]:
    """`datasets.load_dataset("json", data_files=...)`: one file, a comma-separated string or a list."""
    files = [f.strip() for f in value.split(",")] if isinstance(value, str) else value
    if not isinstance(files, list) or not files or not all(isinstance(f, str) for f in files):
        raise ValueError("expected a data file, a comma-separated string of files or a list of files")
    return files[0] if len(files) == 1 else files


# LLaMA-Factory's dataset attributes as fsdp2kit's conversation reader takes them: a `messages` list of
# {role, content} turns with user/assistant roles, images in an `images` column.
READ_AS_WRITTEN_ATTR = {
    "messages": "messages",
    "role_tag": "role",
    "content_tag": "content",
    "user_tag": "user",
    "assistant_tag": "assistant",
    "system_tag": "system",
    "images": "images",
    "formatting": "sharegpt",
}
ATTR: dict[str, Rule] = {
    name: unsupported(f"fsdp2kit reads conversations whose {name} is {expected!r}", harmless=(expected,))
    for name, expected in READ_AS_WRITTEN_ATTR.items()
}
ATTR.update(
    dict.fromkeys(
        ("observation_tag", "function_tag", "system", "tools"), ignored("tool-call and system columns, not read")
    )
)
ATTR.update(
    dict.fromkeys(
        ("prompt", "query", "response", "history", "chosen", "rejected", "videos", "audios", "ranking"),
        unsupported("alpaca, preference, video and audio columns are not read from conversations", harmless=(False,)),
    )
)


def _dataset_dir(translation: Translation, key: Written, value: Any) -> None:
    """A folder holding LLaMA-Factory's registry (dataset_info.json) is data.dataset_dir: `dataset` then names its
    datasets, unless what `dataset` gives are existing files (read first, `_basic_parameters`): a file is that file.
    Any other folder is where MindSpeed-MM reads media from, which fsdp2kit reads beside the data file."""
    given = translation.get("data.source")
    files = [given] if isinstance(given, str) else given if isinstance(given, list) else []
    names_files = bool(files) and all(Path(str(f)).expanduser().is_file() for f in files)
    if not names_files and isinstance(value, str) and (Path(value).expanduser() / "dataset_info.json").is_file():
        to("data.dataset_dir")(translation, key, value)
        translation.note(f"{key}: its dataset_info.json names the datasets that 'dataset' gives")
    else:
        translation.ignore(key, "the folder MindSpeed-MM reads media from; fsdp2kit reads them beside the data file")


def _val_size(translation: Translation, key: Written, value: Any) -> None:
    """LLaMA-Factory's val_size: a fraction (< 1) of the dataset held out for evaluation; 0 holds out nothing."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not valid: expected a fraction of the dataset (0 <= x < 1)"
        )
    if value == 0:
        translation.ignore(key, "0 holds out nothing")
    elif value < 1:
        to("data.eval_fraction")(translation, key, float(value))
    else:
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not supported: fsdp2kit holds out a fraction of the samples; "
            "give val_size < 1"
        )


BASIC_PARAMETERS: dict[str, Rule] = {
    "dataset": to("data.source", _dataset_files),
    "val_size": _val_size,
    "cutoff_len": to("data.seq_len"),
    "max_samples": to("data.max_samples"),
    "template": chat_template_name,
    "enable_thinking": ignored("an argument of the chat template; the model's own template decides"),
    "train_on_prompt": to("data.train_on_prompt"),
    "mask_history": to("data.mask_history"),
    "dataset_dir": _dataset_dir,
    **dict.fromkeys(
        (
            "cache_dir",
            "overwrite_cache",
            "preprocess_on_fly",
            "preprocessing_batch_size",
            "preprocessing_num_workers",
            "tool_format",
            "streaming",
        ),
        ignored("MindSpeed-MM's preprocessing cache and workers; fsdp2kit builds samples as batches need them"),
    ),
}


def _basic_parameters(translation: Translation, key: Written, value: Any) -> None:
    """`dataset` first, whatever the file's order: whether dataset_dir is a registry depends on it."""
    if isinstance(value, dict) and "dataset" in value:
        value = {"dataset": value["dataset"], **value}
    section(BASIC_PARAMETERS)(translation, key, value)


PREPROCESS_PARAMETERS: dict[str, Rule] = {
    "model_name_or_path": already_read,
    "trust_remote_code": file_trust_remote_code,
    "fix_mistral_regex": ignored(
        "a loading fix for some Mistral-family tokenizers' pre-tokenizer pattern; fsdp2kit loads the model "
        "folder's tokenizer as it is saved"
    ),
    **dict.fromkeys(
        (
            "use_fast_tokenizer",
            "split_special_tokens",
            "image_max_pixels",
            "image_min_pixels",
            "video_max_pixels",
            "video_min_pixels",
            "video_fps",
            "video_maxlen",
            "image_resolution",
            "audio_sampling_rate",
        ),
        ignored("processor settings; fsdp2kit uses the model folder's processor as it is saved"),
    ),
}

DATASET_PARAM: dict[str, Rule] = {
    "dataset_type": unsupported("fsdp2kit reads LLaMA-Factory files", harmless=("huggingface",)),
    "attr": section(ATTR),
    "basic_parameters": _basic_parameters,
    "preprocess_parameters": section(PREPROCESS_PARAMETERS),
}

DATALOADER_PARAM: dict[str, Rule] = {
    "shuffle": to("data.shuffle"),
    **dict.fromkeys(
        (
            "pin_memory",
            "dataloader_mode",
            "drop_last",
            "sampler_type",
            "num_workers",
            "collate_param",
            "enable_preload",
        ),
        ignored("DataLoader settings; fsdp2kit's batches are whole and in a seeded order"),
    ),
}

DATA: dict[str, Rule] = {
    "dataset_param": section(DATASET_PARAM),
    "val_dataset_param": ignored(
        "a validation dataset of its own is not read; the evaluation set is basic_parameters.val_size (or the "
        "native data.eval_source)"
    ),
    "dataloader_param": section(DATALOADER_PARAM),
}


# ---------------------------------------------------------------- training and tools


def _load(translation: Translation, key: Written, value: Any, model_path: Any) -> None:
    """MindSpeed-MM's weights come from `load` (HF or its DCP); fsdp2kit reads them from the model folder itself."""
    if value == model_path:
        translation.note(f"{key}: the weights of model.model_name_or_path, which fsdp2kit reads from it")
        return
    raise UserError(
        f"{key.file}: '{key}' = {value!r} is not supported: fsdp2kit reads the weights from the model folder "
        "(model.model_name_or_path); give an HF folder there (MindSpeed-MM's DCP: mm-convert ... dcp_to_hf), or "
        "drop it to start from the model folder's weights"
    )


def _optimizer(translation: Translation, key: Written, value: Any) -> None:
    """MindSpeed-MM's FSDP2 trainer builds AdamW, Muon (for 2-D matrices, AdamW for the rest) or adamw_swap (AdamW
    whose states wait in host memory between steps)."""
    if value == "adamw_swap":
        raise UserError(
            f"{key.file}: '{key}' = 'adamw_swap' is not supported: fsdp2kit keeps AdamW's states on the device "
            "between steps; write adamw, or adamw with parallel.fsdp_plan.cpu_offload: true to keep parameters, "
            "gradients and optimizer states (and the step) on the host"
        )
    to("training.optimizer")(translation, key, value)


CHECKPOINT_SWITCHES = ("no_load_optim", "no_load_rng", "no_save_optim", "no_save_rng", "load_strict")
TRAINING: dict[str, Rule] = {
    "micro_batch_size": to("training.per_device_train_batch_size"),
    "gradient_accumulation_steps": to("training.gradient_accumulation_steps"),
    "seed": to("training.seed"),
    "lr": to("training.learning_rate"),
    "lr_min": unsupported("fsdp2kit's schedules decay to 0", harmless=(0, 0.0)),
    "lr_start": unsupported("fsdp2kit warms up from 0", harmless=(0, 0.0)),
    "lr_decay_ratio": unsupported("fsdp2kit decays over the whole run", harmless=(1, 1.0)),
    "lr_decay_style": to("training.lr_scheduler_type"),
    "lr_warmup_ratio": to("training.warmup_ratio"),
    "weight_decay": to("training.weight_decay"),
    "adam_beta1": to("training.adam_beta1"),
    "adam_beta2": to("training.adam_beta2"),
    "adam_eps": to("training.adam_epsilon"),
    "clip_grad": to("training.max_grad_norm"),
    "train_iters": to("training.max_steps"),
    "train_epochs": to("training.num_train_epochs"),
    "init_model_with_meta_device": to("model.init_on_meta"),
    "save": to("training.output_dir"),
    "save_interval": to("training.save_steps"),
    "save_async": to(f"{STRATEGY_CONFIG}.async_save_ckpt"),
    "save_format": unsupported(
        "fsdp2kit saves DCP checkpoints (and an HF export at the end)", harmless=("dcp", "auto")
    ),
    "load": already_read,
    "load_format": unsupported("fsdp2kit reads HF folders", harmless=("auto", "hf")),
    "load_rank0_and_broadcast": to("model.weights_loading", lambda on: "rank0_broadcast" if on else "sliced"),
    "optimizer": _optimizer,
    "log_interval": to("training.logging_steps"),
    "plugin": ignored("paths of MindSpeed-MM's own model and dataset plugins"),
    "lora": to("model.lora"),
    "profile": already_read,
    "val_interval": to("training.eval_steps"),
    **dict.fromkeys(
        ("adam_fused", "clip_grad_foreach", "use_deter_comp", "allow_hf32", "manual_gc_interval", "ckpt_manager"),
        ignored(KERNELS),
    ),
    "mem_fraction_static": ignored("used only by the adamw_swap optimizer"),
    "matched_adamw_rms": to("training.muon_matched_adamw_rms"),
    "muon_momentum": to("training.muon_momentum"),
    "ns_steps": to("training.muon_ns_steps"),
    "val_micro_batch_size": to("training.per_device_eval_batch_size"),
    **dict.fromkeys(CHECKPOINT_SWITCHES, ignored("fsdp2kit saves and resumes the whole training state")),
    **dict.fromkeys(
        ("no_decay_modules", "no_decay_params"),
        unsupported(
            "exclusions from weight decay by module class or name are not available; fsdp2kit decays every "
            "parameter (as MindSpeed-MM with these lists empty) or, with training.weight_decay_every_parameter: "
            "false, all but biases and norms (1-D tensors)",
            harmless=([],),
        ),
    ),
    "save_ckpt_dtype": unsupported("checkpoints keep the training dtype"),
    "max_steps": unsupported("MindSpeed-MM's per-epoch step cap (for debugging); use train_iters"),
    "enable_full_determinism": unsupported("deterministic kernels are not switched on", harmless=(False,)),
    "lr_scaling_plan": unsupported("per-layer learning rates are not available"),
    "quantization_plan": section(
        {
            "recipe_name": unsupported(
                "MindSpeed-MM's quantization recipes (its MX formats) are not read; float8 training with torchao's "
                "tensorwise or rowwise recipes is strategy_args.strategy_config.float8",
                harmless=(None,),
            ),
            **dict.fromkeys(
                (
                    "apply_modules",
                    "ignored_modules",
                    "quant_converters",
                    "extra_args",
                    "enable_fsdp_low_precision_all_gather",
                    "fsdp_low_precision_all_gather_mode",
                ),
                ignored("used only with quantization_plan.recipe_name"),
            ),
        }
    ),
    "load_checkpoint_path": unsupported("give the checkpoint as training.resume (fsdp2kit's own checkpoints)"),
    "save_steps": unsupported("MindSpeed-MM saves every save_interval steps; use that key"),
}


def _profile(translation: Translation, key: Written, value: Any) -> None:
    """tools.profile.static_param.start_step/end_step (or the older training.profile.start_step/end_step) become
    training.profile_steps when profiling is on."""
    if not isinstance(value, dict):
        raise UserError(f"{key.file}: '{key}' must be a mapping of keys, not {value!r}")
    if value.get("enable") is not True:
        translation.ignore(key, "profiling is off")
        return
    steps = value.get("static_param", value)
    first, last = steps.get("start_step", 1), steps.get("end_step", 2)
    translation.set("training.profile_steps", [first, last], key.child("start_step"))
    translation.note(f"mapped {key} steps {first}..{last} → training.profile_steps (torch.profiler)")


def _memory_profile(translation: Translation, key: Written, value: Any) -> None:
    if isinstance(value, dict) and value.get("enable") is True:
        raise UserError(
            f"{key.file}: '{key}.enable' = True is not supported: memory snapshots are not written; "
            "use training.track_memory"
        )
    translation.ignore(key, "memory profiling is off")


TOOLS: dict[str, Rule] = {"profile": _profile, "memory_profile": _memory_profile}


# ---------------------------------------------------------------- the file


def _with_defaults(raw: dict[str, Any], translation: Translation) -> dict[str, Any]:
    """A copy with MindSpeed-MM's defaults where the file is silent (noted)."""
    data = copy.deepcopy(raw)

    def fill(node: dict[str, Any], defaults: dict[str, Any], where: str) -> None:
        for key, default in defaults.items():
            if isinstance(default, dict):
                node[key] = node.get(key) or {}
                fill(node[key], default, f"{where}.{key}")
            elif node.get(key) is None:
                node[key] = default
                translation.note(f"MindSpeed-MM default {where}.{key}={default!r} (the file does not set it)")

    for name, defaults in DEFAULTS.items():
        data[name] = data.get(name) or {}
        fill(data[name], defaults, name)
    for name in SECTIONS:
        if not isinstance(data.get(name, {}), dict):
            raise UserError(f"{translation.source}: '{name}' must be a mapping of keys, not {data[name]!r}")
    return data


def translate(raw: dict[str, Any], source: str) -> Translation:
    translation = Translation(source)
    translation.note(f"{source}: MindSpeed-MM native FSDP2 trainer config (mindspeed_mm/fsdp/train/trainer.py)")
    data = _with_defaults(raw, translation)
    top = Written(source, "")
    _read_features(translation, data["parallel"], top.child("parallel"), older="older MindSpeed-MM files")
    _expert_parallel(translation, top.child("parallel"), data["parallel"])
    _context_parallel(translation, top.child("parallel"), data["parallel"])
    if data.get("features") is not None:
        _read_features(translation, data["features"], top.child("features"))
    _read_features(translation, data["model"], top.child("model"), older="older MindSpeed-MM files")
    _weights(translation, data["model"], data["training"], top)
    _processor(translation, data, top)
    if isinstance(data["training"].get("profile"), dict):
        _profile(translation, top.child("training.profile"), data["training"]["profile"])
    apply_rules(translation, data, TOP_LEVEL, top)
    translation.set("data.pack", False, top.child("data"))
    translation.note("data.pack=False: MindSpeed-MM pads each sample to its own length, never packs")
    _weight_decay(translation, data["training"], top)
    _muon_split(translation, data["training"], top)
    return translation


TOP_LEVEL: dict[str, Rule] = {
    "parallel": section(PARALLEL),
    "data": section(DATA),
    "model": section(MODEL),
    "features": section(FEATURES),
    "training": section(TRAINING),
    "tools": section(TOOLS),
}


def _weights(translation: Translation, model: dict[str, Any], training: dict[str, Any], top: Written) -> None:
    """MindSpeed-MM reads the weights from training.load (and saves every save_interval steps only with `save`)."""
    if training.get("load") is not None:
        _load(translation, top.child("training.load"), training["load"], model.get("model_name_or_path"))
    elif training.get("init_model_with_meta_device") is True:
        translation.note(
            "training.load not given: MindSpeed-MM initialises the weights randomly; fsdp2kit reads the model "
            "folder's weights where it has them"
        )
    if training.get("save") is not None and training.get("save_interval") is None:
        training["save_interval"] = 1
        translation.note("MindSpeed-MM default training.save_interval=1 (the file does not set it)")


def _processor(translation: Translation, data: dict[str, Any], top: Written) -> None:
    """preprocess_parameters.model_name_or_path names the tokenizer/processor; the model's own when it is the same."""
    dataset = (data.get("data") or {}).get("dataset_param") or {}
    path = (dataset.get("preprocess_parameters") or {}).get("model_name_or_path")
    key = top.child("data.dataset_param.preprocess_parameters.model_name_or_path")
    if path is not None and path != data["model"].get("model_name_or_path"):
        to("data.tokenizer")(translation, key, path)
    elif path is not None:
        translation.note(f"{key}: the model folder's own tokenizer and processor (model.model_name_or_path)")


def _weight_decay(translation: Translation, training: dict[str, Any], top: Written) -> None:
    """MindSpeed-MM's build_optimizer (mindspeed_mm/fsdp/optimizer/optimizer.py) decays every parameter but those
    of training.no_decay_modules / no_decay_params, both empty by default (refused otherwise): whatever the value,
    so that a --set of weight_decay decays as MindSpeed-MM would."""
    where = top.child("training.weight_decay") if training.get("weight_decay") is not None else top.child("training")
    translation.set("training.weight_decay_every_parameter", True, where)
    translation.note(
        "training.weight_decay_every_parameter=True: MindSpeed-MM decays every parameter, biases and norms too "
        "(no_decay_modules and no_decay_params empty)"
    )


def _muon_split(translation: Translation, training: dict[str, Any], top: Written) -> None:
    """MindSpeed-MM's FSDP2 trainer gives Muon the parameters its `_is_muon_eligible` picks, which differ from
    fsdp2kit's default: its rule, whatever the file's optimizer, so that a --set of optimizer muon splits as
    MindSpeed-MM would."""
    where = top.child("training.optimizer") if training.get("optimizer") is not None else top.child("training")
    translation.set("training.muon_split", "mindspeed_mm", where)
    if training.get("optimizer") == "muon":
        translation.note(
            "training.muon_split=mindspeed_mm: Muon takes what MindSpeed-MM's _is_muon_eligible picks, every 2-D "
            "parameter whose name has no 'embedding' or 'output_layer' and does not end in '.bias' (with HF names "
            "the embeddings, LM head and routers too; 3-D stacked experts to AdamW); fsdp2kit's own split: "
            "--set training.muon_split=hidden_matrices"
        )


__all__ = ["NO_FSDP2_MEANING", "PARAMS", "file_overrides", "is_native_file", "translate"]
