"""ROLL (alibaba/ROLL) pipeline files, read as ROLL's own examples are written.

Top-level roles (`actor_train:`, `reference:`, `critic:`, `actor_infer:` ...) each hold `model_args`,
`training_args`, `data_args`, `strategy_args`, `device_mapping` and `infer_batch_size`; pipeline keys sit beside
them (`pretrain`, `seed`, `sequence_length`, `rollout_batch_size` ...). One role becomes the native config: the
one named by `--role`, else the first whose strategy is ours. Keys the file omits take ROLL's defaults where
those differ from fsdp2kit's, so the file means what it means under ROLL.
"""

from __future__ import annotations

import operator
from typing import Any

from fsdp2kit.config.dialects.translation import (
    NO_FSDP2_MEANING,
    STRATEGY_CONFIG,
    Rule,
    Translation,
    Written,
    already_read,
    apply_rules,
    chat_template_name,
    comma_list,
    converted,
    file_trust_remote_code,
    ignored,
    section,
    to,
    transformers_schedule,
    unsupported,
)
from fsdp2kit.config.dialects.translation import (
    file_overrides as split_overrides,
)
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.errors import UserError

OUR_STRATEGIES = ("fsdp2_train", "fsdp2_infer")
ROLL_DEFAULT_STRATEGY = "deepspeed_train"  # what ROLL runs when strategy_args names none
# ROLL's defaults (roll/configs/base_config.py, worker_config.py, model_args.py) that differ from fsdp2kit's.
TOP_DEFAULTS = {"output_dir": "./output", "save_steps": 50, "resume_from_checkpoint": False}
# ROLL's SFT pipeline (roll/pipeline/sft/sft_config.py) reads these dataset fields unless the file names others.
SFT_DEFAULTS = {"prompt_key": "instruction", "response_key": "output"}
# The top-level key that names each role's model (roll/configs/base_config.py, pipeline/distill, pipeline/sft).
ROLE_MODEL_KEYS = {"student": "student_pretrain", "teacher": "teacher_pretrain", "critic": "reward_pretrain"}
# What ROLL's fsdp2 strategy (roll/distributed/strategy/fsdp2_strategy.py, roll/utils/fsdp_utils.py) does where
# the file is silent: bf16 compute, fp32 gradient reduction, uncast inputs into every layer group and the root,
# and untied input embeddings in a shard group of their own.
STRATEGY_DEFAULTS = {
    "param_dtype": "bf16",
    "reduce_dtype": "fp32",
    "cast_forward_inputs": False,
    "wrap_policy": {"wrap_embeddings": False},
}
DROPPED = "not a field of ROLL's {}: ROLL drops it (dacite reads only known fields)"


def _role_defaults(strategy: str, role: dict[str, Any]) -> dict[str, Any]:
    model_args: dict[str, Any] = {"dtype": "bf16"}
    if strategy == "fsdp2_train":
        model_args["disable_gradient_checkpointing"] = False  # ROLL recomputes every layer unless told not to
        # Unset, ROLL recomputes a dense model non-reentrant (roll/models/model_providers.py); a MoE it recomputes
        # reentrant, where fsdp2kit stays non-reentrant for the router loss's graph (`reentrant_allowed`): the same
        # gradients either way.
        model_args["gradient_checkpointing_use_reentrant"] = False
    defaults: dict[str, Any] = {"infer_batch_size": 16, "use_sequence_packing": False, "model_args": model_args}
    if strategy in OUR_STRATEGIES and not (role.get("strategy_args") or {}).get("strategy_config_path"):
        defaults["strategy_args"] = {"strategy_config": STRATEGY_DEFAULTS}
    return defaults


def _attention(value: str) -> str:
    """ROLL's attention names: fa2 is flash_attention_2 (run where flash-attn is installed on CUDA, else
    transformers' choice for the family, which computes the same attention); auto is transformers' choice."""
    names = {
        "sdpa": "sdpa",
        "eager": "eager",
        "auto": "auto",
        "fa2": "flash_attention_2",
        "flash_attention_2": "flash_attention_2",
    }
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return names[value]


