"""Hugging Face Accelerate and Trainer FSDP settings, mapped onto strategy_config.

Two spellings arrive here:
- an `accelerate config` file (`distributed_type: FSDP`, `mixed_precision`, `fsdp_config: {fsdp_*}` and launcher
  keys), given with `--fsdp-config` or `strategy_args.strategy_config_path`; it replaces strategy_config;
- TrainingArguments' `fsdp: "full_shard auto_wrap offload"` and `fsdp_config: {...}`, written as two keys inside
  `strategy_args.strategy_config` and translated in place (beside native keys) before validation.
Both share the `fsdp_config` table; the Trainer writes its keys with or without the `fsdp_` prefix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fsdp2kit.config.dialects.translation import (
    STRATEGY_CONFIG,
    Rule,
    Translation,
    Written,
    already_read,
    apply_rules,
    comma_list,
    converted,
    ignored,
    section,
    to,
    transformers_schedule,
    unknown_key,
    unsupported,
    whole_ranks,
)
from fsdp2kit.errors import UserError

# Accelerate's names, numbered 1-5 in this order (torch's ShardingStrategy values), and ours.
SHARDING_STRATEGIES = {
    "FULL_SHARD": "FULL_SHARD",
    "SHARD_GRAD_OP": "SHARD_GRAD_OP",
    "NO_SHARD": "NO_SHARD",
    "HYBRID_SHARD": "HYBRID_SHARD",
    "HYBRID_SHARD_ZERO2": "_HYBRID_SHARD_ZERO2",
}
WRAP_POLICIES = ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")
# The wrap settings each policy reads: key -> (policy, native key, conversion).
WRAP_SETTINGS = {
    "fsdp_transformer_layer_cls_to_wrap": (
        "TRANSFORMER_BASED_WRAP",
        f"{STRATEGY_CONFIG}.wrap_policy.transformer_layer_cls_to_wrap",
        comma_list,
    ),
    "fsdp_min_num_params": ("SIZE_BASED_WRAP", f"{STRATEGY_CONFIG}.wrap_policy.min_num_params", None),
}
XLA_FSDP = "PyTorch/XLA FSDP is not available in fsdp2kit, which runs PyTorch FSDP2 on CUDA or CPU; drop it"
LAUNCHER = "Accelerate launcher settings; --nproc N or torchrun decide processes and machines"


def _sharding_strategy(value: Any) -> str:
    names = list(SHARDING_STRATEGIES)
    name = str(value).upper().lstrip("_")
    if name.isdigit() and 1 <= int(name) <= len(names):
        return SHARDING_STRATEGIES[names[int(name) - 1]]
    if name not in SHARDING_STRATEGIES:
        raise ValueError(f"expected one of {', '.join(names)} (or their numbers 1-{len(names)})")
    return SHARDING_STRATEGIES[name]


def _flag(value: Any) -> bool:
    """Accelerate and the Trainer accept booleans written as strings ('true', 'False')."""
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "false"):
        return str(value).lower() == "true"
    raise ValueError("expected true or false")


def _reshard_after_forward(translation: Translation, key: Written, value: Any) -> None:
    """FSDP2 configs write a bool here; FSDP1 configs write a sharding strategy name."""
    try:
        _flag(value)
    except ValueError:
        to(f"{STRATEGY_CONFIG}.sharding_strategy", _sharding_strategy)(translation, key, value)
    else:
        to(f"{STRATEGY_CONFIG}.reshard_after_forward", _flag)(translation, key, value)


def _backward_prefetch(value: Any) -> int:
    """FSDP2 has no post-gradient prefetch: BACKWARD_POST also prefetches the previous group before its backward."""
    groups = {"BACKWARD_PRE": 1, "BACKWARD_POST": 1, "NO_PREFETCH": 0}
    if str(value).upper() not in groups:
        raise ValueError(f"expected one of {', '.join(groups)}")
    return groups[str(value).upper()]


def _module_path(value: Any) -> list[str]:
    """Accelerate's fsdp_ignored_modules is a regex; a plain module path reads the same as an fsdp2kit pattern."""
    if not isinstance(value, str) or not re.fullmatch(r"[\w.]+", value):
        raise ValueError(
            "expected a module path such as 'model.visual' (regular expressions are not read; "
            "write strategy_config.ignored_modules patterns such as 'model.layers.{0-3}' instead)"
        )
    return [value]


