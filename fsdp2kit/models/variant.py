"""What kind of model a run has — text or vision-language, full or LoRA, dense or with experts sharded one by one —
decided once, here (`pick_variant`), and the one object that does everything that differs between them. The generic
code (the sharded-model builder, the Strategy, the commands, the checkpoints) asks a `ModelVariant`; it never
branches on the kind of model itself.

A variant is a modality (how batches are made, cut for sequence parallel and scored) and the parts that apply
(`VariantPart`s: LoRA in models/lora.py, experts and the vision tower here); every part hook is a no-op unless the
part changes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.config.schema import DataConfig, ModelConfig, StrategyConfig, TrainingConfig
from fsdp2kit.data.mixture import hold_out, split_samples
from fsdp2kit.data.samples import GlobalBatches
from fsdp2kit.data.scoring import ConversationScoring, DocumentScoring, ScoringSource
from fsdp2kit.data.vl import VLEncoder, VLGlobalBatches, load_conversations, load_eval_conversations
from fsdp2kit.models.build import ModelSource
from fsdp2kit.models.heads import LanguageModelHead, OutputHead, ValueHead, pick_head
from fsdp2kit.models.lora import LoraPart
from fsdp2kit.models.shards import SyncedWeights
from fsdp2kit.models.variant_part import TensorLeeway, VariantPart
from fsdp2kit.models.vl import is_vision_language
from fsdp2kit.parallel.moe import apply_expert_patch, split_experts
from fsdp2kit.parallel.plan import AdapterPlan, ShardingPlan
from fsdp2kit.parallel.sequence_layout import shard_sequence
from fsdp2kit.parallel.vision import apply_vision_patch, apply_vision_ulysses, shard_vision_batch

Batch = dict[str, torch.Tensor]


class TextModality:
    """Token sequences: documents from the token store, each rank's slice of the tokens under sequence parallel."""

    name = "text"
    attention_config: str | None = None  # Ulysses switches the whole model's attention
    data_phase = "the token store of"  # how the log announces reading the data

    def shard_batch(self, batch: Batch, group: ProcessGroup, block_mask: bool) -> Batch:
        return shard_sequence(batch, group, block_mask)

    def global_batches(
        self, data: DataConfig, tokenizer: Any, source: ModelSource, order: tuple[Any, ...]
    ) -> GlobalBatches:
        seed = order[4]  # GlobalBatches' fields, in order: ..., seed, shuffle, ...
        samples, eval_samples = split_samples(data, tokenizer, seed)  # tokenized once, memory-mapped
        batches = GlobalBatches(samples, *order)
        batches.eval_samples = eval_samples
        return batches

    def read_without_store(self, data: DataConfig) -> str | None:
        """For `prepare`: None, as a text run's data is tokenized into the token store, which `prepare` builds."""
        return None

    def scoring_source(self, data: DataConfig, tokenizer: Any, source: ModelSource, pad_id: int) -> ScoringSource:
        return DocumentScoring.open(data, tokenizer, pad_id)


class VisionModality(TextModality):
    """Image and text conversations, encoded (images read) as their micro-batches are built; under sequence parallel
    the whole sequence enters (the tower and the mrope positions need it) and the language model slices it."""

    name = "vision-language"
    attention_config = "text_config"  # the tower runs unsplit: only the language model's attention is switched
    data_phase = "the conversations of"

    def shard_batch(self, batch: Batch, group: ProcessGroup, block_mask: bool) -> Batch:
        return shard_vision_batch(batch, group)  # its left-padding mask is made at the language model's entry

    def global_batches(
        self, data: DataConfig, tokenizer: Any, source: ModelSource, order: tuple[Any, ...]
    ) -> GlobalBatches:
        encoder = VLEncoder.load(source.tokenizer_path, source.hf_config, data.seq_len, data)
        conversations: Any = load_conversations(data)  # a mixture: refused there, in one line
        eval_conversations: Any = None
        if data.eval_fraction is not None:
            conversations, eval_conversations = hold_out(conversations, data.eval_fraction, order[4])
        elif data.eval_source is not None:
            eval_conversations = load_eval_conversations(data)
        batches = VLGlobalBatches(conversations, *order, encoder=encoder)
        batches.eval_samples = eval_conversations
        return batches

    def read_without_store(self, data: DataConfig) -> str | None:
        """For `prepare`: conversations with images go into no token store (each is encoded as it is batched), so
        every record and every image it names is read and checked now, not first when its sample is drawn."""
        conversations = load_conversations(data)
        held_apart = len(load_eval_conversations(data)) if data.eval_source is not None else 0
        images = sum(len(conversation.images) for conversation in conversations)
        return (
            f"vision-language data: {len(conversations)} conversations naming {images} images, each checked"
            + (f", and {held_apart} evaluation conversations" if held_apart else "")
            + "; no token store (these samples are encoded as they are batched)"
        )

    def scoring_source(self, data: DataConfig, tokenizer: Any, source: ModelSource, pad_id: int) -> ScoringSource:
        encoder = VLEncoder.load(source.tokenizer_path, source.hf_config, data.seq_len, data)
        return ConversationScoring.open(data, encoder, pad_id)


@dataclass
class ExpertsPart(VariantPart):
    """wrap_policy.moe_experts: fused experts split into one module per expert; with apply_expert_patch every rank
    runs every expert, so that their all-gathers pair up (parallel/moe.py)."""

    moe_experts: list[str]

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        split_experts(model, self.moe_experts)  # where moe_experts names a per-expert class

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        if plan.expert_patch:
            apply_expert_patch(model)