def _scheduler(value: str) -> str:
    """HF scheduler names. fsdp2kit warms up for warmup_steps before any schedule, so constant_with_warmup is its
    `constant`; HF's `constant` skips the warmup (`_training_args` drops it)."""
    names = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return names[value]


def _resume(value: bool | str) -> str:
    """ROLL: false = start fresh, true = the newest checkpoint in output_dir, a string = that checkpoint."""
    if value is True:
        return "auto"
    return "never" if value is False else str(value)


def _files(value: str | list[str]) -> str | list[str]:
    """ROLL loads one file or a list of files (datasets' data_files); a one-item list is that file."""
    if isinstance(value, list) and all(isinstance(item, str) for item in value) and value:
        return value[0] if len(value) == 1 else value
    if isinstance(value, str):
        return value
    raise ValueError("expected a file name or a list of file names")


def _whole_steps(value: Any) -> int:
    """A step interval: a whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 or value != int(value):
        raise ValueError("expected a whole number of steps >= 0")
    return int(value)


def _probabilities(value: Any) -> list[float]:
    """ROLL's interleave_probs: '0.7,0.3' or [0.7, 0.3]."""
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    try:
        return [float(item) for item in items]
    except (TypeError, ValueError):
        raise ValueError("expected comma-separated probabilities, one per file of file_name") from None


def _interleaved_files(translation: Translation, data_args: Any, where: Written) -> None:
    """ROLL's interleave_probs with one probability per file of file_name: a weighted mixture. Anything else (ROLL's
    examples write '1.0' beside several files) leaves the files one source."""
    if not isinstance(data_args, dict) or data_args.get("interleave_probs") is None:
        return
    files, key = data_args.get("file_name"), where.child("interleave_probs")
    weights = converted(key, data_args["interleave_probs"], _probabilities)
    if not isinstance(files, list) or len(files) < 2 or len(weights) != len(files):
        return
    translation.set("data.source", [{"path": f, "weight": w} for f, w in zip(files, weights, strict=True)], key)
    translation.note(f"mapped {where.child('file_name')} with {key} → data.source: a mixture of {len(files)} files")


def _file_name(translation: Translation, key: Written, value: Any) -> None:
    if not is_mixture_dict(translation.get("data.source")):  # else read with interleave_probs
        to("data.source", _files)(translation, key, value)


def _interleave_probs(translation: Translation, key: Written, value: Any) -> None:
    if not is_mixture_dict(translation.get("data.source")):
        translation.ignore(key, "ROLL prompt-data settings")


def is_mixture_dict(source: Any) -> bool:
    """Whether a data.source value (as translated, before validation) is a list of {path, weight} mappings."""
    return isinstance(source, list) and any(isinstance(item, dict) for item in source)


def _validation(translation: Translation, key: Written, value: Any) -> None:
    """ROLL's SFT pipeline evaluates the loss on `validation.data_args.file_name` every eval_steps."""
    data_args = value.get("data_args") if isinstance(value, dict) else None
    files = data_args.get("file_name") if isinstance(data_args, dict) else None
    if data_args is None or files is None:
        translation.ignore(key, "no validation.data_args.file_name")
        return
    data_key = key.child("data_args")
    to("data.eval_source", _files)(translation, data_key.child("file_name"), files)
    unread = [data_key.child(k) for k in data_args if k != "file_name"] + [
        key.child(k) for k in value if k != "data_args"
    ]
    for other in unread:
        translation.ignore(other, "validation settings besides its data file (evaluated like the training data)")


def _model_type(translation: Translation, key: Written, value: Any) -> None:
    """ROLL's value model (`auto_token_classification`, its critic's: AutoModelForTokenClassification of the
    family, one label) as fsdp2kit's critic; its trl value head and sequence classifiers are refused."""
    if value != "auto_token_classification":
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not supported: fsdp2kit trains causal language models (model_type: ~) "
            "and critics (model_type: auto_token_classification); ROLL's trl value head and reward models are not"
        )
    translation.set("model.model_class", "transformers:AutoModelForTokenClassification", key)
    translation.set("model.config.num_labels", 1, key)
    translation.note(f"mapped {key} = {value} → a critic: model.model_class AutoModelForTokenClassification, one label")