def _version(translation: Translation, key: Written, value: Any) -> None:
    if str(value) not in ("1", "2"):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected 1 or 2")
    if str(value) == "1":
        translation.note(f"{key}=1: FSDP1 settings read as FSDP2 (fsdp2kit only runs fully_shard)")


def _activation_checkpointing(translation: Translation, key: Written, value: Any) -> None:
    """Accelerate recomputes each wrapped layer with the non-reentrant checkpoint implementation."""
    if converted(key, value, _flag):
        translation.set("model.gradient_checkpointing", True, key)
        translation.set(f"{STRATEGY_CONFIG}.use_reentrant", False, key)
        translation.note(f"mapped {key} → model.gradient_checkpointing=True, {STRATEGY_CONFIG}.use_reentrant=False")
    else:
        to("model.gradient_checkpointing", _flag)(translation, key, value)


FSDP_CONFIG: dict[str, Rule] = {
    **dict.fromkeys(("fsdp_auto_wrap_policy", *WRAP_SETTINGS), already_read),
    "fsdp_version": _version,
    "fsdp_reshard_after_forward": _reshard_after_forward,
    "fsdp_sharding_strategy": to(f"{STRATEGY_CONFIG}.sharding_strategy", _sharding_strategy),
    "fsdp_offload_params": to(f"{STRATEGY_CONFIG}.offload_policy", _flag),
    "fsdp_cpu_offload": to(f"{STRATEGY_CONFIG}.offload_policy", _flag),  # the Trainer's spelling
    "fsdp_backward_prefetch": to(f"{STRATEGY_CONFIG}.num_to_backward_prefetch", _backward_prefetch),
    "fsdp_forward_prefetch": to(f"{STRATEGY_CONFIG}.num_to_forward_prefetch", lambda on: int(_flag(on))),
    "fsdp_activation_checkpointing": _activation_checkpointing,
    "fsdp_ignored_modules": to(f"{STRATEGY_CONFIG}.ignored_modules", _module_path),
    "fsdp_state_dict_type": ignored(
        "checkpoints are always sharded DCP; the full model is written by training.export_hf"
    ),
    "fsdp_cpu_ram_efficient_loading": ignored("always on: model.init_on_meta materialises only each rank's shards"),
    "fsdp_sync_module_states": ignored(
        "FSDP2 needs no broadcast: every rank builds its shards from the same weights and seed"
    ),
    "fsdp_use_orig_params": ignored("FSDP2 always keeps the original parameters (as DTensors)"),
    "fsdp_limit_all_gathers": ignored("an FSDP1 rate limiter; FSDP2 bounds all-gathers itself"),
    **dict.fromkeys(
        ("fsdp_xla", "fsdp_xla_fsdp_v2", "fsdp_xla_fsdp_grad_ckpt"),
        unsupported(XLA_FSDP, harmless=(False,)),
    ),
    "fsdp_xla_fsdp_settings": unsupported(XLA_FSDP, harmless=({},)),
}


# What TrainingArguments reads of its fsdp_config (transformers' _process_fsdp_args), by name without the `fsdp_`
# prefix it strips. FSDP1-only settings are read only with version 1; other Accelerate keys are not read at all.
FSDP1_ONLY = ("forward_prefetch", "backward_prefetch", "use_orig_params", "sync_module_states", "limit_all_gathers")
TRAINER_FSDP_CONFIG: dict[str, Rule] = {
    **{key.removeprefix("fsdp_"): rule for key, rule in FSDP_CONFIG.items()},
    "cpu_offload": to(f"{STRATEGY_CONFIG}.offload_policy", _flag),
    **dict.fromkeys(
        ("offload_params", "sharding_strategy", "ignored_modules"),
        ignored("TrainingArguments does not read it (offload is cpu_offload; sharding is the fsdp option string)"),
    ),
}
TRAINER_FSDP1_ONLY = ignored("TrainingArguments reads it only with version 1 (FSDP1)")


