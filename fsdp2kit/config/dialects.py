"""Foreign config dialects (ROLL roles, MindSpeed-MM fsdp2_config.yaml, Accelerate) mapped onto the native schema."""

from __future__ import annotations

from typing import Any

from fsdp2kit.config.load import read_yaml
from fsdp2kit.errors import UserError


def to_native(raw: dict[str, Any], source: str, role: str | None = None) -> dict[str, Any]:
    if role is not None:
        raise UserError(f"--role {role}: '{source}' is a native fsdp2kit config, which has no roles")
    return raw


def strategy_config_from_file(path: str) -> dict[str, Any]:
    """A MindSpeed-MM flat fsdp2_config.yaml already uses the native strategy_config keys."""
    return read_yaml(path)
