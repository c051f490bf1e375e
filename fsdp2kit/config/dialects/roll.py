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
    comma_list,
    ignored,
    section,
    to,
    unsupported,
)
from fsdp2kit.errors import UserError

OUR_STRATEGIES = ("fsdp2_train", "fsdp2_infer")
ROLL_DEFAULT_STRATEGY = "deepspeed_train"  # what ROLL runs when strategy_args names none
# ROLL's defaults (roll/configs/base_config.py, worker_config.py, model_args.py) that differ from fsdp2kit's.
TOP_DEFAULTS = {"output_dir": "./output", "save_steps": 50, "resume_from_checkpoint": False}
SFT_KEYS_UNSUPPORTED = (
    "fsdp2kit has no prompt/response loss masking yet: it trains on every token of data.text_key; "
    "drop the SFT keys and give plain text data to train on whole sequences"
)


def _role_defaults(strategy: str) -> dict[str, Any]:
    model_args: dict[str, Any] = {"dtype": "bf16"}
    if strategy == "fsdp2_train":
        model_args["disable_gradient_checkpointing"] = False  # ROLL recomputes every layer unless told not to
    return {"infer_batch_size": 16, "use_sequence_packing": False, "model_args": model_args}


def _attention(value: str) -> str:
    """ROLL's attention names; flash-attention is a kernel choice, and SDPA computes the same attention."""
    names = {"sdpa": "sdpa", "eager": "eager", "auto": "sdpa", "fa2": "sdpa", "flash_attention_2": "sdpa"}
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return names[value]


def _scheduler(value: str) -> str:
    """HF scheduler names. fsdp2kit warms up for warmup_steps before any schedule, so constant_with_warmup is its
    `constant` (HF's `constant` skips the warmup: the two differ only when warmup_steps > 0)."""
    names = {"cosine": "cosine", "linear": "linear", "constant": "constant", "constant_with_warmup": "constant"}
    if value not in names:
        raise ValueError(f"expected one of {', '.join(names)}")
    return names[value]


def _resume(value: bool | str) -> str:
    """ROLL: false = start fresh, true = the newest checkpoint in output_dir, a string = that checkpoint."""
    if value is True:
        return "auto"
    return "never" if value is False else str(value)


def _single_file(value: str | list[str]) -> str:
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, list) or len(files) != 1:
        raise ValueError("data.source reads one file or glob; give one file (or merge the files)")
    return files[0]


MODEL_ARGS: dict[str, Rule] = {
    "model_name_or_path": to("model.name_or_path"),
    "dtype": to("model.dtype"),
    "disable_gradient_checkpointing": to("model.gradient_checkpointing", operator.not_),
    "gradient_checkpointing_use_reentrant": to(f"{STRATEGY_CONFIG}.use_reentrant"),
    "ulysses_size": to("model.ulysses_size"),
    "freeze_module_prefix": to("model.freeze_module_prefix", comma_list),
    "attn_implementation": to("model.attn_implementation", _attention),
    "model_config_kwargs": to("model.config"),
    "model_type": unsupported("fsdp2kit trains causal language models only (model_type: ~)"),
    "device_map": ignored("transformers device map; FSDP2 places the shards"),
    "num_labels": ignored("used only by classification model types"),
    "moe_aux_loss_coef": unsupported("the MoE auxiliary loss cannot be weighted yet"),
    "adapter_name_or_path": unsupported("LoRA adapters are not supported"),
    "lora_target": unsupported("LoRA is not supported"),
    "additional_target": unsupported("LoRA is not supported"),
    **dict.fromkeys(
        ("lora_rank", "lora_alpha", "lora_dropout", "autocast_adapter_dtype"),
        ignored("LoRA settings, unused without lora_target"),
    ),
    "vision_dp": unsupported("Vision DP is not available", harmless=(False,)),
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
    "warmup_ratio": unsupported(
        "give warmup_steps (the number of steps is known only when the run starts)", harmless=(0, 0.0)
    ),
    "optim": unsupported("fsdp2kit's optimizer is AdamW", harmless=("adamw_torch", "adamw_torch_fused")),
    **dict.fromkeys(
        ("seed", "output_dir", "logging_steps", "save_steps", "resume_from_checkpoint"),
        ignored("ROLL's pipeline uses the top-level key of that name"),
    ),
    "per_device_eval_batch_size": ignored("there is no evaluation loop"),
    **dict.fromkeys(("bf16", "fp16"), ignored("ROLL derives it from model_args.dtype")),
}