def _parallelism(translation: Translation, key: Written, value: Any) -> None:
    """Accelerate's N-D mesh (accelerate/parallelism_config.py, ParallelismConfig), laid [dp_replicate, dp_shard, cp,
    sp]: FSDP shards over dp_shard x cp ranks (its `dp_shard_cp` mesh) and replicates across dp_replicate, which
    fsdp2kit derives from the world size; the cp ranks of a sequence are consecutive, as in fsdp2kit's layout."""
    section(PARALLELISM)(translation, key, value)
    replicate = value.get("parallelism_config_dp_replicate_size")
    shard = value.get("parallelism_config_dp_shard_size")
    if isinstance(replicate, int) and replicate > 1 and shard is None:
        raise UserError(
            f"{key.file}: '{key}' sets parallelism_config_dp_replicate_size without "
            "parallelism_config_dp_shard_size; give the shard size (fsdp2kit derives the replicate size)"
        )
    context = _context_parallel_size(key, value)
    if shard is None:
        return
    shard_key = key.child("parallelism_config_dp_shard_size")
    if context == 1:
        to(f"{STRATEGY_CONFIG}.fsdp_size", whole_ranks)(translation, shard_key, shard)
        return
    fsdp_size = converted(shard_key, shard, whole_ranks) * context
    translation.set(f"{STRATEGY_CONFIG}.fsdp_size", fsdp_size, shard_key)
    translation.note(
        f"mapped {shard_key}={shard} x parallelism_config_cp_size={context} → {STRATEGY_CONFIG}.fsdp_size={fsdp_size}: "
        "Accelerate shards the parameters over the dp_shard x cp ranks (its dp_shard_cp mesh)"
    )


def _context_parallel_size(key: Written, value: dict[str, Any]) -> int:
    """The cp size, after Accelerate's own refusals of what it cannot combine with it (ParallelismConfig)."""
    cp_key = key.child("parallelism_config_cp_size")
    context = converted(cp_key, value.get("parallelism_config_cp_size", 1), whole_ranks)
    sequence = value.get("parallelism_config_sp_size") or 1
    if context > 1 and sequence != 1:
        raise UserError(
            f"{key.file}: '{cp_key}' = {context} with '{key.child('parallelism_config_sp_size')}' = {sequence} is not "
            "valid: Accelerate refuses context and sequence parallelism together; give one of them (natively "
            "model.context_parallel_size and model.ulysses_size compose)"
        )
    if context > 1 and (value.get("parallelism_config_dp_replicate_size") or 1) > 1:
        if value.get("parallelism_config_dp_shard_size") == 1:
            raise UserError(
                f"{key.file}: '{cp_key}' = {context} is not valid with parallelism_config_dp_replicate_size > 1 and "
                "parallelism_config_dp_shard_size 1: Accelerate refuses context parallelism beside pure replication; "
                "set parallelism_config_dp_shard_size > 1 (HSDP)"
            )
    return context


PARALLELISM: dict[str, Rule] = {
    "parallelism_config_dp_shard_size": already_read,
    "parallelism_config_dp_replicate_size": ignored("the replicate size is the world size / fsdp_size"),
    "parallelism_config_sp_size": to("model.ulysses_size"),
    "parallelism_config_tp_size": to("model.tensor_parallel_size"),
    "parallelism_config_cp_size": to("model.context_parallel_size"),
    "parallelism_config_cp_comm_strategy": ignored(
        "how torch's context_parallel passes key/value blocks (allgather or alltoall); fsdp2kit all-gathers them, "
        "the same attention"
    ),
    "parallelism_config_cp_backend": ignored("torch is Accelerate's only context-parallel backend, as here"),
    **dict.fromkeys(
        (
            "parallelism_config_sp_backend",
            "parallelism_config_sp_seq_length",
            "parallelism_config_sp_seq_length_is_variable",
            "parallelism_config_sp_attn_implementation",
        ),
        ignored(),
    ),
}


def _distributed_type(translation: Translation, key: Written, value: Any) -> None:
    if str(value).upper() != "FSDP":
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not valid: fsdp2kit reads Accelerate configs with "
            "distributed_type: FSDP"
        )


