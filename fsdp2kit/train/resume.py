"""What an exact resume depends on: the checkpoint's run and this one must agree on the data, the model and the seed,
or the continued loss curve silently belongs to another run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler

from fsdp2kit.config.schema import DataConfig, TrainingConfig
from fsdp2kit.data.dataset import source_files
from fsdp2kit.data.registry import registry_path
from fsdp2kit.errors import UserError

_MISSING = object()
# Besides every key of the data section (samples, their order and their length).
EXACTNESS_KEYS = ("model.name_or_path", "model.config", "model.model_class", "model.dtype", "training.seed")


def _at(config: dict, key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _MISSING
        node = node[part]
    return node


def changed_setting(saved: dict, current: dict) -> tuple[str, Any, Any] | None:
    """The first setting exactness depends on whose value differs; keys the checkpoint's config lacks (written by
    an older version) are not compared."""
    data_keys = [f"data.{key}" for key in saved.get("data", {})]
    for key in (*data_keys, *EXACTNESS_KEYS):
        old, new = _at(saved, key), _at(current, key)
        if old is not _MISSING and old != new:
            return key, old, None if new is _MISSING else new
    return None


def check_unchanged(checkpoint: Path, saved: dict, current: dict, allow_changes: bool) -> None:
    """Refuse a resume that changes what exactness depends on, unless `training.resume_allow_changes`: then one
    warning line."""
    change = changed_setting(saved, current)
    if change is None:
        return
    key, old, new = change
    what = f"'{checkpoint}' was trained with {key} = {old!r}, this run has {new!r}"
    _refuse_or_warn(what, "the run would not continue the same loss curve. Set", allow_changes)


def _refuse_or_warn(what: str, consequence: str, allow_changes: bool) -> None:
    """A change at resume: one error line, or with training.resume_allow_changes one warning line."""
    if not allow_changes:
        raise UserError(
            f"training.resume: {what}; {consequence} training.resume_allow_changes: true to resume anyway, or "
            "training.resume: never to start afresh"
        )
    if dist.get_rank() == 0:
        print(f"warning: training.resume: {what} (allowed by training.resume_allow_changes)", flush=True)


# What a run's optimizer takes from its config: AdamW's and Muon's param-group settings, and the schedule's peak.
OPTIMIZER_SETTINGS = (
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "nesterov",
    "ns_steps",
    "adjust_lr_fn",
    "matched_adamw_rms",
)
OPTIMIZER_KEYS = (
    "learning_rate",
    "weight_decay",
    "adam_beta1",
    "adam_beta2",
    "adam_epsilon",
    "muon_momentum",
    "muon_nesterov",
    "muon_ns_steps",
    "muon_lr_adjustment",
    "muon_matched_adamw_rms",
)


def optimizer_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings as this run's config made them, read before a checkpoint's state replaces them
    (torch's load_state_dict restores the saved run's learning rate, betas, eps and weight decay with the moments)."""
    return [
        {
            **{key: group[key] for key in OPTIMIZER_SETTINGS if key in group},
            "initial_lr": group.get("initial_lr", group["lr"]),
        }
        for group in optimizer.param_groups
    ]


def check_same_optimizer(checkpoint: Path, saved: dict, training: TrainingConfig) -> None:
    """A checkpoint's optimizer state continues only under the optimizer that wrote it (AdamW's two moments are not
    Muon's momentum), and Muon's only under the same split (which tensors have a momentum buffer): another is one
    line, before anything is read."""
    old = _at(saved, "training.optimizer")
    old = "adamw" if old is _MISSING else old  # written before Muon: AdamW
    if old != training.optimizer:
        raise UserError(
            f"training.resume: '{checkpoint}' holds the state of training.optimizer {old}, this run has "
            f"{training.optimizer}; set training.optimizer: {old} to continue it, or training.resume: never to start "
            "afresh"
        )
    split = _at(saved, "training.muon_split")
    split = "hidden_matrices" if split is _MISSING else split  # written before the choice: fsdp2kit's split
    if training.optimizer == "muon" and split != training.muon_split:
        raise UserError(
            f"training.resume: '{checkpoint}' holds Muon's state for training.muon_split {split}, this run has "
            f"{training.muon_split}; set training.muon_split: {split} to continue it, or training.resume: never"
        )


def apply_settings(optimizer: torch.optim.Optimizer, scheduler: LRScheduler, settings: list[dict[str, Any]]) -> None:
    """This run's optimizer settings over the loaded state (the moments and step counts stay), the schedule's peak
    this run's learning rate, continued where the loaded schedule was."""
    for group, mine in zip(optimizer.param_groups, settings, strict=True):
        group.update(mine)
    scheduler.base_lrs = [mine["initial_lr"] for mine in settings]
    for group, lr in zip(optimizer.param_groups, scheduler.get_lr(), strict=True):
        group["lr"] = lr
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports


def changed_optimizer_keys(saved: dict, current: dict) -> list[str]:
    """`key old -> new` for each optimizer setting the checkpoint's run had otherwise (its config.json)."""
    changes = []
    for key in OPTIMIZER_KEYS:
        old, new = _at(saved, f"training.{key}"), _at(current, f"training.{key}")
        if old is not _MISSING and old != new:
            changes.append(f"training.{key} {old} -> {new}")
    return changes


def check_trainer_state(state: dict, path: Path) -> None:
    """The values a resume uses from trainer_state.json, checked: a crafted or damaged file is one sentence, never a
    run at a learning rate nobody chose."""
    where = f"training.resume: '{path / 'trainer_state.json'}'"
    step = state["step"]
    scheduler = state.get("scheduler")
    scheduler = scheduler if isinstance(scheduler, dict) else {}
    position = scheduler.get("last_epoch")
    if not (isinstance(position, int) and 0 <= position <= step and isinstance(scheduler.get("base_lrs"), list)):
        raise UserError(f"{where} is damaged: its scheduler state is not a schedule at step {step} or before")
    scaler = state.get("loss_scaler", {"scale": 1.0, "clean_steps": 0})
    scale, clean = (scaler.get("scale"), scaler.get("clean_steps")) if isinstance(scaler, dict) else (None, None)
    if not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0 and isinstance(clean, int)):
        raise UserError(f"{where} is damaged: its loss_scaler must hold a finite scale > 0 and a step count")


def data_files(data: DataConfig) -> list[list[Any]]:
    """The data source's files as a checkpoint records them: path, size and modification time (cheap to compare);
    with data.dataset_dir, its dataset_info.json too (it says how the files are read)."""
    files = source_files(data.source, data.dataset_dir)
    if data.dataset_dir is not None:
        files.append(registry_path(data.dataset_dir))
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def check_data_unchanged(checkpoint: Path, saved: dict, data: DataConfig, allow_changes: bool) -> None:
    """An edited data file changes the samples and their order: the resumed run would not continue the same curve.
    Refused unless training.resume_allow_changes (then one warning line); checkpoints older than this record pass."""
    recorded = saved.get("data_files")
    if recorded is None:
        return
    now = {path: (size, mtime) for path, size, mtime in data_files(data)}
    before = {path: (size, mtime) for path, size, mtime in recorded}
    changed = sorted(set(now) ^ set(before)) or sorted(p for p in now if now[p] != before[p])
    if not changed:
        return
    what = f"data file '{changed[0]}' is not the one '{checkpoint}' was trained on (added, removed or modified since)"
    _refuse_or_warn(what, "the samples and their order would change. Restore it, set", allow_changes)
