"""`fsdp2kit check`: validate the config and describe the resolved plan, built on the meta device (no weights)."""

from __future__ import annotations

import dataclasses
import json

import yaml
from torch.distributed.fsdp import FSDPModule

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.distributed import Runtime
from fsdp2kit.dtypes import torch_name
from fsdp2kit.models.sharded import build_sharded_model, count_parameters
from fsdp2kit.parallel.fsdp import describe_groups


def describe(cfg: JobConfig, runtime: Runtime) -> dict:
    training = cfg.strategy_args.strategy_name == "fsdp2_train"
    sharded = build_sharded_model(
        cfg.model,
        cfg.strategy_args.strategy_config,
        cfg.data,
        runtime,
        training=training,
        seed=cfg.training.seed,
        compile_layers=cfg.training.compile,
        materialize=False,
    )
    model, plan = sharded.model, sharded.plan
    trainable, frozen = count_parameters(model)
    return {
        "world_size": runtime.world_size,
        "mesh": {"shape": list(sharded.layout.shape), "dim_names": list(sharded.layout.dim_names)},
        # Ulysses: groups of consecutive ranks that share samples, each rank holding a slice of their tokens.
        "sequence_parallel": {
            "size": sharded.layout.ulysses_size,
            "groups": sharded.layout.sequence_parallel_groups(),
            "data_parallel_size": sharded.layout.data_parallel_size,
        },
        "strategy": cfg.strategy_args.strategy_name,
        "model": {
            "name_or_path": cfg.model.name_or_path,
            "class": next(c.__name__ for c in type(model).__mro__ if not issubclass(c, FSDPModule)),
        },
        # Read back from the live modules, so this is what fully_shard did, not what we meant it to do.
        "sharded_modules": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
        "groups": describe_groups(model),
        "ignored_modules": plan.ignored_modules,
        "recompute_modules": plan.recompute_modules,
        "compiled_modules": plan.compiled_modules,
        "tiled_mlp": {"modules": plan.tiled_mlp_modules, "num_shards": plan.tiled_num_shards}
        if plan.tiled_mlp_modules
        else None,
        "expert_patch": plan.expert_patch,
        "vision_patch": plan.vision_patch,
        "frozen_modules": cfg.model.freeze_module_prefix,
        "trainable_parameters": trainable,
        "frozen_parameters": frozen,
        "master_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "mixed_precision": {
            "param_dtype": torch_name(plan.param_dtype),
            "reduce_dtype": torch_name(plan.reduce_dtype),
            "output_dtype": torch_name(plan.output_dtype),
            "cast_forward_inputs": plan.cast_forward_inputs,
            "no_cast_modules": plan.no_cast_modules,
        },
        "reshard_after_forward": plan.reshard_after_forward,
        "offload": plan.offload,
        "pin_memory": plan.pin_memory,
        "prefetch": {"forward": plan.forward_prefetch, "backward": plan.backward_prefetch},
        "use_reentrant": plan.use_reentrant,
        "ulysses_size": cfg.model.ulysses_size,
        "custom_plan": plan.custom,
        # LoRA: the adapters by shard group, their trainable count and the bytes they and their AdamW state take.
        "lora": dataclasses.asdict(plan.adapters) if plan.adapters else None,
        "notes": plan.notes,
        "config_notes": cfg.notes,
    }


def print_check(cfg: JobConfig, runtime: Runtime, as_json: bool) -> None:
    description = describe(cfg, runtime)
    if not runtime.is_main:
        return
    if as_json:
        print(json.dumps(description), flush=True)
        return
    print("# resolved config")
    print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False).rstrip())
    print("# plan")
    print(yaml.safe_dump(description, sort_keys=False).rstrip(), flush=True)
