"""verl's configuration as fsdp2kit's: `job_config` turns verl's model, engine and optimizer configs into fsdp2kit's
native config, and every field of verl 0.9's `HFModelConfig`, `EngineConfig`/`FSDPEngineConfig`, actor and critic
configs and `FSDPOptimizerConfig` is accounted for here — translated, refused in one sentence unless it has verl's
default, or named with the reason it is no part of the computation fsdp2kit runs. `tests_verl/test_verl_keys.py`
holds these tables to verl's own dataclasses, so a field verl adds fails that test until it is handled. Nothing here
imports verl (the translation is tested without it: tests/test_verl_keys.py); `integrations/verl.py` is verl's
side."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp2kit.dtypes import short_name
from fsdp2kit.errors import UserError

# verl's learning-rate schedules that fsdp2kit's schedule reproduces (warmup from 0, then constant or cosine).
SCHEDULES = ("constant", "cosine")
# A refusal: (whether the config's setting is one fsdp2kit would not run as verl does, why), the test taking the
# config object that holds the field.
Refusal = tuple[Callable[[Any], bool], str]


def _on(field: str, default: Any = False) -> Callable[[Any], bool]:
    """A refusal test: the field is set (truthy; verl's default where the object lacks it)."""
    return lambda config: bool(getattr(config, field, default))


def _enabled(field: str, flag: str = "enable") -> Callable[[Any], bool]:
    """A refusal test for a nested switch (`tiled_mlp.enabled`, `qat.enable`): a mapping or a dataclass."""

    def test(config: Any) -> bool:
        nested = getattr(config, field, None)
        value = nested.get(flag) if isinstance(nested, dict) else getattr(nested, flag, False)
        return bool(value)

    return test


# ---- verl's HFModelConfig (verl/workers/config/model.py): actor_rollout_ref.model / critic.model ----------------

# verl's default: its FSDP engine recomputes every decoder layer, non-reentrant (transformer_impl.py
# `gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`).
VERL_GRADIENT_CHECKPOINTING = True

MODEL_TRANSLATED: dict[str, str] = {
    "path": "model.name_or_path",
    "local_path": "model.name_or_path (verl's local copy of path)",
    "trust_remote_code": "model.trust_remote_code",
    "override_config": "attn_implementation: model.attn_implementation; other keys: model.config",
    "enable_gradient_checkpointing": "model.gradient_checkpointing, strategy_config.use_reentrant false (verl's)",
    "use_remove_padding": "model.remove_padding (verl's TrainingWorker copies it into the engine config)",
    "model_type": "language_model: a causal LM; value_model: the family's token classifier with one label",
    "tiled_mlp": "strategy_config.apply_tiled_mlp, tiled_num_shards",
}
MODEL_REFUSED: dict[str, Refusal] = {
    "hf_config_path": (
        lambda config: getattr(config, "hf_config_path", None) not in (None, config.path),
        "fsdp2kit reads the model's config from model.path",
    ),
    "enable_activation_offload": (
        _on("enable_activation_offload"),
        "fsdp2kit offloads activations with strategy_config.activation_offload_modules (engine overrides)",
    ),
    "lora_rank": (_on("lora_rank"), "fsdp2kit's verl engine trains no LoRA adapters (nor disable_adapter)"),
    "use_liger": (_on("use_liger"), "fsdp2kit patches in no Liger kernels"),
    "mtp": (_enabled("mtp", "enable_train"), "fsdp2kit trains no multi-token-prediction layers"),
}
MODEL_UNUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "local_hf_config_path",
            "tokenizer_path",
            "local_tokenizer_path",
            "load_tokenizer",
            "hf_config",
            "generation_config",
            "tokenizer",
            "processor",
            "use_shm",
            "custom_chat_template",
            "external_lib",
            "architectures",
        ),
        "the files, tokenizer and chat template verl's workers and rollout read; verl builds the model from path",
    ),
    **dict.fromkeys(
        ("lora_alpha", "target_modules", "target_parameters", "exclude_modules", "lora", "lora_adapter_path"),
        "LoRA settings, read only with lora_rank > 0 (refused)",
    ),
    **dict.fromkeys(
        ("use_fused_kernels", "fused_kernel_options"),
        "verl's fused log-prob kernels give the same log-probs; fsdp2kit's chunked head never holds the logits",
    ),
}

