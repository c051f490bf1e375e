"""MindSpeed-MM's flat `fsdp2_config.yaml` (`--fsdp2-config-path`): its keys (sharding_size, param_dtype,
reduce_dtype, output_dtype, cast_forward_inputs, sub_modules_to_wrap, ignored_modules, recompute_modules,
use_reentrant, reshard_after_forward, offload_to_cpu, pin_memory, num_to_forward_prefetch,
num_to_backward_prefetch) are native strategy_config keys or their aliases, so the file replaces strategy_config
as it is and is validated as one, with errors naming the file and its own keys."""

from __future__ import annotations

from typing import Any

from fsdp2kit.config.dialects.translation import STRATEGY_CONFIG, Translation, Written


def translate_file(translation: Translation, data: dict[str, Any], path: str) -> None:
    translation.replace(STRATEGY_CONFIG, data, Written(path, ""))
    translation.note(f"{STRATEGY_CONFIG} read from {path} (MindSpeed-MM fsdp2_config)")