def _wrap_embeddings(value: bool) -> bool | str:
    """ROLL wraps the embeddings when asked, and untied ones always (`nn.Embedding` modules when not tied)."""
    return True if value else "untied"


def _offload_policy(translation: Translation, key: Written, value: Any) -> None:
    """ROLL's CPUOffloadPolicy always pins the host memory."""
    to(f"{STRATEGY_CONFIG}.offload_policy")(translation, key, value)
    if value is True:
        translation.imply(f"{STRATEGY_CONFIG}.pin_memory", True, key, f"{STRATEGY_CONFIG}.offload_policy")


def _strategy_config(translation: Translation, key: Written, value: Any) -> None:
    """ROLL reads wrap_policy.moe_experts only with apply_expert_patch or expert parallelism: else it is unused."""
    if isinstance(value, dict) and isinstance(value.get("wrap_policy"), dict) and not _wraps_experts(value):
        if value["wrap_policy"].get("moe_experts"):
            value = {**value, "wrap_policy": dict(value["wrap_policy"])}
            del value["wrap_policy"]["moe_experts"]
            translation.ignore(
                key.child("wrap_policy.moe_experts"), "ROLL wraps experts only with apply_expert_patch or ep_size > 1"
            )
    if isinstance(value, dict) and value.get("apply_expert_patch") is True:
        translation.note(
            f"{key}.apply_expert_patch: ROLL turns it off with transformers >= 5.2 (fused experts); fsdp2kit applies it"
        )
    translation.section_origin(STRATEGY_CONFIG, key)
    apply_rules(translation, value, STRATEGY_CONFIG_RULES, key, otherwise=_native_strategy_key)


def _wraps_experts(strategy_config: dict[str, Any]) -> bool:
    """ROLL's condition for wrapping wrap_policy.moe_experts (roll/utils/fsdp_utils.py, apply_fsdp2)."""
    ep_size = strategy_config.get("ep_size") or 1
    return bool(strategy_config.get("apply_expert_patch")) or (isinstance(ep_size, int) and ep_size > 1)


def _native_strategy_key(translation: Translation, key: Written, value: Any) -> None:
    """A key ROLL does not read is taken as fsdp2kit's own strategy_config key (validated as such)."""
    to(f"{STRATEGY_CONFIG}.{key.path.split('strategy_config.', 1)[1]}")(translation, key, value)


WRAP_POLICY_RULES: dict[str, Rule] = {
    "transformer_layer_cls_to_wrap": to(f"{STRATEGY_CONFIG}.wrap_policy.transformer_layer_cls_to_wrap", comma_list),
    "wrap_embeddings": to(f"{STRATEGY_CONFIG}.wrap_policy.wrap_embeddings", _wrap_embeddings),
    "wrap_lm_output": to(f"{STRATEGY_CONFIG}.wrap_policy.wrap_lm_output"),
    "moe_experts": to(f"{STRATEGY_CONFIG}.wrap_policy.moe_experts", comma_list),
}

STRATEGY_CONFIG_RULES: dict[str, Rule] = {
    "wrap_policy": lambda translation, key, value: apply_rules(
        translation, value, WRAP_POLICY_RULES, key, otherwise=_native_strategy_key
    ),
    "offload_policy": _offload_policy,
    # ROLL's expert parallelism (fsdp2_strategy.py: create_device_mesh_with_ep, apply_moe_ep): the same keys natively
    **{name: to(f"{STRATEGY_CONFIG}.{name}") for name in ("ep_size", "efsdp_size")},
    # ROLL's false leaves transformers' default (grouped_mm since transformers 5.2), natively unset
    "moe_use_grouped_mm": to(f"{STRATEGY_CONFIG}.moe_use_grouped_mm", lambda value: True if value else None),
    "model_type": ignored("ROLL's TiledMLP model type; fsdp2kit tiles each decoder layer's MLP"),
    **dict.fromkeys(
        ("save_only_model", "reduce_scatter_during_grad_accumulation"),
        ignored("fsdp2kit always saves the optimizer and reduce-scatters every micro-batch"),
    ),
    **dict.fromkeys(
        ("forward_prefetch", "use_batched_model_update"), ignored("ROLL's fsdp2 strategy does not read it")
    ),
}