# ---- verl's engine config: EngineConfig (verl/workers/config/engine.py) and fsdp2kit's own fields ----------------

ENGINE_TRANSLATED: dict[str, str] = {
    "strategy": "must be fsdp2kit",
    "forward_only": "strategy_name fsdp2_infer (the reference) or fsdp2_train",
    "param_offload": "offload_states(model_params) outside train/eval mode",
    "optimizer_offload": "offload_states(optimizer_states) outside train mode",
    "use_remove_padding": "model.remove_padding",
    "seed": "training.seed",
    "ulysses_sequence_parallel_size": "model.ulysses_size",
    "model_dtype": "model.dtype",
    "mixed_precision": "strategy_config.param_dtype, reduce_dtype (buffer_dtype must be model_dtype)",
    "overrides": "fsdp2kit --set strings",
}
ENGINE_REFUSED: dict[str, Refusal] = {
    "full_determinism": (_on("full_determinism"), "fsdp2kit does not switch torch to deterministic algorithms"),
    "router_replay": (
        lambda config: getattr(getattr(config, "router_replay", None), "mode", "disabled") != "disabled",
        "fsdp2kit replays no MoE routing",
    ),
}
ENGINE_UNUSED: dict[str, str] = {
    "dtype": "verl's Megatron engine's; verl's FSDP engine reads model_dtype and mixed_precision",
    **dict.fromkeys(
        (
            "use_dynamic_bsz",
            "max_token_len_per_gpu",
            "micro_batch_size_per_gpu",
            "infer_max_token_len_per_gpu",
            "infer_micro_batch_size_per_gpu",
        ),
        "the micro-batch cut, which verl's own prepare_micro_batches makes from the batch",
    ),
    "use_fused_kernels": "verl's FSDP engine reads the model config's (see use_fused_kernels there)",
}
# FSDPEngineConfig's fields that Fsdp2kitEngineConfig does not have (verl's config conversion refuses them under
# `fsdp2kit:`): what fsdp2kit does instead, or the native key to give in `overrides`.
FSDP_ENGINE_ONLY: dict[str, str] = {
    "wrap_policy": "fsdp2kit shards each decoder layer; strategy_config.wrap_policy",
    "offload_policy": "strategy_config.offload_policy",
    "reshard_after_forward": "strategy_config.reshard_after_forward",
    "fsdp_size": "strategy_config's mesh keys (hybrid sharding)",
    "forward_prefetch": "FSDP1's; FSDP2 prefetches the next layer",
    "use_orig_params": "FSDP1's; FSDP2 keeps the original parameters",
    "entropy_from_logits_with_chunking": "fsdp2kit always computes the entropy in chunks (the same values)",
    "entropy_from_logits_chunk_size": "training.loss_chunk_tokens",
    "use_torch_compile": "verl compiles its entropy function only (the same values)",
    "entropy_checkpointing": "fsdp2kit's chunked head recomputes each chunk in backward",
    "use_no_sync_for_gradient_accumulation": "fsdp2kit reduce-scatters every micro-batch (the same gradients)",
    "pad_to_length": "padding rows to a bucket changes no log-prob",
    "pad_to_length_bucket": "padding rows to a bucket changes no log-prob",
    "qat": "fsdp2kit trains without quantization",
    "turbo_config": "verl's FSDP-turbo kernels; not in fsdp2kit",
}

# ---- verl's actor and critic configs (verl/workers/config/actor.py, critic.py) -----------------------------------