class VisionPart(VariantPart):
    """The tower runs on every forward (on a dummy image when a micro-batch has none), so that every rank joins its
    shard groups' collectives; under Ulysses it runs after the merge (parallel/vision.py)."""

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        if sp_group is not None:
            apply_vision_ulysses(model, sp_group)

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        apply_vision_patch(model)

    def describe(self) -> dict[str, Any]:
        return {"vision_patch": True}


@dataclass
class ModelVariant:
    """The model's kind, and everything that differs with it."""

    modality: TextModality
    parts: list[VariantPart] = field(default_factory=list)
    head: OutputHead = field(default_factory=LanguageModelHead)  # what its forward gives the API (models/heads.py)
    # Set by the build where the model attends with FlexAttention (parallel/document_attention.py): under Ulysses
    # its batches then carry their documents as a BlockMask, not a dense [T, T] mask.
    flex_documents: bool = False

    @property
    def name(self) -> str:
        return "+".join([self.modality.name] + [type(p).__name__.removesuffix("Part").lower() for p in self.parts])

    @property
    def attention_config(self) -> str | None:
        """The sub-config whose attention runs over the token sequence (Ulysses); None: the whole model's."""
        return self.modality.attention_config

    @property
    def adapter_plan(self) -> AdapterPlan | None:
        return next(filter(None, (p.adapters for p in self.parts)), None)

    @property
    def tensor_leeway(self) -> TensorLeeway:
        """The tensors its parts let a folder lack or hold unused (a value head over a causal LM's folder)."""
        return TensorLeeway(
            tuple(prefix for p in self.parts for prefix in p.fresh_tensors),
            tuple(prefix for p in self.parts for prefix in p.unused_tensors),
        )

    def master_dtype(self, training: bool, model_dtype: str) -> str:
        """fp32 master weights when the whole model trains; a frozen base (LoRA) stays in model.dtype."""
        return "fp32" if training and not any(p.keeps_base_dtype for p in self.parts) else model_dtype

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        for part in self.parts:
            part.patch_meta(model, sp_group)

    def after_plan(self, model: nn.Module, plan: ShardingPlan) -> None:
        for part in self.parts:
            part.after_plan(model, plan)

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        for part in self.parts:
            part.patch_sharded(model, plan)

    def split_modules(self, model: nn.Module, modules: dict[str, str]) -> dict[str, str]:
        for part in self.parts:
            modules = part.split_modules(model, modules)
        return modules

    def materialise(self, model: nn.Module, seed: int) -> None:
        for part in self.parts:
            part.materialise(model, seed)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"variant": self.name, "vision_patch": False, "lora": None}
        for part in self.parts:
            described.update(part.describe())
        return described

    # ---- batches ----------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Batch, group: ProcessGroup) -> Batch:
        """This rank's part of a micro-batch under sequence parallel."""
        return self.modality.shard_batch(batch, group, self.flex_documents)

    def global_batches(
        self, data: DataConfig, tokenizer: Any, source: ModelSource, order: tuple[Any, ...]
    ) -> GlobalBatches:
        """The run's batches, the same at any world size."""
        return self.modality.global_batches(data, tokenizer, source, order)

    def scoring_source(self, data: DataConfig, tokenizer: Any, source: ModelSource, pad_id: int) -> ScoringSource:
        """What `infer` scores, sample by sample."""
        return self.modality.scoring_source(data, tokenizer, source, pad_id)

    # ---- checkpoints and exports ------------------------------------------------------------------------------

    def checkpoint_config(self, model: nn.Module, name_or_path: str) -> Any:
        """What a checkpoint holds besides its tensors: a LoRA run saves only what trains, with its peft config;
        None: the whole model, with its HF config."""
        configs = (part.checkpoint_config(model, name_or_path) for part in self.parts)
        return next((config for config in configs if config is not None), None)

    def export_parts(
        self, model: nn.Module, output_dir: Path, name_or_path: str, tc: TrainingConfig, is_main: bool
    ) -> None:
        """The parts' own end-of-run exports (LoRA: the PEFT adapter folder, with export_hf)."""
        for part in self.parts:
            part.export(model, output_dir, name_or_path, tc, is_main)

    def synced_weights(self, model: nn.Module, name_or_path: str) -> list[SyncedWeights]:
        """The parts of the weights of its own a rollout engine can load alone (beside the whole model)."""
        offered = (part.synced_weights(model, name_or_path) for part in self.parts)
        return [weights for weights in offered if weights is not None]

    def exports_hf(self, tc: TrainingConfig) -> bool:
        """Whether the run ends with an HF folder: export_hf of a full model, or export_merged (LoRA merged in)."""
        return (tc.export_hf and not any(p.replaces_hf_export for p in self.parts)) or tc.export_merged


def pick_variant(hf_config: Any, model_cfg: ModelConfig, strategy: StrategyConfig) -> ModelVariant:
    """The one place that decides what a model is: vision-language by its config (`is_vision_language`), LoRA by
    model.lora, experts sharded one by one by wrap_policy.moe_experts (fused experts need nothing of their own), a
    value or reward model by model.model_class (`pick_head`)."""
    parts: list[VariantPart] = []  # in the order their patches apply
    if strategy.wrap_policy.moe_experts:
        parts.append(ExpertsPart(strategy.wrap_policy.moe_experts))
    vision = is_vision_language(hf_config)
    if vision:
        parts.append(VisionPart())
    if model_cfg.lora_enabled and model_cfg.lora is not None:  # adapters go onto the split experts too
        parts.append(LoraPart(model_cfg.lora))
    head = pick_head(model_cfg, hf_config)
    if isinstance(head, ValueHead):  # its build hooks (its dropout)
        parts.append(head)
    return ModelVariant(VisionModality() if vision else TextModality(), parts, head)
