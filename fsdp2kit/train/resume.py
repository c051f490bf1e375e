"""What an exact resume depends on: the checkpoint's run and this one must agree on the data, the model and the seed,
or the continued loss curve silently belongs to another run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

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
    if not allow_changes:
        raise UserError(
            f"training.resume: {what}; the run would not continue the same loss curve. Set "
            "training.resume_allow_changes: true to resume anyway, or training.resume: never to start afresh"
        )
    if dist.get_rank() == 0:
        print(f"warning: training.resume: {what} (allowed by training.resume_allow_changes)", flush=True)