def _mixed_precision(translation: Translation, key: Written, value: Any) -> None:
    """Accelerate's FSDP plugin (`set_mixed_precision`) gives fully_shard a policy with param, reduce and output
    dtype all bf16|fp16, over parameters it upcasts to fp32; it also runs the forward under torch.autocast."""
    name = "no" if value is False else str(value).lower()  # YAML reads an unquoted `no` as false
    if name in ("no", "fp32"):
        translation.ignore(key, "full precision: param_dtype stays the model's dtype")
        return
    if name not in ("bf16", "fp16", "fp8"):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected one of 'no', 'bf16', 'fp16' or 'fp8'")
    if name == "fp8":  # Accelerate computes what float8 leaves out in bf16; the backend is fp8_config's (_fp8_config)
        translation.set(f"{STRATEGY_CONFIG}.float8.enabled", True, key)
        name = "bf16"
    for native in ("param_dtype", "reduce_dtype", "output_dtype"):
        translation.set(f"{STRATEGY_CONFIG}.{native}", name, key)
    translation.note(
        f"mapped {key}={name} → param_dtype, reduce_dtype, output_dtype={name} (Accelerate's FSDP policy); "
        "Accelerate also upcasts the parameters to fp32 (here model.dtype decides) and autocasts the forward "
        "(fsdp2kit does not)"
    )


def _fp8_backend(translation: Translation, data: dict[str, Any], where: Written) -> dict[str, Any]:
    """`mixed_precision: fp8` trains with torchao (fp8_config's `backend: AO`); TransformerEngine and MS-AMP are
    refused rather than run in bf16. Without fp8 Accelerate never reads fp8_config: it is left out (noted)."""
    fp8_config = data.get("fp8_config")
    if str(data.get("mixed_precision")).lower() != "fp8":
        if "fp8_config" in data:
            translation.ignore(where.child("fp8_config"), "read only with mixed_precision: fp8")
        return {k: v for k, v in data.items() if k != "fp8_config"}
    backend = str(fp8_config.get("backend", "")).upper() if isinstance(fp8_config, dict) else ""
    if backend != "AO":
        key = where.child("fp8_config.backend")
        raise UserError(
            f"{key.file}: '{key}' = {backend or 'not given'}: fsdp2kit trains mixed_precision fp8 with torchao only; "
            "set backend: AO (TransformerEngine and MS-AMP are not available)"
        )
    return data


def _fp8_config(translation: Translation, key: Written, value: Any) -> None:
    """Accelerate's AO recipe takes no keys from a config file: the others in fp8_config are TransformerEngine's
    and MS-AMP's (fp8_format, amax_history_len, opt_level, ...), ignored with a note."""
    others = [str(key.child(str(k))) for k in value if k != "backend"]
    translation.note(
        f"{key}.backend=AO → strategy_config.float8: torchao's tensorwise recipe with float8 all-gather (Accelerate's "
        "AO defaults); Accelerate's default filter also keeps the first linear layer in high precision, fsdp2kit "
        "converts it" + (f"; ignored (TransformerEngine and MS-AMP settings): {', '.join(others)}" if others else "")
    )


def _accelerate_fsdp_config(translation: Translation, key: Written, value: Any) -> None:
    """Without fsdp_auto_wrap_policy Accelerate's FSDP plugin wraps nothing (NO_WRAP); the Trainer wraps layers."""
    translate_fsdp_config(translation, value, key, default_wrap_policy="NO_WRAP")


ACCELERATE_CONFIG: dict[str, Rule] = {
    "distributed_type": _distributed_type,
    "mixed_precision": _mixed_precision,
    "fp8_config": _fp8_config,
    "fsdp_config": _accelerate_fsdp_config,
    "parallelism_config": _parallelism,
    **dict.fromkeys(
        (
            "compute_environment",
            "use_cpu",
            "debug",
            "num_processes",
            "machine_rank",
            "num_machines",
            "gpu_ids",
            "main_process_ip",
            "main_process_port",
            "rdzv_backend",
            "same_network",
            "main_training_function",
            "enable_cpu_affinity",
        ),
        ignored(LAUNCHER),
    ),
    **dict.fromkeys(
        (
            "downcast_bf16",
            "tpu_name",
            "tpu_zone",
            "tpu_use_cluster",
            "tpu_use_sudo",
            "command_file",
            "commands",
            "tpu_vm",
            "tpu_env",
        ),
        ignored("TPU settings"),
    ),
    "dynamo_config": ignored("torch.compile settings; fsdp2kit does not compile"),
    **dict.fromkeys(
        ("deepspeed_config", "megatron_lm_config", "mpirun_config", "tp_config", "ipex_config"),
        ignored("not used with distributed_type FSDP"),
    ),
}


