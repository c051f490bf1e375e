"""docs/ARCHITECTURE.md's rules, checked on the source: every import of an fsdp2kit module by another (imports inside
functions included, read with ast, nothing executed) goes down the layers of the document's table or stays in its
own unit, and the import graph has no cycle."""

from __future__ import annotations

import ast
import re

from conftest import REPO

PACKAGE = REPO / "fsdp2kit"


def module_name(path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(path): ast.parse(path.read_text(), str(path)) for path in sorted(PACKAGE.rglob("*.py"))}


def import_graph(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the fsdp2kit modules it imports anywhere in its body. `from package import name` is an import of
    the submodule where `name` is one, else of the package."""
    graph: dict[str, set[str]] = {}
    for name, tree in trees.items():
        is_package = (PACKAGE / name.removeprefix("fsdp2kit").replace(".", "/") / "__init__.py").is_file()
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: resolve against this module's package
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    imported.add(submodule if submodule in trees else source)
        graph[name] = {target for target in imported if target in trees and target != name}
    return graph


def layer_table() -> list[tuple[int, str]]:
    """(layer, unit) rows of the table in docs/ARCHITECTURE.md."""
    rows = []
    for line in (REPO / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        match = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if match:
            rows += [(int(match[1]), unit) for unit in re.findall(r"`([\w.]+)`", match[2])]
    return rows


def unit_of(module: str, table: list[tuple[int, str]]) -> tuple[int, str] | None:
    """The most specific row naming the module or a package holding it (the root package names only itself)."""
    matches = [
        (layer, unit)
        for layer, unit in table
        if module == unit or (unit != "fsdp2kit" and module.startswith(unit + "."))
    ]
    return max(matches, key=lambda row: len(row[1]), default=None)


def upward_imports(graph: dict[str, set[str]], table: list[tuple[int, str]]) -> list[str]:
    wrong = []
    for source, targets in sorted(graph.items()):
        source_layer, source_unit = unit_of(source, table) or (None, None)
        for target in sorted(targets):
            target_layer, target_unit = unit_of(target, table) or (None, None)
            if source_layer is None or target_layer is None:
                continue  # reported by test_every_module_has_a_layer
            if target_unit != source_unit and target_layer >= source_layer:
                wrong.append(f"{source} (layer {source_layer}) imports {target} (layer {target_layer})")
    return wrong


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for target in sorted(graph.get(node, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [node, target] if target in path else path + [node, target]
            if target not in state and (cycle := visit(target, path + [node])):
                return cycle
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [])):
            return cycle
    return None


def test_the_graph_sees_function_local_imports():
    """The lazy imports of the command line are edges too: the test reads them, not only the top-level ones."""
    graph = import_graph(modules())
    assert {"fsdp2kit.trainer", "fsdp2kit.infer.logprobs", "fsdp2kit.check"} <= graph["fsdp2kit.cli"]
    assert "fsdp2kit.config.dialects" in graph["fsdp2kit.config.load"]  # `from fsdp2kit.config import dialects`


def test_every_module_has_a_layer():
    table = layer_table()
    assert len({layer for layer, _ in table}) >= 10
    assert [name for name in modules() if unit_of(name, table) is None] == []


def test_no_module_imports_a_higher_layer():
    assert upward_imports(import_graph(modules()), layer_table()) == []


def test_the_import_graph_has_no_cycle():
    assert find_cycle(import_graph(modules())) is None


def test_the_checks_catch_what_they_look_for():
    """An upward import and a cycle, planted in a copy of the real graph, are both found."""
    table = layer_table()
    graph = import_graph(modules())
    graph["fsdp2kit.parallel.plan"] = graph["fsdp2kit.parallel.plan"] | {"fsdp2kit.train.step"}
    assert upward_imports(graph, table) == ["fsdp2kit.parallel.plan (layer 3) imports fsdp2kit.train.step (layer 6)"]
    graph["fsdp2kit.errors"] = {"fsdp2kit.cli"}  # the command line imports the errors module
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1] and {"fsdp2kit.errors", "fsdp2kit.cli"} <= set(cycle)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


# Words that name a model variant (LoRA, vision-language, mixture of experts) in a condition.
VARIANT_WORDS = re.compile(r"lora|adapter|peft|vision|visual|\bvl\b|_vl\b|image|pixel|moe|expert|router", re.I)
# Modules whose names name a feature own it; the config layer reads (and the dialects translate) its keys.
FEATURE_MODULE = re.compile(r"lora|vl|vision|moe|expert_parallel|variant|\.config\b")


def variant_conditions(trees: dict[str, ast.Module]) -> list[str]:
    """Conditions (if, while, ternary, comprehension filters) in generic modules that mention a model variant."""
    found = []
    for name, tree in trees.items():
        if FEATURE_MODULE.search(name.removeprefix("fsdp2kit")):
            continue
        for node in ast.walk(tree):
            tests = [node.test] if isinstance(node, ast.If | ast.IfExp | ast.While) else []
            tests += node.ifs if isinstance(node, ast.comprehension) else []
            found += [f"{name}:{t.lineno}: {ast.unparse(t)}" for t in tests if VARIANT_WORDS.search(ast.unparse(t))]
    return found


def test_generic_code_does_not_branch_on_the_model_variant():
    """VL, LoRA and MoE live behind `models/variant.py:pick_variant`: generic modules ask the variant object."""
    assert variant_conditions(modules()) == []
    picker = [c for c in variant_conditions({"x": ast.parse((PACKAGE / "models" / "variant.py").read_text())})]
    assert len(picker) <= 8


def test_the_variant_check_sees_a_branch():
    planted = ast.parse("def f(plan):\n    if plan.adapters:\n        return 1\n")
    assert variant_conditions({"fsdp2kit.train.step": planted}) == ["fsdp2kit.train.step:2: plan.adapters"]


def test_no_function_is_longer_than_60_lines():
    """Complexity is held by ruff (C901, max 10, in make lint); length here."""
    long = [
        f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for name, tree in modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert long == []
