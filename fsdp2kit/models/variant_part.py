"""The hooks a facet of a model (LoRA, experts sharded one by one, the vision tower) has at each stage of the build,
each a no-op unless the facet changes it. `models/variant.py` picks the parts; each lives beside its feature."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.nn as nn
from torch.distributed import ProcessGroup

from fsdp2kit.config.schema import TrainingConfig
from fsdp2kit.models.shards import SyncedWeights
from fsdp2kit.parallel.plan import AdapterPlan, ShardingPlan


@dataclass(frozen=True)
class TensorLeeway:
    """What loading a folder saved with another head over the same backbone may skip (a critic started from its
    actor's causal LM, as verl and ROLL start one): the model's tensors under a `fresh` prefix may be missing from the
    folder (initialised fresh), the folder's tensors under an `unused` prefix may be left unread. Anything else
    missing or extra is still refused: it would be another model."""

    fresh: tuple[str, ...] = ()
    unused: tuple[str, ...] = ()


class VariantPart:
    fresh_tensors: tuple[str, ...] = ()  # prefixes of its own tensors a folder may lack (a new head), TensorLeeway
    unused_tensors: tuple[str, ...] = ()  # prefixes of a folder's tensors it may leave unread (the head it replaces)
    keeps_base_dtype = False  # a frozen base trains in model.dtype, not fp32 master weights
    replaces_hf_export = False  # its own export replaces the HF folder (LoRA: the adapter folder)
    adapters: AdapterPlan | None = None  # LoRA's adapters, for check and the memory tables

    def patch_meta(self, model: nn.Module, sp_group: ProcessGroup | None) -> None:
        """Change the meta-device model before the plan is made."""

    def after_plan(self, model: nn.Module, plan: ShardingPlan) -> None:
        """Read or extend the plan before the patches and fully_shard."""

    def patch_sharded(self, model: nn.Module, plan: ShardingPlan) -> None:
        """Change how modules run, after recompute and before fully_shard."""

    def split_modules(self, model: nn.Module, modules: dict[str, str]) -> dict[str, str]:
        """The tensor-parallel styles {module path: style} of what the family's plan splits, as this part changes
        the modules at those paths (LoRA wraps a linear: its base and adapters split in its place)."""
        return modules

    def materialise(self, model: nn.Module, seed: int) -> None:
        """Initialise or load this part's own weights once the base's are in place."""

    def checkpoint_config(self, model: nn.Module, name_or_path: str) -> Any:
        """A config each checkpoint carries instead of the HF config (and then only trainable tensors), or None."""
        return None

    def export(self, model: nn.Module, output_dir: Path, name_or_path: str, tc: TrainingConfig, is_main: bool) -> None:
        """Its own end-of-run export."""

    def describe(self) -> dict[str, Any]:
        """This part's lines in `check --json`."""
        return {}

    def synced_weights(self, model: nn.Module, name_or_path: str) -> SyncedWeights | None:
        """A part of the weights of its own that a rollout engine can load alone (LoRA: the adapters), or None."""
        return None