MODEL_ARGS: dict[str, Rule] = {
    "model_name_or_path": to("model.name_or_path"),
    "dtype": to("model.dtype"),
    "disable_gradient_checkpointing": to("model.gradient_checkpointing", operator.not_),
    "gradient_checkpointing_use_reentrant": to(f"{STRATEGY_CONFIG}.use_reentrant"),
    "ulysses_size": to("model.ulysses_size"),
    "freeze_module_prefix": to("model.freeze_module_prefix", comma_list),
    "attn_implementation": to("model.attn_implementation", _attention),
    "model_config_kwargs": to("model.config"),
    "trust_remote_code": file_trust_remote_code,
    "model_type": _model_type,
    "device_map": ignored("transformers device map; FSDP2 places the shards"),
    "num_labels": ignored("used only by classification model types"),
    "moe_aux_loss_coef": unsupported("the MoE auxiliary loss cannot be weighted yet"),
    **dict.fromkeys(
        (
            "lora_target",
            "lora_rank",
            "lora_alpha",
            "lora_dropout",
            "autocast_adapter_dtype",
            "additional_target",
            "adapter_name_or_path",
        ),
        ignored("LoRA settings, unused without lora_target"),
    ),
    "vision_dp": unsupported("ROLL's vision data parallel is not available in fsdp2kit", harmless=(False,)),
    **dict.fromkeys(("flash_attn", "lora_r", "max_pixels", "min_pixels"), ignored(DROPPED.format("ModelArguments"))),
}


def _lora_target(value: str | list[str]) -> str | list[str]:
    """ROLL splits lora_target at commas and expands `all-linear`; a regular expression it hands to peft as is."""
    if isinstance(value, str) and any(c in value for c in "*$|("):
        raise ValueError("a regular expression; list the module names (q_proj,v_proj) or give all-linear")
    names = comma_list(value)
    if "all-linear" in names:
        if len(names) > 1:
            raise ValueError("all-linear already takes every linear layer; give it alone")
        return "all-linear"
    return names


# ROLL's LoRA (roll/configs/model_args.py LoraArguments, applied with peft's get_peft_model): on only when
# lora_target is set; alpha defaults to 2 x rank as in fsdp2kit; autocast_adapter_dtype (default true) keeps the
# adapters in fp32 over a bf16/fp16 base.
LORA_ARGS: dict[str, Rule] = {
    "lora_target": to("model.lora.target_modules", _lora_target),
    "lora_rank": to("model.lora.rank"),
    "lora_alpha": to("model.lora.alpha"),
    "lora_dropout": to("model.lora.dropout"),
    "additional_target": to("model.lora.modules_to_save", comma_list),
    "adapter_name_or_path": to("model.lora.adapter"),
    "autocast_adapter_dtype": to("model.lora.dtype", lambda on: "fp32" if on else None),
}

TRAINING_ARGS: dict[str, Rule] = {
    **{
        key: to(f"training.{key}")
        for key in (
            "learning_rate",
            "weight_decay",
            "adam_beta1",
            "adam_beta2",
            "adam_epsilon",
            "warmup_steps",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "num_train_epochs",
            "max_steps",
            "max_grad_norm",
            "save_total_limit",
        )
    },
    "lr_scheduler_type": to("training.lr_scheduler_type", _scheduler),
    "warmup_ratio": to("training.warmup_ratio"),
    "optim": unsupported("fsdp2kit's optimizer is AdamW", harmless=("adamw_torch", "adamw_torch_fused")),
    **dict.fromkeys(
        ("seed", "output_dir", "logging_steps", "save_steps", "resume_from_checkpoint"),
        ignored("ROLL's pipeline uses the top-level key of that name"),
    ),
    "per_device_eval_batch_size": to("training.per_device_eval_batch_size"),
    **dict.fromkeys(("bf16", "fp16", "tf32"), ignored("ROLL derives it from model_args.dtype")),
    **dict.fromkeys(("data_seed", "dataloader_num_workers", "save_hf_model"), ignored()),
    "eval_steps": ignored(DROPPED.format("TrainingArguments")),
}


