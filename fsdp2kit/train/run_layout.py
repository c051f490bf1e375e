"""What a run prints once at its start about its layout: the mesh, what each rank holds of a sequence, the attention
path and the optimizer's split (the same facts `check` prints, for a run that goes straight to training)."""

from __future__ import annotations

from typing import Any

from fsdp2kit.config.schema import DataConfig, ModelConfig, TrainingConfig
from fsdp2kit.models.build import attention_implementation
from fsdp2kit.models.sharded import ShardedModel
from fsdp2kit.parallel.document_attention import document_route
from fsdp2kit.parallel.mesh import MeshLayout
from fsdp2kit.train.optim import describe_optimizer


def context_parallel_layout(layout: MeshLayout) -> dict[str, Any]:
    """The context-parallel groups and which tokens each rank of one holds
    (`parallel/sequence_layout.py:token_order`)."""
    c, k = layout.context_parallel_size, layout.ulysses_size
    if c == 1:
        return {"size": 1, "groups": layout.context_parallel_groups()}
    return {
        "size": c,
        "groups": layout.context_parallel_groups(),
        "chunks": f"rank r: chunks r and {2 * c - 1}-r of {2 * c} (the sequence padded to a multiple of {2 * c * k})"
        + (f", cut into {k} contiguous Ulysses slices" if k > 1 else ""),
    }


def run_layout(
    sharded: ShardedModel, model: ModelConfig, data: DataConfig, training: TrainingConfig, device: Any
) -> list[str]:
    """The lines a run prints once at its start, from what `check` shows, so that a CP, Ulysses or Muon run says so
    before its first step instead of printing what the plain demo prints."""
    layout = sharded.layout
    mesh = " x ".join(f"{name} {size}" for name, size in zip(layout.dim_names, layout.shape, strict=True))
    mesh += f" ({layout.world_size} rank{'s' if layout.world_size > 1 else ''})"
    if layout.ep_size > 1:
        shape, names = layout.expert_shape
        mesh += ", experts " + " x ".join(f"{name} {size}" for name, size in zip(names, shape, strict=True))
    c, k = layout.context_parallel_size, layout.ulysses_size
    sequence = f"data-parallel {layout.data_parallel_size}"
    if layout.sequence_size > 1:
        sequence += f", sequence groups of {layout.sequence_size} (ulysses {k} x context parallel {c})"
    if c > 1:
        chunks = str(context_parallel_layout(layout)["chunks"]).removeprefix("rank r: ")
        holds = f"1/{c * k} of every row: {chunks} (r: its rank in its context-parallel group)"
    elif k > 1:
        holds = f"contiguous slice r of {k} of every row, all tokens for attention over heads/{k} (Ulysses)"
    else:
        holds = "whole rows"
    if layout.tp_size > 1:
        t = layout.tp_size
        holds += f"; tensor parallel {t}: 1/{t} of each split layer (its heads / {t}) and of the vocabulary's logits"
    attention = attention_implementation(sharded.model)
    documents = document_route(sharded.model, model, data, device)[1]
    optimizer = describe_optimizer(sharded.model, training)
    if optimizer["name"] == "muon":
        muon, adamw = optimizer["muon"], optimizer["adamw"]
        split = f"muon ({optimizer['split']}): {len(muon)} matrices Muon, {len(adamw)} tensors AdamW"  # type: ignore[arg-type]
    else:
        split = "adamw: every trainable parameter"
    return [
        f"layout: mesh {mesh}; {sequence}; each rank holds {holds}",
        f"layout: attention {attention}"
        + (f"; packed documents: {documents}" if documents else "")
        + f"; optimizer {split}",
    ]