def is_accelerate_config(data: dict[str, Any]) -> bool:
    """An Accelerate file always has some of its own top-level keys; a MindSpeed-MM file has none of them."""
    return any(key in ACCELERATE_CONFIG for key in data)


def translate_file(translation: Translation, data: dict[str, Any], path: str) -> None:
    """An `accelerate config` file replaces strategy_config. Without `fsdp_config` Accelerate's FSDP plugin takes
    its defaults: FSDP1, NO_WRAP."""
    translation.replace(STRATEGY_CONFIG, {}, Written(path, ""))
    translation.note(f"{STRATEGY_CONFIG} read from {path} (Accelerate config)")
    if data.get("fsdp_config") is None:
        data = {**data, "fsdp_config": {}}
    fsdp_config = data["fsdp_config"]
    if isinstance(fsdp_config, dict) and fsdp_config.get("fsdp_version") is None:
        translation.note("fsdp_config.fsdp_version not given: Accelerate runs FSDP1; its settings read as FSDP2")
    apply_rules(translation, _fp8_backend(translation, data, Written(path, "")), ACCELERATE_CONFIG, Written(path, ""))
    transformers_schedule(translation, Written(path, ""), "an Accelerate config's HF Trainer")


def translate_fsdp_config(translation: Translation, values: Any, where: Written, default_wrap_policy: str) -> None:
    """An Accelerate `fsdp_config` section."""
    if not isinstance(values, dict):
        raise UserError(f"{where.file}: '{where}' must be a mapping of fsdp_* keys, not {values!r}")
    _wrap_policy(translation, values, where, default_wrap_policy)
    apply_rules(translation, values, FSDP_CONFIG, where)


def translate_trainer_fsdp_config(translation: Translation, values: Any, where: Written) -> None:
    """TrainingArguments' `fsdp_config`: a dict, or the path of a JSON file as transformers' docs give it. The
    Trainer strips the `fsdp_` prefix, defaults to version 2 and TRANSFORMER_BASED_WRAP."""
    if isinstance(values, str):
        values, where = _trainer_json(values, where), Written(values, "")
    if not isinstance(values, dict):
        raise UserError(f"{where.file}: '{where}' must be a mapping of fsdp settings or a JSON file, not {values!r}")
    _wrap_policy(translation, values, where, "TRANSFORMER_BASED_WRAP")
    version = str(_setting(values, "fsdp_version")[1] or 2)
    for key, value in values.items():
        name = str(key).removeprefix("fsdp_")
        if value is None or name in ("auto_wrap_policy", "transformer_layer_cls_to_wrap", "min_num_params"):
            continue
        rule = TRAINER_FSDP1_ONLY if name in FSDP1_ONLY and version != "1" else TRAINER_FSDP_CONFIG.get(name)
        if rule is None:
            raise UserError(unknown_key(where.child(str(key)), list(TRAINER_FSDP_CONFIG)))
        rule(translation, where.child(str(key)), value)


