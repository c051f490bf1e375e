"""YAML in: a config file as a dict, and `--set key.path=value` overrides applied to it. Shared by the native loader
and every dialect, and imports neither."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fsdp2kit.errors import UserError, why_not_a_file

# Bounds on what a YAML text may expand to: real configs have hundreds of nodes a few levels deep; a 539-byte alias
# bomb ("billion laughs") expands to billions, which any later walk over the dict would take hours over.
MAX_NODES = 1_000_000
MAX_DEPTH = 100


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key written twice in one mapping (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` merges; keys written beside it override the merged ones, as YAML says
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise _DuplicateKey(f"key '{key}' is written twice (lines {seen[key]} and {line}); keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


class _DuplicateKey(Exception):
    pass


def _expanded_size(root: yaml.Node) -> int:
    """How many nodes the document expands to, aliases counted at every use, without expanding it; raises
    ValueError for a node that contains itself or nesting deeper than MAX_DEPTH."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int, open_nodes: set[int]) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise ValueError("an anchor refers to itself (a recursive alias)")
        if depth > MAX_DEPTH:
            raise ValueError(f"it is nested more than {MAX_DEPTH} levels deep")
        open_nodes.add(id(node))
        children: list[yaml.Node] = []
        if isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        elif isinstance(node, yaml.SequenceNode):
            children = list(node.value)
        total = 1 + sum(size(child, depth + 1, open_nodes) for child in children)
        open_nodes.discard(id(node))
        sizes[id(node)] = min(total, MAX_NODES + 1)
        return sizes[id(node)]

    return size(root, 0, set())


def load_yaml_text(text: str, where: str) -> Any:
    """A YAML document as Python data, bounded: a duplicate key, a recursive anchor, nesting past MAX_DEPTH or an
    expansion past MAX_NODES is one UserError naming `where` (a file, or a --set value)."""
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if _expanded_size(node) > MAX_NODES:
            raise UserError(f"{where}: its aliases expand to more than {MAX_NODES:,} values (an alias bomb?)")
        return loader.construct_document(node)
    except (ValueError, RecursionError) as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"it is nested more than {MAX_DEPTH} levels deep"
        raise UserError(f"{where}: cannot be read: {reason}") from None
    except _DuplicateKey as exc:
        raise UserError(f"{where}: {exc}") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file '{path}' {why_not_a_file(path)}")
    try:
        data = load_yaml_text(path.read_text(encoding="utf-8"), f"config file '{path}'")
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
            value = load_yaml_text(text, f"--set '{item}'")
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
