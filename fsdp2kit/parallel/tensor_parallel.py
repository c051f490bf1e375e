"""Tensor parallelism: each decoder layer's matrices split over the `tp` mesh dimension by the family's own TP plan
(transformers' `tp_plan`: q/k/v and the MLP's up projections by output columns, o_proj and down_proj by input rows),
the input embedding by vocabulary rows and the LM head by vocabulary, whose log-probs and loss the chunked head then
computes on those shards (`parallel/vocab_parallel.py`): no rank holds a token's whole logits. Applied on the meta
device before `fully_shard`, which shards each split parameter over the other dimensions (2D), as torchtitan does;
attention runs on each rank's own heads."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from fsdp2kit.errors import UserError
from fsdp2kit.parallel.plan import compile_pattern


class ReplicatedOverRows(ParallelStyle):
    """transformers' `replicated_with_grad_allreduce`: a module every tp rank holds whole that sees only its rank's
    rows (Qwen3's q_norm over the rank's own heads). Its input is declared sharded by rows, so the gradient of its
    weights comes out partial over the tp ranks and is summed (FSDP redistributes it to the weights' placement).
    The rows are independent (a norm over the last dimension), so any leading dimension serves as theirs."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def rows_in(_: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            first = DTensor.from_local(inputs[0], mesh, [Shard(0)], run_check=False)
            return (first, *inputs[1:])

        def rows_out(_: nn.Module, output: DTensor, mesh: DeviceMesh) -> Any:
            return output.to_local()

        # torch's stub types input_fn as returning None; a returned value replaces the inputs
        return distribute_module(module, device_mesh, input_fn=rows_in, output_fn=rows_out)  # type: ignore[arg-type]


def _styles() -> dict[str, ParallelStyle]:
    """transformers' plan styles (their names in the 5.x releases and before) as torch's parallel styles."""
    return {
        "colwise": ColwiseParallel(),
        "colwise_rep": ColwiseParallel(output_layouts=Replicate()),
        "colwise_gather_output": ColwiseParallel(output_layouts=Replicate()),
        "rowwise": RowwiseParallel(),
        "rowwise_split_input": RowwiseParallel(input_layouts=Replicate()),
        "embedding_rowwise": RowwiseParallel(input_layouts=Replicate()),
        "replicated_with_grad_allreduce": ReplicatedOverRows(),
    }


def tp_plan(model: nn.Module, head: str) -> dict[str, str]:
    """The family's TP plan over module paths of `model` (`*` is one path segment), without the LM head `head`,
    which the chunked head serves by vocabulary shards whatever the plan says. Refused for a family without one."""
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not any(key != head for key in plan):
        family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise UserError(
            f"model.tensor_parallel_size: the {family} family has no tensor-parallel plan in transformers "
            "(its config's base_model_tp_plan); set model.tensor_parallel_size: 1"
        )
    return {key: style for key, style in plan.items() if key != head}


def planned_modules(model: nn.Module, plan: dict[str, str], users: bool = False) -> dict[str, str]:
    """{module path: style} of the modules the plan's patterns match (transformers' `*` is one path segment, as in
    the strategy's own patterns). In the user's plan (`users`: model.tensor_parallel_plan) a pattern that matches
    nothing is refused; the family's plan names modules a model may not have (a dense MLP's in a MoE layer)."""
    names = [name for name, _ in model.named_modules() if name]
    modules: dict[str, str] = {}
    for pattern, style in plan.items():
        regex = compile_pattern(pattern)
        hits = [name for name in names if regex.fullmatch(name)]
        if users and not hits:
            example = next((n for n in names if n.count(".") == pattern.count(".")), names[0] if names else "")
            raise UserError(
                f"model.tensor_parallel_plan: pattern '{pattern}' matches no module of the model "
                f"(module paths look like '{example}')"
            )
        modules.update(dict.fromkeys(hits, style))
    return modules


def _check_splittable(model: nn.Module, modules: dict[str, str]) -> None:
    """A style fsdp2kit does not apply, or one on a module that is not a plain linear or embedding (a fused experts
    block), is refused rather than split wrong."""
    styles = _styles()
    for name, style in modules.items():
        module = model.get_submodule(name)
        kinds = (nn.Embedding,) if style == "embedding_rowwise" else (nn.Linear,)
        if style not in styles or (style != "replicated_with_grad_allreduce" and type(module) not in kinds):
            raise UserError(
                f"model.tensor_parallel_size: transformers' TP plan splits '{name}' ({type(module).__name__}) "
                f"as '{style}', which fsdp2kit does not apply; valid styles on linears and embeddings: "
                f"{', '.join(sorted(styles))}; set model.tensor_parallel_size: 1"
            )


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    head: str,
    split: Callable[[nn.Module, dict[str, str]], dict[str, str]] = lambda _, modules: modules,
    own_plan: dict[str, str] | None = None,
) -> dict[str, str]:
    """Split `model` in place over `tp_mesh` by its family's plan (or the user's
    `own_plan`, model.tensor_parallel_plan), as `split` (the model variant's `split_modules`) translates it; the LM
    head `head` by vocabulary (its weight's rows, and the bias's), a tied head sharing the embedding's rows. Returns
    the split modules and their styles."""
    config = getattr(model, "config", None)
    split_heads_check(getattr(config, "text_config", None) or config, tp_mesh.size())
    tied = model.get_submodule(head).weight is model.get_input_embeddings().weight  # type: ignore[operator]
    planned = planned_modules(model, own_plan, users=True) if own_plan else planned_modules(model, tp_plan(model, head))
    modules = split(model, {name: style for name, style in planned.items() if name != head})
    _check_splittable(model, modules)
    styles = _styles()
    parallelize_module(model, tp_mesh, {name: styles[style] for name, style in modules.items()})
    head_module = model.get_submodule(head)
    if tied:
        head_module.weight = model.get_input_embeddings().weight  # type: ignore[operator]
    else:
        for key, param in head_module.named_parameters(recurse=False):
            sharded = nn.Parameter(distribute_tensor(param, tp_mesh, [Shard(0)]), requires_grad=param.requires_grad)
            head_module.register_parameter(key, sharded)
    modules[head] = "vocabulary"
    return modules


def split_heads_check(hf_config: Any, tp_size: int) -> None:
    """Attention runs on each rank's own heads: the query and key/value head counts must split evenly."""
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for key, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if isinstance(count, int) and count % tp_size:
            raise UserError(
                f"model.tensor_parallel_size = {tp_size} does not divide the model's {key} ({count}): each rank "
                f"attends with its own heads; valid: {', '.join(str(d) for d in range(1, count + 1) if count % d == 0)}"
            )
