"""`apply_float8`: torchao's float8 training on the chosen linears, before `fully_shard` (torchtitan's order).

torchao's Float8Linear keeps its weight as an ordinary parameter in the master dtype and casts to float8 only inside
its matmuls, so the optimizer, checkpoints and the HF export hold the same tensors as without float8. With FSDP's
float8 all-gather the sharded weight is wrapped so that FSDP gathers float8 bytes; the scales of those casts are
computed in one all-reduce after each optimizer step (`refresh_float8_scales`)."""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, cast

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fsdp2kit.config.schema import Float8Config
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.moe import router_modules
from fsdp2kit.parallel.plan import match_modules

# transformers imports torchao wherever it is installed; on a CPU build its CUDA kernels' libraries fail to load with
# a warning per library on every run (torchao's CPU paths, which float8 training uses here, do not need them).
logging.getLogger("torchao").setLevel(logging.ERROR)


class _EnumRegistrationNotice(logging.Filter):
    """torchao 0.18 registers its enums with a pytree call torch 2.13 deprecates, which warns on every run that
    imports torchao (transformers does wherever it is installed): a notice to torchao, not to a user."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is an Enum subclass and is now natively supported" not in record.getMessage()


logging.getLogger("torch.utils._pytree").addFilter(_EnumRegistrationNotice())

MULTIPLE = 16  # float8 matmuls (torch._scaled_mm) need both dimensions of the weight to be multiples of 16
HIGH_PRECISION = "fsdp2kit_high_precision"  # a module attribute: keep_high_precision's mark


def keep_high_precision(module: nn.Module) -> None:
    """Mark a module that float8 training leaves as it is, with every linear below it, whatever its dimensions: what a
    model variant trains beside a frozen base (LoRA's adapters and modules to save, `models/lora.py`) says so itself,
    before the plan, so that the filter here needs to know no variant."""
    setattr(module, HIGH_PRECISION, True)


def float8_modules(model: nn.Module, cfg: Float8Config) -> list[str]:
    """The linears converted: every nn.Linear but the LM head, the routers (their logits pick the experts), those
    whose dimensions are not multiples of 16, those under `exclude_modules` and those under a module marked by
    `keep_high_precision`."""
    get_outputs = getattr(model, "get_output_embeddings", None)
    head = get_outputs() if get_outputs is not None else None
    marked = [name for name, module in model.named_modules() if getattr(module, HIGH_PRECISION, False)]
    kept = [*router_modules(model), *match_modules(model, cfg.exclude_modules, "float8.exclude_modules"), *marked]
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module is not head
        and module.in_features % MULTIPLE == 0
        and module.out_features % MULTIPLE == 0
        and not any(name == k or name.startswith(k + ".") for k in kept)
    ]


def apply_float8(model: nn.Module, cfg: Float8Config) -> list[str]:
    """Swap the chosen linears for Float8Linear in place (names and parameters unchanged); returns their names."""
    if not cfg.enabled:
        return []
    names = float8_modules(model, cfg)
    chosen = set(names)
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise UserError(
            "strategy_config.float8.enabled: float8 training needs torchao (pip install 'fsdp2kit[float8]')"
        ) from None

    config = Float8LinearConfig.from_recipe_name(cfg.recipe)
    if cfg.fsdp_float8_all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _module, name: name in chosen)
    return names


def grouped_matmul_modules(model: nn.Module) -> list[str]:
    """Modules holding stacked 3-D weights (a mixture of experts' fused experts, run as grouped matmuls), which
    torchao's float8 training does not convert: they stay in the compute dtype."""
    return [
        name
        for name, module in model.named_modules()
        if any(param.ndim == 3 for param in module.parameters(recurse=False))
    ]


def refresh_float8_scales(model: nn.Module) -> None:
    """After an optimizer step: the float8 scales of the weights FSDP gathers in float8, one all-reduce for all of
    them (torchao's precompute; it does nothing where no weight is gathered in float8)."""
    if "torchao.float8" not in sys.modules:  # nothing was converted in this process: no module can be Float8Linear
        return
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    precompute_float8_dynamic_scale_for_fsdp(model)


def describe_float8(model: nn.Module) -> dict[str, Any] | None:
    """What `check` shows: the converted linears, read back from the live modules, and the linears left as they were."""
    converted = {name: module for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"}
    if not converted:
        return None
    config: Any = next(iter(converted.values())).config
    return {
        "modules": list(converted),
        "fsdp_float8_all_gather": bool(config.enable_fsdp_float8_all_gather),
        "high_precision_linears": [
            name for name, module in model.named_modules() if type(module) is nn.Linear and name not in converted
        ],
        "high_precision_grouped_matmuls": grouped_matmul_modules(model),
    }


def _float8_gathered(tensor: torch.Tensor) -> torch.Tensor | None:
    """The ordinary local shard inside torchao's float8 all-gather wrapper, or None for a tensor not wrapped."""
    if "torchao.float8" not in sys.modules or not isinstance(tensor, DTensor):
        return None
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    local = tensor.to_local()
    return local._tensor if isinstance(local, WeightWithDynamicFloat8CastTensor) else None


def plain_weight(tensor: torch.Tensor) -> torch.Tensor:
    """The same weight without torchao's float8 all-gather wrapper (a DTensor of the same local storage), for what
    writes or sends weights (safetensors, a rollout engine), which take ordinary tensors only."""
    inner = _float8_gathered(tensor)
    if inner is None:
        return tensor
    dtensor = cast(DTensor, tensor)
    return DTensor.from_local(
        inner, dtensor.device_mesh, dtensor.placements, shape=dtensor.shape, stride=dtensor.stride()
    )


def gathered_element_size(sharded: torch.Tensor, compute_dtype: torch.dtype) -> int:
    """Bytes per element FSDP all-gathers of a sharded parameter: one for a weight gathered in float8."""
    return 1 if _float8_gathered(sharded) is not None else compute_dtype.itemsize
