"""YAML in: a config file as a dict, and `--set key.path=value` overrides applied to it. Shared by the native loader
and every dialect, and imports neither."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fsdp2kit.errors import UserError


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file '{path}' does not exist")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(
            f"config file '{path}' is not a YAML text file: byte {exc.start} is not UTF-8 "
            f"({exc.object[exc.start]:#04x})"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"config file '{path}' is not valid YAML{where}: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UserError(f"config file '{path}' must hold a mapping of keys, not a {type(data).__name__}")
    return data


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """`key.path=value`, the value parsed as YAML (so `[a,b]` is a list and `1e-3` a number)."""
    for item in overrides:
        if "=" not in item:
            raise UserError(f"--set '{item}' must look like key.path=value")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise UserError(f"--set '{item}': '{key}' is not a dotted key path")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise UserError(
                f"--set '{item}': the value is not valid YAML; quote strings holding {{ }} [ ] "
                'inside it, e.g. key=["model.layers.{*}"]'
            ) from None
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise UserError(f"--set '{item}': '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return raw