def _training_args(translation: Translation, key: Written, value: Any) -> None:
    """HF TrainingArguments, whose schedule ROLL builds with transformers' get_scheduler."""
    section(TRAINING_ARGS)(translation, key, value)
    transformers_schedule(translation, key, "ROLL's training_args (HF TrainingArguments)")
    # ROLL's FSDP2 strategy builds torch's AdamW over every trainable parameter in one group (fsdp2_strategy.py
    # initialize): biases and norms are decayed too, unlike the HF Trainer whose arguments these are.
    translation.set("training.weight_decay_every_parameter", True, key.child("weight_decay"))
    translation.note(
        "training.weight_decay_every_parameter=True: ROLL's FSDP2 strategy decays every parameter (one AdamW group)"
    )
    warmup = [name for name in ("warmup_steps", "warmup_ratio") if isinstance(value, dict) and value.get(name)]
    if isinstance(value, dict) and value.get("lr_scheduler_type") == "constant" and warmup:
        for name in warmup:  # transformers' get_constant_schedule: no warmup at all
            translation.replace(f"training.{name}", 0, key.child(name))
        translation.note(f"{key.child(warmup[0])} dropped: HF's lr_scheduler_type constant does not warm up")


DATA_ARGS: dict[str, Rule] = {
    "file_name": _file_name,
    "interleave_probs": _interleave_probs,
    "eval_file_name": to("data.eval_source", _files),
    "template": chat_template_name,
    "messages": to("data.messages_key"),
    "max_samples": ignored(DROPPED.format("DataArguments")),
    **dict.fromkeys(
        (
            "image_max_pixels",
            "image_min_pixels",
            "video_max_pixels",
            "video_min_pixels",
            "video_total_pixels",
            "video_fps",
            "video_max_frames",
            "video_resize_chunk_frames",
            "image_folder",
            "video_folder",
            "audio_folder",
            "custom_data_kwargs_func",
        ),
        ignored("image, video and audio data settings; fsdp2kit trains on text"),
    ),
    **dict.fromkeys(
        (
            "prompt",
            "response",
            "id",
            "tag",
            "domain_interleave_probs",
            "dataset_dir",
            "dataset_type",
            "preprocessing_num_workers",
            "cache_path",
        ),
        ignored("ROLL prompt-data settings"),
    ),
}

STRATEGY_ARGS: dict[str, Rule] = {
    "strategy_name": to("strategy_args.strategy_name"),
    "strategy_config": _strategy_config,
    "strategy_config_path": to("strategy_args.strategy_config_path"),
}

ROLE: dict[str, Rule] = {
    "model_args": section(MODEL_ARGS),
    "training_args": _training_args,
    "data_args": section(DATA_ARGS),
    "strategy_args": section(STRATEGY_ARGS),
    "device_mapping": to("device_mapping"),
    "infer_batch_size": to("infer_batch_size"),
    "use_sequence_packing": to("data.pack"),
    "generating_args": ignored("generation settings"),
    "use_remove_padding": ignored("ROLL drops padding tokens before the forward; the plan is the same"),
    "checkpoint_config": ignored("checkpoint upload settings"),
    "use_dynamic_batching_in_train": unsupported("dynamic batching is not available", harmless=(False,)),
    "apply_loss_scale": unsupported("fsdp2kit always normalises the loss by the global token count", harmless=(True,)),
    **dict.fromkeys(
        (
            "name",
            "worker_cls",
            "pg_variant",
            "world_size",
            "num_gpus_per_worker",
            "model_update_frequency",
            "backend_timeout",
            "system_envs",
            "topr_positive_weight",
            "topr_negative_weight",
            "max_concurrency",
            "offload_nccl",
            "logits_in_fp32",
            "sequence_packing_args",
            "max_tokens_per_microbatch_in_train",
            "sequence_length_round_in_train",
            "use_dynamic_batching_in_infer",
            "max_tokens_per_microbatch_in_infer",
            "sequence_length_round_in_infer",
            "router_replay",
            "mtp_training_mode",
            "opd_kl_coef",
            "tag_included",
        ),
        ignored(),
    ),
}

ROLE_WITH_LORA: dict[str, Rule] = {**ROLE, "model_args": section({**MODEL_ARGS, **LORA_ARGS})}