ACTOR_TRANSLATED: dict[str, str] = {
    "strategy": "must be fsdp2kit",
    "engine": "the Fsdp2kitEngineConfig above (actor.fsdp2kit)",
    "fsdp2kit": "the engine config",
    "optim": "training: AdamW, weight decay, betas, clip_grad, schedule (job_config)",
    "model_config": "the HFModelConfig above",
    "ulysses_sequence_parallel_size": "the engine's ulysses_sequence_parallel_size",
}
ACTOR_REFUSED: dict[str, Refusal] = {
    "calculate_sum_pi_squared": (_on("calculate_sum_pi_squared"), "fsdp2kit's engine returns no sum_pi_squared"),
    "use_prefix_grouper": (_on("use_prefix_grouper"), "fsdp2kit's engine takes whole rows, not prefix groups"),
    "freeze_vision_tower": (_on("freeze_vision_tower"), "fsdp2kit trains text models (model.freeze_module_prefix)"),
    "qat": (_enabled("qat"), "fsdp2kit trains without quantization"),
}
ACTOR_UNUSED: dict[str, str] = {
    **dict.fromkeys(
        (
            "ppo_mini_batch_size",
            "ppo_micro_batch_size",
            "ppo_micro_batch_size_per_gpu",
            "ppo_infer_micro_batch_size_per_gpu",
            "use_dynamic_bsz",
            "ppo_max_token_len_per_gpu",
            "ppo_infer_max_token_len_per_gpu",
            "forward_max_token_len_per_gpu",
            "ppo_epochs",
            "shuffle",
            "data_loader_seed",
            "rollout_n",
            "global_batch_info",
            "enable",
        ),
        "verl's worker cuts and orders the batches it hands the engine",
    ),
    **dict.fromkeys(
        (
            "clip_ratio",
            "clip_ratio_low",
            "clip_ratio_high",
            "clip_ratio_c",
            "policy_loss",
            "loss_agg_mode",
            "loss_scale_factor",
            "entropy_coeff",
            "tau_pos",
            "tau_neg",
            "calculate_entropy",
            "use_kl_loss",
            "kl_loss_coef",
            "kl_loss_type",
            "cliprange_value",
            "use_rollout_log_probs",
        ),
        "verl's loss function reads it (the engine runs verl's loss as verl's engine does)",
    ),
    **dict.fromkeys(("checkpoint", "profiler"), "verl's checkpoint contents and profiler; no computation"),
    "use_torch_compile": "verl compiles its entropy function only (the same values)",
    "use_fused_kernels": "see the model config's use_fused_kernels",
    "grad_clip": "verl's FSDP engine clips at optim.clip_grad (translated)",
    "use_remove_padding": "the model config's use_remove_padding is what verl's worker reads",
    "model": "the critic's HFModelConfig (above)",
}
# FSDPActorConfig's and FSDPCriticConfig's fields that fsdp2kit's actor and critic configs do not have.
FSDP_ROLE_ONLY: dict[str, str] = {
    "fsdp_config": "the actor's FSDP engine config; fsdp2kit's is actor.fsdp2kit",
    "fsdp": "the critic's FSDP engine config; fsdp2kit's is critic.fsdp2kit",
    **{key: FSDP_ENGINE_ONLY[key] for key in ("entropy_from_logits_with_chunking", "entropy_from_logits_chunk_size")},
    "entropy_checkpointing": FSDP_ENGINE_ONLY["entropy_checkpointing"],
    "pad_to_length": FSDP_ENGINE_ONLY["pad_to_length"],
    **dict.fromkeys(
        ("forward_micro_batch_size", "forward_micro_batch_size_per_gpu"), "verl's FSDP critic's own micro-batch cut"
    ),
}


# ---- verl's FSDPOptimizerConfig (verl/workers/config/optimizer.py): actor.optim / critic.optim ------------------


def _schedule(config: Any) -> str:
    """verl's schedule name: the deprecated warmup_style where given (verl copies it into lr_scheduler_type)."""
    return str(getattr(config, "warmup_style", None) or config.lr_scheduler_type)