DATA_ARGS: dict[str, Rule] = {
    "file_name": to("data.source", _single_file),
    "template": ignored("chat template of prompts; fsdp2kit tokenizes data.text_key as plain text"),
    **dict.fromkeys(
        (
            "messages",
            "prompt",
            "response",
            "id",
            "tag",
            "domain_interleave_probs",
            "interleave_probs",
            "dataset_dir",
            "dataset_type",
            "preprocessing_num_workers",
            "cache_path",
            "eval_file_name",
        ),
        ignored("ROLL prompt-data settings"),
    ),
}

STRATEGY_ARGS: dict[str, Rule] = {
    "strategy_name": to("strategy_args.strategy_name"),
    "strategy_config": to(STRATEGY_CONFIG),  # native keys, validated as such
    "strategy_config_path": to("strategy_args.strategy_config_path"),
}

ROLE: dict[str, Rule] = {
    "model_args": section(MODEL_ARGS),
    "training_args": section(TRAINING_ARGS),
    "data_args": section(DATA_ARGS),
    "strategy_args": section(STRATEGY_ARGS),
    "device_mapping": to("device_mapping"),
    "infer_batch_size": to("infer_batch_size"),
    "use_sequence_packing": to("data.pack"),
    "generating_args": ignored("generation settings"),
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
        ),
        ignored(),
    ),
}

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
    "defaults": unsupported("Hydra defaults lists are not composed here; compose the file with Hydra first"),
    **dict.fromkeys(
        ("prompt_key", "query_key", "response_key", "system_key", "question_key", "answer_key"),
        unsupported(SFT_KEYS_UNSUPPORTED),
    ),
    **dict.fromkeys(
        ("model", "data", "training", "strategy_args"),
        unsupported("a native section in a ROLL file; a file holds either native sections or ROLL roles"),
    ),
    **dict.fromkeys(("pretrain", "prompt_length", "response_length"), already_read),
}


def is_roll_file(raw: dict[str, Any]) -> bool:
    return any(_is_role(value) for value in raw.values())


def _is_role(value: Any) -> bool:
    return isinstance(value, dict) and "strategy_args" in value


def _strategy_of(role: dict[str, Any]) -> str:
    return (role.get("strategy_args") or {}).get("strategy_name") or ROLL_DEFAULT_STRATEGY


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

    role_section = _with_defaults(roles[name], _role_defaults(strategy), Written(source, name), translation)
    model_args = role_section.get("model_args")
    if strategy == "fsdp2_infer" and isinstance(model_args, dict) and "disable_gradient_checkpointing" in model_args:
        del model_args["disable_gradient_checkpointing"]  # a copy made by _with_defaults
        translation.ignore(f"{name}.model_args.disable_gradient_checkpointing", "fsdp2_infer runs no backward")
    apply_rules(translation, role_section, ROLE, Written(source, name))

    top = _with_defaults(
        {key: value for key, value in raw.items() if key not in roles}, TOP_DEFAULTS, Written(source, ""), translation
    )
    _model_of_role(translation, top, role_section, name, source)
    _sequence_length(translation, top, source)
    apply_rules(translation, top, TOP_LEVEL, Written(source, ""), otherwise=ignored())
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
    """ROLL gives every role that names no model the top-level `pretrain`."""
    if (role.get("model_args") or {}).get("model_name_or_path") is not None:
        if top.get("pretrain") is not None:
            translation.ignore("pretrain", f"{name}.model_args.model_name_or_path names the model")
        return
    if top.get("pretrain") is None:
        raise UserError(
            f"'{source}' names no model for role '{name}': set pretrain or {name}.model_args.model_name_or_path"
        )
    to("model.name_or_path")(translation, Written(source, "pretrain"), top["pretrain"])


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