TOP_LEVEL: dict[str, Rule] = {
    "seed": to("training.seed"),
    "output_dir": to("training.output_dir"),
    "sequence_length": to("data.seq_len"),
    "save_steps": to("training.save_steps"),
    "logging_steps": to("training.logging_steps"),
    "resume_from_checkpoint": to("training.resume", _resume),
    "max_ckpt_to_keep": to("training.save_total_limit", lambda keep: keep or None),  # ROLL: 0 keeps all
    "max_steps": ignored("ROLL pipeline iterations, not optimizer steps; set training_args.max_steps"),
    "hydra": ignored("Hydra runtime settings"),
    "prompt_key": to("data.prompt_key"),
    "response_key": to("data.response_key"),
    "query_key": to("data.query_key"),
    "system_key": ignored("a system prompt of the chat template; fsdp2kit applies no chat template"),
    **dict.fromkeys(
        ("model", "data", "training", "strategy_args"),
        unsupported("a native section in a ROLL file; a file holds either native sections or ROLL roles"),
    ),
    **dict.fromkeys(("pretrain", *ROLE_MODEL_KEYS.values(), "prompt_length", "response_length"), already_read),
}


NATIVE_SECTIONS = frozenset(JobConfig.model_fields) | frozenset(getattr(JobConfig, "ALIASES", {}))


def file_overrides(raw: dict[str, Any], overrides: list[str]) -> tuple[dict[str, Any], list[str]]:
    """`--set` items naming a ROLL key (`pretrain=...`, `actor_train.model_args.dtype=...`: a key of the file or of
    ROLL's top level, not a native section) change the file before it is read, as ROLL's own Hydra overrides would;
    native keys are set after."""
    known = set(raw) | set(TOP_LEVEL) | set(SFT_TOP_LEVEL)  # a typo stays a native key: refused as unknown
    return split_overrides(raw, overrides, lambda parts: parts[0] in known and parts[0] not in NATIVE_SECTIONS)


def is_roll_file(raw: dict[str, Any]) -> bool:
    return any(_is_role(value) for value in raw.values())


def _is_role(value: Any) -> bool:
    return isinstance(value, dict) and "strategy_args" in value


def _strategy_of(role: dict[str, Any]) -> str:
    return (role.get("strategy_args") or {}).get("strategy_name") or ROLL_DEFAULT_STRATEGY


# ROLL's SFT pipeline (roll/pipeline/sft): the validation loss every eval_steps, on the validation data.
SFT_TOP_LEVEL: dict[str, Rule] = {
    "eval_steps": to("training.eval_steps", _whole_steps),
    "validation": _validation,
}


def translate(raw: dict[str, Any], source: str, role: str | None) -> Translation:
    """The native config of one role: its own sections plus the pipeline keys beside the roles."""
    roles = {name: value for name, value in raw.items() if _is_role(value)}
    name = _pick_role(roles, role, source)
    strategy = _strategy_of(roles[name])
    translation = Translation(source)
    how = "picked with --role" if role else "the first role with an FSDP2 strategy"
    translation.note(f"ROLL role '{name}' ({strategy}) of {source}: {how}")
    for other, value in roles.items():
        if other != name and _strategy_of(value) in OUR_STRATEGIES:
            translation.note(f"ROLL role '{other}' ({_strategy_of(value)}) not used; pick it with --role {other}")
        elif other != name:
            translation.ignore(f"{other} ({_strategy_of(value)})", "roles whose strategy is not FSDP2")

    role_section = _with_defaults(
        roles[name], _role_defaults(strategy, roles[name]), Written(source, name), translation
    )
    model_args = role_section.get("model_args")
    if strategy == "fsdp2_infer" and isinstance(model_args, dict) and "disable_gradient_checkpointing" in model_args:
        del model_args["disable_gradient_checkpointing"]  # a copy made by _with_defaults
        translation.ignore(f"{name}.model_args.disable_gradient_checkpointing", "fsdp2_infer runs no backward")
    lora = isinstance(model_args, dict) and model_args.get("lora_target") is not None
    _interleaved_files(translation, role_section.get("data_args"), Written(source, name).child("data_args"))
    apply_rules(translation, role_section, ROLE_WITH_LORA if lora else ROLE, Written(source, name))

    top_defaults = TOP_DEFAULTS | (SFT_DEFAULTS if name == "sft_train" else {})
    top = _with_defaults(
        {key: value for key, value in raw.items() if key not in roles}, top_defaults, Written(source, ""), translation
    )
    _model_of_role(translation, top, role_section, name, source)
    _sequence_length(translation, top, source)
    top_rules = TOP_LEVEL | (SFT_TOP_LEVEL if name == "sft_train" else {})
    apply_rules(translation, top, top_rules, Written(source, ""), otherwise=ignored())
    return translation