OPTIMIZER_TRANSLATED: dict[str, str] = {
    "lr": "training.learning_rate",
    "weight_decay": "training.weight_decay, on every parameter (training.weight_decay_every_parameter)",
    "betas": "training.adam_beta1, adam_beta2",
    "clip_grad": "training.max_grad_norm",
    "grad_clip": "verl's deprecated clip_grad, which verl copies into it",
    "total_training_steps": "training.max_steps (the schedule's length)",
    "lr_warmup_steps": "training.warmup_steps, warming up from 0 as verl (training.warmup_from_zero)",
    "lr_warmup_steps_ratio": "training.warmup_steps where lr_warmup_steps <= 0: the ratio of the total, rounded down",
    "lr_scheduler_type": "training.lr_scheduler_type (verl's FSDP engine has constant and cosine; others refused)",
    "warmup_style": "verl's deprecated lr_scheduler_type, which verl copies into it",
    "min_lr_ratio": "training.min_lr_ratio (verl's cosine reads it; its constant does not)",
    "num_cycles": "training.num_cycles (verl's cosine reads it; its constant does not)",
}
OPTIMIZER_REFUSED: dict[str, Refusal] = {
    "optimizer": (lambda config: config.optimizer != "AdamW", "fsdp2kit trains with AdamW"),
    "optimizer_impl": (
        lambda config: getattr(config, "optimizer_impl", "torch.optim") != "torch.optim",
        "fsdp2kit's AdamW is torch.optim's",
    ),
    "override_optimizer_config": (
        _on("override_optimizer_config", None),
        "fsdp2kit's AdamW takes lr, betas and weight_decay only",
    ),
    "zero_indexed_step": (
        lambda config: _schedule(config) == "cosine" and not getattr(config, "zero_indexed_step", True),
        "fsdp2kit counts the cosine's steps from 0, as verl's default",
    ),
}


def refuse(config: Any, refusals: dict[str, Refusal], section: str) -> None:
    """A UserError naming the first of `refusals` that `config` sets to what fsdp2kit would not run as verl does."""
    for key, (refused, why) in refusals.items():
        if refused(config):
            raise UserError(f"verl config: {section}.{key}: {getattr(config, key, None)!r} is not supported ({why})")


def job_config(model_config: Any, engine_config: Any, optimizer_config: Any) -> dict[str, Any]:
    """fsdp2kit's native config from verl's model, engine and optimizer configs; a verl setting that fsdp2kit
    would not honour as verl's FSDP engine does is refused in one sentence."""
    refuse(model_config, MODEL_REFUSED, "model")
    refuse(engine_config, ENGINE_REFUSED, "engine")
    training = not engine_config.forward_only
    config: dict[str, Any] = {
        "model": {
            "name_or_path": str(getattr(model_config, "local_path", None) or model_config.path),
            "trust_remote_code": bool(getattr(model_config, "trust_remote_code", False)),
            "ulysses_size": int(engine_config.ulysses_sequence_parallel_size),
            "remove_padding": bool(getattr(engine_config, "use_remove_padding", False)),
            "dtype": short_name(str(getattr(engine_config, "model_dtype", "fp32"))),
            **model_overrides(model_config),
            **recompute(model_config, training),
        },
        "strategy_args": {
            "strategy_name": "fsdp2_train" if training else "fsdp2_infer",
            "strategy_config": {**mixed_precision(engine_config), **strategy_recompute(model_config, training)},
        },
    }
    head = model_head(model_config)  # a critic's head and its one label, beside override_config's keys
    config["model"].update(head, config={**config["model"].get("config", {}), **head.get("config", {})})
    if training:
        config["training"] = {**optimizer_settings(optimizer_config), "seed": int(getattr(engine_config, "seed", 42))}
    return config


def recompute(model_config: Any, training: bool) -> dict[str, Any]:
    """verl's `enable_gradient_checkpointing` (default true: every decoder layer recomputed in backward) as
    model.gradient_checkpointing; a forward-only engine runs no backward."""
    if not training:
        return {}
    return {"gradient_checkpointing": bool(getattr(model_config, "enable_gradient_checkpointing", True))}


def strategy_recompute(model_config: Any, training: bool) -> dict[str, Any]:
    """The strategy keys of verl's recompute (non-reentrant, as verl's engine asks transformers for) and of its
    TiledMLP (`tiled_mlp: {enabled, num_shards}`)."""
    settings: dict[str, Any] = {}
    if training and recompute(model_config, training)["gradient_checkpointing"]:
        settings["use_reentrant"] = False
    tiled = dict(getattr(model_config, "tiled_mlp", None) or {})
    if tiled.get("enabled"):
        settings.update(apply_tiled_mlp=True, tiled_num_shards=int(tiled.get("num_shards", 4)))
    return settings


