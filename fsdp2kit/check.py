"""`fsdp2kit check`: validate the config, check the files it names, and describe the resolved plan, built on the meta
device (no weights)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.nn as nn
import yaml
from torch.distributed.fsdp import FSDPModule

from fsdp2kit.checkpoint.committed import CHECKPOINTS
from fsdp2kit.checkpoint.dcp_io import damage
from fsdp2kit.checkpoint.manager import resume_checkpoint
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.data.chat import ChatTemplate
from fsdp2kit.data.dataset import conversation_form, load_tokenizer, source_files
from fsdp2kit.data.mixture import named_as
from fsdp2kit.distributed import Runtime
from fsdp2kit.dtypes import torch_name
from fsdp2kit.errors import UserError
from fsdp2kit.models.build import (
    attention_implementation,
    check_data_fits,
    check_safetensors,
    open_safetensors,
    resolve_attention,
    resolve_model,
    safetensors_index,
)
from fsdp2kit.models.sharded import build_sharded_model, count_parameters
from fsdp2kit.parallel.document_attention import document_route
from fsdp2kit.parallel.expert_parallel import describe_expert_parallel
from fsdp2kit.parallel.float8 import describe_float8
from fsdp2kit.parallel.fsdp import describe_groups
from fsdp2kit.parallel.mesh import MeshLayout
from fsdp2kit.parallel.module_paths import model_class_name
from fsdp2kit.parallel.plan import ShardingPlan
from fsdp2kit.strategy import INFER_COMMAND, TRAIN_COMMAND
from fsdp2kit.train.optim import describe_optimizer
from fsdp2kit.train.run_dir import output_dir_problem
from fsdp2kit.train.run_layout import context_parallel_layout


def _size(files: list[Path]) -> str:
    total = sum(f.stat().st_size for f in files)
    return f"{total / 2**20:.1f} MiB" if total >= 2**20 else f"{total} bytes"


def _conversations(cfg: JobConfig, tokenizer: Any, hf_config: Any) -> dict[str, str]:
    """For conversation data: the chat template renders (a missing one, or a `data.template` name of another
    family, is refused now) and what it ends an assistant turn with."""
    form = conversation_form(cfg.data)
    if form is None:
        return {}
    template = ChatTemplate.from_config(cfg.data, tokenizer, getattr(hf_config, "model_type", None))
    where = f"data.chat_template ({cfg.data.chat_template})" if cfg.data.chat_template else "the tokenizer's own"
    named = f"; data.template '{cfg.data.template}' read as it" if cfg.data.template else ""
    return {
        "chat template": f"{where}{named}; assistant turns end with {template.end_of_turn or 'nothing'!r}, "
        f"records read as {form}"
    }


def _resume(cfg: JobConfig) -> dict[str, str]:
    """A training run's `training.resume`, resolved as train resolves it: a checkpoint that is missing, truncated or
    damaged is refused now, not after the model has loaded."""
    if cfg.strategy_args.strategy_name != "fsdp2_train":
        return {}
    resume = cfg.training.resume
    path, passed_over = resume_checkpoint(Path(cfg.training.output_dir) / CHECKPOINTS, resume)
    if path is None:
        return {"training.resume": f"{resume}: no checkpoint to resume, the run starts at step 1"}
    resumed = f"{path} (trainer state read, every shard file as long as its metadata says)"
    return {"training.resume": resumed + (f"; {passed_over}" if passed_over else "")}


def checked_files(cfg: JobConfig) -> dict[str, str]:
    """The files the config names, checked without reading them whole or creating anything, so that a run does not
    fail on them after its model has loaded: the data files exist and are of one kind, the weights are whole
    (safetensors headers against file sizes, or a checkpoint's metadata and shard sizes), the tokenizer loads,
    output_dir can be written, and a training run's resume checkpoint is whole. A problem is a UserError naming the
    key and the file; otherwise what was checked."""
    data = source_files(cfg.data.source, cfg.data.dataset_dir)
    kinds = ", ".join(sorted({f.suffix or f.name for f in data}))
    source = resolve_model(cfg.model, cfg.data.tokenizer)  # config.json readable; weights present or refused
    folder = source.weights_dir
    if folder is None:
        weights = f"none ({cfg.model.name_or_path} starts from weights drawn with training.seed)"
    elif source.weights_format == "dcp":
        problem = damage(folder)
        if problem is not None:
            raise UserError(f"model.name_or_path: checkpoint '{folder}' is damaged: {problem}")
        weights = f"DCP checkpoint {folder} (metadata read, every shard file as long as it says)"
    else:
        shards = sorted(set(safetensors_index(folder).values()))  # a damaged index, a tensor in two files: refused
        for shard in shards:
            if not shard.is_file():
                raise UserError(f"model weights: '{shard}' is named by the index but does not exist")
            open_safetensors(shard).__exit__(None, None, None)  # safetensors checks the header against the size
        weights = f"{len(shards)} safetensors file(s) in {folder} ({_size(shards)}, headers whole)"
    tokenizer = load_tokenizer(source.tokenizer_path, cfg.model.trust_remote_code)
    check_data_fits(source.hf_config, cfg.data.seq_len, tokenizer)
    conversations = _conversations(cfg, tokenizer, source.hf_config)
    output_dir = Path(cfg.training.output_dir)
    problem = output_dir_problem(output_dir)
    if problem is not None:
        raise UserError(problem)
    resumed = _resume(cfg)
    checked = {"data.source": f"{len(data)} file(s) of one kind ({kinds}), {_size(data)}"}
    if cfg.data.eval_source is not None:
        with named_as("data.eval_source"):
            evaluated = source_files(cfg.data.eval_source, cfg.data.dataset_dir)
        checked["data.eval_source"] = f"{len(evaluated)} file(s), {_size(evaluated)}"
    return checked | {
        "model weights": weights,
        "tokenizer": f"{source.tokenizer_path} (loads, {len(tokenizer)} tokens)",
        **conversations,
        "training.output_dir": f"{output_dir} "
        + ("(a writable folder)" if output_dir.is_dir() else "(can be created; not created now)"),
        **resumed,
    }


def _layout_fields(layout: MeshLayout) -> dict[str, Any]:
    """The mesh and the groups laid over it."""
    return {
        "mesh": {"shape": list(layout.shape), "dim_names": list(layout.dim_names)},
        # Ulysses: groups of consecutive ranks that share samples, each rank holding a slice of their tokens.
        "sequence_parallel": {
            "size": layout.ulysses_size,
            "groups": layout.sequence_parallel_groups(),
            "data_parallel_size": layout.data_parallel_size,
        },
        # Context parallel: groups across the Ulysses groups; each rank's share of every sequence (`token_order`).
        "context_parallel": context_parallel_layout(layout),
        # Tensor parallelism: groups of consecutive ranks that split each layer and share samples.
        "tensor_parallel": {"size": layout.tp_size, "groups": layout.tensor_parallel_groups()},
        # The mesh in the dimensions Accelerate and torchtitan name: replicas, FSDP's shards beside the sequence
        # groups (which FSDP shards over too), context and Ulysses groups, tp.
        "parallel_dims": layout.parallel_dims(),
    }


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
    # The commands train and score next tokens: a value or reward model (the API's) is refused as the run would.
    sharded.variant.head.require_log_probs(TRAIN_COMMAND if training else INFER_COMMAND)
    model, plan = sharded.model, sharded.plan
    folder = sharded.source.weights_dir
    if folder is not None and sharded.source.weights_format == "safetensors":  # names and shapes, from headers
        check_safetensors(model, folder, sharded.variant.tensor_leeway)
    trainable, frozen = count_parameters(model)
    layout = sharded.layout
    attention_note = resolve_attention(cfg.model.attn_implementation, layout.sequence_size)[1]
    return {
        "world_size": runtime.world_size,
        **_layout_fields(layout),
        # Expert parallelism: the experts' own mesh, the modules split over it, and each rank's experts.
        "expert_parallel": describe_expert_parallel(model, plan.expert_parallel, sharded.layout),
        "strategy": cfg.strategy_args.strategy_name,
        "model": {
            "name_or_path": cfg.model.name_or_path,
            "class": model_class_name(model),
        },
        # Read back from the live modules, so this is what fully_shard did, not what we meant it to do.
        "sharded_modules": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
        "groups": describe_groups(model),
        **_plan_fields(plan, model),
        "frozen_modules": cfg.model.freeze_module_prefix,
        "trainable_parameters": trainable,
        # training.optimizer: muon names the matrices Muon orthogonalises and what AdamW takes.
        "optimizer": describe_optimizer(model, cfg.training),
        "frozen_parameters": frozen,
        "master_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "ulysses_size": cfg.model.ulysses_size,
        "custom_plan": plan.custom,
        # The model's kind (vision_patch: the tower runs on every forward) and, for LoRA, the adapters by shard
        # group, their trainable count and the bytes they and their AdamW state take.
        **sharded.variant.describe(),
        "attn_implementation": attention_implementation(model),  # as transformers resolved it
        # How packed documents are kept apart: FlexAttention's block mask, varlen flash, or a dense [T, T] mask.
        "document_attention": document_route(model, cfg.model, cfg.data, runtime.device)[1],
        "notes": plan.notes + ([attention_note] if attention_note else []),
        "config_notes": cfg.notes,
    }


def _plan_fields(plan: ShardingPlan, model: nn.Module) -> dict[str, Any]:
    """What the plan decided besides the groups: recompute, compile, TiledMLP, precision, reshard, offload, prefetch;
    and the linears torchao's Float8Linear runs in float8 (strategy_config.float8), read back from the model."""
    return {
        "float8": describe_float8(model),
        "ignored_modules": plan.ignored_modules,
        "recompute_modules": plan.recompute_modules,
        "activation_offload_modules": plan.activation_offload_modules,
        "compiled_modules": plan.compiled_modules,
        "tiled_mlp": {"modules": plan.tiled_mlp_modules, "num_shards": plan.tiled_num_shards}
        if plan.tiled_mlp_modules
        else None,
        "expert_patch": plan.expert_patch,
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
    }


def print_check(cfg: JobConfig, runtime: Runtime, as_json: bool) -> None:
    files = checked_files(cfg)  # before the plan: a missing file is found in a second, not after the model builds
    description = describe(cfg, runtime)
    if not runtime.is_main:
        return
    if as_json:
        print(json.dumps({"files": files, **description}), flush=True)
        return
    print("# resolved config")
    print(yaml.safe_dump(json.loads(cfg.model_dump_json()), sort_keys=False, allow_unicode=True).rstrip())
    print("# files")
    print(yaml.safe_dump({"files": files}, sort_keys=False, width=120, allow_unicode=True).rstrip())
    print("# plan")
    print(yaml.safe_dump(description, sort_keys=False, allow_unicode=True).rstrip(), flush=True)