def _pick_role(roles: dict[str, Any], wanted: str | None, source: str) -> str:
    listed = ", ".join(f"{name} ({_strategy_of(value)})" for name, value in roles.items())
    usable = [name for name, value in roles.items() if _strategy_of(value) in OUR_STRATEGIES]
    if wanted is None:
        if not usable:
            raise UserError(f"'{source}' has no role with strategy fsdp2_train or fsdp2_infer; its roles: {listed}")
        return usable[0]
    if wanted not in roles:
        raise UserError(f"--role {wanted}: '{source}' has no role '{wanted}'; its roles: {listed}")
    if wanted not in usable:
        raise UserError(
            f"--role {wanted}: role '{wanted}' of '{source}' uses strategy '{_strategy_of(roles[wanted])}', "
            f"which fsdp2kit does not run; usable roles: {', '.join(usable) or 'none'} "
            f"(strategy fsdp2_train or fsdp2_infer)"
        )
    return wanted


def _with_defaults(
    values: dict[str, Any], defaults: dict[str, Any], where: Written, translation: Translation
) -> dict[str, Any]:
    """A copy of `values` with ROLL's defaults where the file is silent (noted, so nothing changes unseen)."""
    merged = dict(values)
    for key, default in defaults.items():
        if isinstance(default, dict) and isinstance(merged.get(key) or {}, dict):
            merged[key] = _with_defaults(merged.get(key) or {}, default, where.child(key), translation)
        elif merged.get(key) is None:
            merged[key] = default
            translation.note(f"ROLL default {where.child(key)}={default!r} (the file does not set it)")
    return merged


def _model_of_role(translation: Translation, top: dict[str, Any], role: dict[str, Any], name: str, source: str) -> None:
    """ROLL gives a role that names no model its pipeline's model key (`pretrain`; `student_pretrain`,
    `teacher_pretrain`, `reward_pretrain` for students, teachers and critics); the SFT pipeline always does."""
    model_key = ROLE_MODEL_KEYS.get(name, "pretrain")
    for other in ("pretrain", *ROLE_MODEL_KEYS.values()):
        if other != model_key and top.get(other) is not None:
            translation.ignore(other, "names the model of another role")
    named_in_role = (role.get("model_args") or {}).get("model_name_or_path") is not None
    if named_in_role and not (name == "sft_train" and top.get(model_key) is not None):
        if top.get(model_key) is not None:
            translation.ignore(model_key, f"{name}.model_args.model_name_or_path names the model")
        return
    if top.get(model_key) is None:
        raise UserError(
            f"'{source}' names no model for role '{name}': set {model_key} or {name}.model_args.model_name_or_path"
        )
    if named_in_role:  # the SFT pipeline sets the role's model to `pretrain` whatever the role says
        del translation.config["model"]["name_or_path"]
        translation.ignore(f"{name}.model_args.model_name_or_path", "ROLL's SFT pipeline uses pretrain")
    to("model.name_or_path")(translation, Written(source, model_key), top[model_key])


def _sequence_length(translation: Translation, top: dict[str, Any], source: str) -> None:
    """ROLL's sequence_length defaults to prompt_length + response_length (the RL rollout lengths)."""
    lengths = [key for key in ("prompt_length", "response_length") if top.get(key) is not None]
    if top.get("sequence_length") is None and len(lengths) == 2:
        total = top["prompt_length"] + top["response_length"]
        translation.set("data.seq_len", total, Written(source, "prompt_length"))
        translation.note(f"mapped prompt_length + response_length = {total} → data.seq_len (ROLL's sequence_length)")
        return
    for key in lengths:
        translation.ignore(key, NO_FSDP2_MEANING)
