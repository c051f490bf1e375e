"""What kind of model a run has — text or vision-language, full or LoRA, dense or mixture-of-experts — decided
once, here (`pick_variant`), and the one object that does everything that differs between them. The generic code
(the sharded-model builder, the Strategy, the commands, the checkpoints) asks a `ModelVariant`; it never branches
on the kind of model itself.

A variant is a modality (how batches are made and cut for sequence parallel) and the parts that apply (LoRA,
experts, the vision tower); every part hook is a no-op unless a part changes it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.config.schema import DataConfig, LoraConfig, ModelConfig, StrategyConfig, TrainingConfig
from fsdp2kit.data.samples import GlobalBatches, TrainingSamples
from fsdp2kit.data.scoring import ConversationScoring, DocumentScoring, ScoringSource
from fsdp2kit.data.vl import VLEncoder, VLGlobalBatches, load_conversations
from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.models.build import ModelSource
from fsdp2kit.models.lora import (
    add_input_grad_hooks,
    export_adapter,
    file_config,
    has_adapters,
    initialise_adapters,
    inject_lora,
    load_adapter,
    plan_adapters,
)
from fsdp2kit.models.vl import is_vision_language
from fsdp2kit.parallel.moe import apply_expert_patch, split_experts
from fsdp2kit.parallel.plan import AdapterPlan, ShardingPlan
from fsdp2kit.parallel.ulysses import shard_sequence
from fsdp2kit.parallel.vision import apply_vision_patch, apply_vision_ulysses, shard_vision_batch

Batch = dict[str, torch.Tensor]


class VariantPart:
    """One facet of a model (LoRA, experts, the vision tower): hooks at each stage of the build, no-ops here."""

    keeps_base_dtype = False  # a frozen base trains in model.dtype, not fp32 master weights

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        """Change the meta-device model before the plan is made."""

    def after_plan(self, model: nn.Module, plan: ShardingPlan) -> None:
        """Read or extend the plan before the patches and fully_shard."""

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        """Change how modules run, after recompute and before fully_shard."""

    def materialise(self, model: nn.Module, seed: int) -> None:
        """Initialise or load this part's own weights once the base's are in place."""

    def describe(self) -> dict[str, Any]:
        """This part's lines in `check --json`."""
        return {}


@dataclass
class LoraPart(VariantPart):
    cfg: LoraConfig
    adapters: AdapterPlan | None = None
    keeps_base_dtype = True

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        inject_lora(model, self.cfg, torch_dtype(self.cfg.dtype))

    def after_plan(self, model: nn.Module, plan: ShardingPlan) -> None:
        self.adapters = plan_adapters(model, plan, self.cfg)
        add_input_grad_hooks(model, self.adapters.input_grad_hooks)

    def materialise(self, model: nn.Module, seed: int) -> None:
        if has_adapters(model):
            initialise_adapters(model, seed)
        if self.cfg.adapter:
            load_adapter(model, Path(self.cfg.adapter))

    def describe(self) -> dict[str, Any]:
        import dataclasses

        return {"lora": dataclasses.asdict(self.adapters) if self.adapters else None}


@dataclass
class ExpertsPart(VariantPart):
    moe_experts: list[str]

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        split_experts(model, self.moe_experts)  # where moe_experts names a per-expert class

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        if plan.expert_patch:
            apply_expert_patch(model)


@dataclass
class VisionPart(VariantPart):
    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        if sp_group is not None:
            apply_vision_ulysses(model, sp_group)

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        apply_vision_patch(model)


@dataclass
class ModelVariant:
    """The model's kind, and everything that differs with it."""

    vision: bool
    parts: list[VariantPart] = field(default_factory=list)

    @property
    def attention_config(self) -> str | None:
        """The sub-config whose attention runs over the token sequence (Ulysses): a VL model's language model."""
        return "text_config" if self.vision else None

    @property
    def name(self) -> str:
        kinds = ["vision-language" if self.vision else "text"] + [type(p).__name__[:-4].lower() for p in self.parts]
        return "+".join(kinds)

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

    def materialise(self, model: nn.Module, seed: int) -> None:
        for part in self.parts:
            part.materialise(model, seed)

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"variant": self.name, "vision_patch": self.vision, "lora": None}
        for part in self.parts:
            described.update(part.describe())
        return described

    @property
    def lora(self) -> LoraPart | None:
        return next((p for p in self.parts if isinstance(p, LoraPart)), None)

    # ---- batches ----------------------------------------------------------------------------------------------

    def shard_batch(self, batch: Batch, group: ProcessGroup) -> Batch:
        """This rank's part of a micro-batch under sequence parallel: a VL model reads the whole sequence (the tower
        and the mrope positions need it) and slices after the merge; a text model reads its slice of the tokens."""
        return shard_vision_batch(batch, group) if self.vision else shard_sequence(batch, group)

    def global_batches(
        self, data: DataConfig, tokenizer: Any, source: ModelSource, order: tuple[Any, ...]
    ) -> GlobalBatches:
        """The run's batches, the same at any world size: documents from the token store (built once, memory-mapped),
        or a VL model's conversations, encoded (images read) as their micro-batches are built."""
        if self.vision:
            encoder = VLEncoder.load(source.tokenizer_path, source.hf_config, data.seq_len)
            return VLGlobalBatches(load_conversations(data), *order, encoder=encoder)
        return GlobalBatches(TrainingSamples.from_config(data, tokenizer), *order)

    def scoring_source(self, data: DataConfig, tokenizer: Any, source: ModelSource, pad_id: int) -> ScoringSource:
        """What `infer` scores: documents from the token store, or a VL model's conversations."""
        if self.vision:
            encoder = VLEncoder.load(source.tokenizer_path, source.hf_config, data.seq_len)
            return ConversationScoring.open(data, encoder, pad_id)
        return DocumentScoring.open(data, tokenizer, pad_id)

    # ---- checkpoints and exports ------------------------------------------------------------------------------

    def checkpoint_config(self, model: nn.Module, name_or_path: str) -> Any:
        """What a checkpoint holds besides its tensors: a LoRA run saves only what trains, with its peft config;
        None: the whole model, with its HF config."""
        return file_config(model, name_or_path) if self.lora is not None else None

    def export_adapter(
        self, model: nn.Module, output_dir: Path, name_or_path: str, tc: TrainingConfig, is_main: bool
    ) -> None:
        """A LoRA run's end-of-run export: the PEFT adapter folder output_dir/adapter (with export_hf)."""
        if self.lora is not None and tc.export_hf:
            export_adapter(model, output_dir / "adapter", name_or_path, is_main)

    def exports_hf(self, tc: TrainingConfig) -> bool:
        """Whether the run ends with an HF folder: export_hf of a full model, or export_merged (LoRA merged in)."""
        return (tc.export_hf and self.lora is None) or tc.export_merged


def pick_variant(hf_config: Any, model_cfg: ModelConfig, strategy: StrategyConfig) -> ModelVariant:
    """The one place that decides what a model is: vision-language by its config (`is_vision_language`), LoRA by
    model.lora, experts sharded one by one by wrap_policy.moe_experts (fused experts need nothing of their own)."""
    parts: list[VariantPart] = []  # in the order their patches apply
    if strategy.wrap_policy.moe_experts:
        parts.append(ExpertsPart(strategy.wrap_policy.moe_experts))
    vision = is_vision_language(hf_config)
    if vision:
        parts.append(VisionPart())
    if model_cfg.lora_enabled and model_cfg.lora is not None:  # adapters go onto the split experts too
        parts.append(LoraPart(model_cfg.lora))
    return ModelVariant(vision, parts)