def model_overrides(model_config: Any) -> dict[str, Any]:
    """verl's `override_config` (or its `model_config` part, as verl reads it): `attn_implementation` where the user
    gave one (else fsdp2kit's `auto`, which picks verl's default, flash_attention_2, where it is installed), the other
    keys onto the transformers config, as verl's update_model_config applies them."""
    overrides = dict(getattr(model_config, "override_config", None) or {})
    overrides = dict(overrides.get("model_config", overrides))
    chosen = overrides.pop("attn_implementation", None)
    settings: dict[str, Any] = {} if chosen is None else {"attn_implementation": str(chosen)}
    if overrides:
        settings["config"] = overrides
    return settings


def mixed_precision(engine_config: Any) -> dict[str, Any]:
    """verl's FSDP mixed precision (`mixed_precision`: param bf16, reduce fp32, buffers fp32 unless it says
    otherwise) as fsdp2kit's strategy dtypes; fsdp2kit keeps buffers in the model's dtype, so another buffer dtype
    is refused."""
    precision = dict(getattr(engine_config, "mixed_precision", None) or {})
    model_dtype = short_name(str(getattr(engine_config, "model_dtype", "fp32")))
    buffer_dtype = short_name(str(precision.get("buffer_dtype", "fp32")))
    if buffer_dtype != model_dtype:
        raise UserError(
            f"verl engine config: mixed_precision.buffer_dtype: {buffer_dtype} (fsdp2kit keeps buffers in "
            f"model_dtype, {model_dtype})"
        )
    return {
        "param_dtype": short_name(str(precision.get("param_dtype", "bf16"))),
        "reduce_dtype": short_name(str(precision.get("reduce_dtype", "fp32"))),
    }


def optimizer_settings(optimizer_config: Any) -> dict[str, Any]:
    """fsdp2kit's training section from verl's FSDP optimizer config: torch's AdamW with weight decay on every
    parameter (verl's build_optimizer gives all parameters one group), clipping at clip_grad, and the schedule verl's
    FSDP engine builds (`_build_lr_scheduler`): its warmup from 0 (step s at lr x s / W), its cosine's floor and
    cycles."""
    refuse(optimizer_config, OPTIMIZER_REFUSED, "optim")
    schedule = _schedule(optimizer_config)
    if schedule not in SCHEDULES:
        raise UserError(f"verl config: optim.lr_scheduler_type: {schedule!r} is not supported ({', '.join(SCHEDULES)})")
    total = int(optimizer_config.total_training_steps)
    warmup = int(optimizer_config.lr_warmup_steps or 0)
    if warmup <= 0:  # verl's rule: the ratio of the total, rounded down
        warmup = int(optimizer_config.lr_warmup_steps_ratio * max(total, 0))
    cosine = {}
    if schedule == "cosine":  # verl's constant schedule reads neither
        cosine = {
            "min_lr_ratio": float(optimizer_config.min_lr_ratio or 0.0),
            "num_cycles": float(optimizer_config.num_cycles),
        }
    return {
        "learning_rate": float(optimizer_config.lr),
        "weight_decay": float(optimizer_config.weight_decay),
        "weight_decay_every_parameter": True,
        "adam_beta1": float(optimizer_config.betas[0]),
        "adam_beta2": float(optimizer_config.betas[1]),
        "max_grad_norm": float(optimizer_config.clip_grad),
        "max_steps": total,
        "warmup_steps": warmup,
        "warmup_from_zero": True,
        "lr_scheduler_type": schedule,
        **cosine,
    }


def model_head(model_config: Any) -> dict[str, Any]:
    """The model section's head for verl's model_type: a causal LM ("language_model"), or for a critic
    ("value_model") the family's ...ForTokenClassification with one label, as verl builds its critic."""
    model_type = getattr(model_config, "model_type", None) or "language_model"
    if model_type == "language_model":
        return {}
    if model_type != "value_model":
        raise UserError(f"verl model_type: {model_type} (fsdp2kit's verl engine has language_model, value_model)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    config_file = Path(getattr(model_config, "local_path", None) or model_config.path) / "config.json"
    family = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    class_name = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(family or "")
    if class_name is None:
        raise UserError(f"verl value_model: {config_file} names no model family with a token-classification class")
    return {"model_class": f"transformers:{class_name}", "config": {"num_labels": 1}}