def _trainer_json(path: str, where: Written) -> dict[str, Any]:
    """transformers opens the path as given (relative to the working directory) and reads it as JSON."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{where.file}: '{where}' = {path!r}: no such file") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{where.file}: '{where}' = {path!r} is not valid JSON at line {exc.lineno}") from None


def is_trainer_fsdp_config(data: dict[str, Any]) -> bool:
    """A Trainer fsdp_config file holds only fsdp_config settings (with or without the `fsdp_` prefix)."""
    names = [str(key).removeprefix("fsdp_") for key in data]
    return bool(names) and all(name in TRAINER_FSDP_CONFIG or name in FSDP1_ONLY for name in names)


def translate_trainer_file(translation: Translation, data: dict[str, Any], path: str) -> None:
    """A Trainer fsdp_config JSON given with --fsdp-config replaces strategy_config."""
    translation.replace(STRATEGY_CONFIG, {}, Written(path, ""))
    translation.note(f"{STRATEGY_CONFIG} read from {path} (Trainer fsdp_config)")
    translate_trainer_fsdp_config(translation, data, Written(path, ""))
    transformers_schedule(translation, Written(path, ""), "the HF Trainer")


def _setting(values: dict[str, Any], name: str) -> tuple[str, Any]:
    """(the key as written, its value) for an `fsdp_*` setting written with or without its prefix."""
    for key in (name, name.removeprefix("fsdp_")):
        if values.get(key) is not None:
            return key, values[key]
    return name, None


def _wrap_policy(translation: Translation, values: dict[str, Any], where: Written, default: str) -> None:
    """The policy decides which of the class list and the size limit Accelerate reads; the other is unused."""
    policy_name, policy = _setting(values, "fsdp_auto_wrap_policy")
    policy_key, policy = where.child(policy_name), str(policy or default).upper()
    if policy not in WRAP_POLICIES:
        raise UserError(
            f"{policy_key.file}: '{policy_key}' = {policy!r} is not valid: expected one of {', '.join(WRAP_POLICIES)}"
        )
    for name, (reader, native_key, convert) in WRAP_SETTINGS.items():
        written, value = _setting(values, name)
        if policy == reader == "SIZE_BASED_WRAP" and not value:
            raise UserError(f"{policy_key.file}: '{policy_key}' = SIZE_BASED_WRAP needs '{where.child(name)}' > 0")
        if value is None:
            continue
        if policy == reader:
            to(native_key, convert)(translation, where.child(written), value)
        else:
            translation.ignore(where.child(written), f"read only with fsdp_auto_wrap_policy {reader}")
    if policy == "NO_WRAP":
        translation.set(f"{STRATEGY_CONFIG}.wrap_policy.no_wrap", True, policy_key)
        how = "as written" if _setting(values, "fsdp_auto_wrap_policy")[1] else "Accelerate's default"
        translation.note(
            f"{policy_key}=NO_WRAP ({how}) → {STRATEGY_CONFIG}.wrap_policy.no_wrap: only the root is sharded"
        )


def translate_trainer_keys(translation: Translation) -> None:
    """TrainingArguments' `fsdp` option string and `fsdp_config` dict, written inside strategy_config."""
    strategy = translation.get(STRATEGY_CONFIG)
    if not isinstance(strategy, dict) or not {"fsdp", "fsdp_config"} & strategy.keys():
        return
    where = translation.written_as(STRATEGY_CONFIG)
    options, fsdp_config = strategy.pop("fsdp", None), strategy.pop("fsdp_config", None)
    if options is not None:
        _fsdp_options(translation, options, where.child("fsdp"))
    if fsdp_config is not None:
        translate_trainer_fsdp_config(translation, fsdp_config, where.child("fsdp_config"))
    transformers_schedule(translation, where, "the HF Trainer")


def _fsdp_options(translation: Translation, value: Any, key: Written) -> None:
    """'full_shard auto_wrap offload' (or a list, or true). auto_wrap is the default: each decoder layer is a group."""
    if value is True:
        translation.ignore(key, "fsdp2kit always shards with FSDP2")
        return
    options = value.split() if isinstance(value, str) else value
    if not options or not isinstance(options, list):
        raise UserError(
            f"{key.file}: '{key}' = {value!r} is not valid: fsdp2kit always shards with FSDP2; give "
            "sharding options such as 'full_shard auto_wrap' or drop the key"
        )
    mapped: list[tuple[str, Any]] = []
    for option in options:
        if str(option).upper() in SHARDING_STRATEGIES:
            mapped.append(("sharding_strategy", SHARDING_STRATEGIES[str(option).upper()]))
        elif option == "offload":
            mapped.append(("offload_policy", True))
        elif option != "auto_wrap":
            valid = [name.lower() for name in SHARDING_STRATEGIES] + ["offload", "auto_wrap"]
            raise UserError(
                f"{key.file}: '{key}' = {value!r} is not valid: unknown option {option!r}; options: {', '.join(valid)}"
            )
    for native, new_value in mapped:
        translation.set(f"{STRATEGY_CONFIG}.{native}", new_value, key)
    summary = ", ".join(f"{native}={new_value!r}" for native, new_value in mapped) or "the default plan"
    translation.note(f"mapped {key}={value!r} → {STRATEGY_CONFIG}: {summary}")
    fsdp1_only = [o for o in options if str(o).upper() in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2", "NO_SHARD")]
    if fsdp1_only:
        translation.note(
            f"{key}: transformers takes {fsdp1_only[0]} only with fsdp_config version 1 (FSDP1); "
            "fsdp2kit runs it with FSDP2 on its mesh"
        )
