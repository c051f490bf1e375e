"""The layout of a family's HF folders, through transformers' own conversions.

transformers 5 holds some families differently from how their published checkpoints store them: MoE experts fused
in memory (`mlp.experts.gate_up_proj`) but stored one by one (`experts.<i>.gate_proj.weight`, Mixtral's
`block_sparse_moe.experts.<i>.w1.weight`), vision-language models under other prefixes. `from_pretrained` applies
the family's `WeightRenaming`s and `WeightConverter`s (transformers' `conversion_mapping`) and `save_pretrained`
reverses them. We take the same list and run transformers' own renaming and conversion code on it, so our sliced
loading reads those folders and our exports hold what `save_pretrained` writes: no table of ours.

Loading stays streamed: a tensor fused from per-expert tensors (a chain starting with `MergeModulelist(dim=0)`)
reads only the experts of the rows asked for, so each rank reads its own experts' files."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from fsdp2kit.errors import UserError
from fsdp2kit.transformers_compat import is_prefix_change, within_row_operations

Opener = Callable[[], Any]  # opens one stored tensor lazily: a safetensors slice (get_shape, [index])


def checkpoint_conversions(model: Any) -> list:
    """The model family's conversions between its HF folders and its model, as `save_pretrained` reverses them for
    a model not loaded by `from_pretrained`: without the legacy renamings and `PrefixChange`s (whose reverse depends
    on what was loaded). Needs the unsharded model: transformers looks its classes up by name."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return [t for t in get_model_conversion_mapping(model, add_legacy=False) if not is_prefix_change(t)]


class ModelShapes:
    """What transformers' conversion ops ask of a model: its conversions (`revert_weight_conversion`), its config
    (ops sized by a config field) and its tensors' shapes by name (`Transpose(check_dims=True)`)."""

    def __init__(self, conversions: list, config: Any, shapes: dict[str, torch.Size]) -> None:
        self._weight_conversions = conversions
        self.config = config
        self.shapes = shapes

    def get_parameter(self, name: str) -> torch.Tensor:
        return torch.empty(self.shapes[name], device="meta")


def _split(conversions: list) -> tuple[list, list]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    return (
        [t for t in conversions if isinstance(t, WeightRenaming)],
        [t for t in conversions if isinstance(t, WeightConverter)],
    )


def _full_index(index: Any, ndim: int) -> tuple:
    index = index if isinstance(index, tuple) else (index,)
    return tuple(index) + (slice(None),) * (ndim - len(index))


def _stacks_first(converter: Any) -> bool:
    """Whether the converter stacks its listed tensors (one per expert) first and then works only within each one
    (concatenating gate and up, interleaving rows): then rows a..b of the result come from tensors a..b alone."""
    from transformers.core_model_loading import MergeModulelist

    first, *rest = converter.operations
    within_rows = within_row_operations()
    return (
        isinstance(first, MergeModulelist)
        and first.dim == 0
        and all(isinstance(op, within_rows) and op.dim != 0 for op in rest)
    )


@dataclass
class ConvertedView:
    """One model tensor that a transformers `WeightConverter` builds from stored tensors (e.g. per-expert weights
    stacked into a fused experts parameter), read lazily with the slice interface of safetensors."""

    converter: Any  # the converter, fresh (no tensors collected)
    first_name: str  # the name transformers keys the conversion by (its first target, expanded)
    name: str  # the model tensor this view gives
    stored: dict[str, list[str]]  # source pattern -> stored tensor names, in transformers' (natural) order
    open_stored: Callable[[str], Any]  # a stored tensor's lazy slice
    model: ModelShapes
    files: Mapping[str, Path] = field(default_factory=dict)  # the file of each stored tensor, where known
    _shape: list[int] | None = field(default=None, repr=False)

    def _convert(self, tensors: dict[str, list[torch.Tensor]]) -> torch.Tensor:
        converter = copy.deepcopy(self.converter)
        for pattern, listed in tensors.items():
            converter.collected_tensors[pattern] = listed
        return converter.convert(self.first_name, model=self.model, config=self.model.config)[self.name]

    def get_shape(self) -> list[int]:
        """The converted tensor's shape, from the stored headers; stored tensors that cannot be converted together
        (one expert's of another shape than its fellows') are one sentence naming the odd one and its file."""
        if self._shape is None:
            shapes = {
                pattern: {key: tuple(self.open_stored(key).get_shape()) for key in keys}
                for pattern, keys in self.stored.items()
            }
            for by_key in shapes.values():
                self._refuse_uneven(by_key)
            metas = {p: [torch.empty(shape, device="meta") for shape in found.values()] for p, found in shapes.items()}
            try:
                self._shape = list(self._convert(metas).shape)
            except RuntimeError as exc:  # shapes that transformers' ops cannot combine (gate and up of two widths)
                first = next(iter(next(iter(self.stored.values()))))
                raise UserError(
                    f"model weights: the tensors{self._where(first)} that make '{self.name}' ('{first}' and the like) "
                    f"cannot be combined ({str(exc).splitlines()[0]}); the files are damaged or of another model"
                ) from None
        return self._shape

    def _refuse_uneven(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """Tensors stacked into one (an experts tensor's, one per expert) share one shape: the odd one is named."""
        common, count = Counter(shapes.values()).most_common(1)[0]
        odd = next((key for key, shape in shapes.items() if shape != common), None)
        if odd is not None:
            raise UserError(
                f"model weights: tensor '{odd}'{self._where(odd)} has shape {shapes[odd]}, where {count} of the "
                f"tensors stacked with it into '{self.name}' have {common}; config and weights do not match"
            )

    def _where(self, key: str) -> str:
        return f" in '{self.files[key].name}'" if key in self.files else ""

    def __getitem__(self, index: Any) -> torch.Tensor:
        index = _full_index(index, len(self.get_shape()))
        stored, rest = self.stored, index
        if _stacks_first(self.converter) and isinstance(index[0], slice):
            experts = index[0]
            stored = {pattern: keys[experts] for pattern, keys in self.stored.items()}
            rest = (slice(None), *index[1:])
        tensors = {pattern: [self.open_stored(key)[:] for key in keys] for pattern, keys in stored.items()}
        return self._convert(tensors)[rest]


@dataclass
class StoredTensor:
    """A model tensor as the files hold it: how to open its (lazy) view, and the stored names it is read from."""

    open: Opener
    sources: list[str]


def model_views(
    stored: Iterable[str],
    open_stored: Callable[[str], Any],
    model: ModelShapes,
    files: Mapping[str, Path] | None = None,
) -> dict[str, StoredTensor]:
    """Every model tensor the stored tensors give, by its model name, as `from_pretrained` renames and converts
    them: all renamings, then at most one converter; a stored name that is the model's own without the converter
    (a model whose experts are split, reading per-expert files) is read as it is, as transformers does. `files`
    (which file holds each stored tensor) names the file where converted tensors do not fit together."""
    from transformers.core_model_loading import dot_natural_key, rename_source_key

    renamings, converters = _split(model._weight_conversions)
    by_pattern = {pattern: c for c in converters for pattern in c.source_patterns}
    views: dict[str, StoredTensor] = {}
    groups: dict[str, tuple[Any, dict[str, list[str]]]] = {}  # first target name -> (converter, pattern -> names)
    for key in sorted(stored, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters)
        plain, _ = rename_source_key(key, renamings, [])
        if pattern is None or (renamed not in model.shapes and plain in model.shapes):
            views[plain] = StoredTensor(partial(open_stored, key), [key])
            continue
        converter, members = groups.setdefault(renamed, (by_pattern[pattern], {}))
        members.setdefault(pattern, []).append(key)
    for first_name, (converter, members) in groups.items():
        names = [first_name.replace(converter.target_patterns[0], target) for target in converter.target_patterns]
        stored_names = [key for keys in members.values() for key in keys]
        for name in names:
            view = ConvertedView(copy.deepcopy(converter), first_name, name, members, open_stored, model, files or {})
            views[name] = StoredTensor(partial(_opened, view), stored_names)
    return views


def _opened(view: ConvertedView) -> ConvertedView:
    """A converted view opens its stored tensors itself, as it reads them."""
    return view


def stored_tensors(named: Iterable[tuple[str, torch.Tensor]], names: list[str], model: ModelShapes) -> Iterator:
    """(stored name, tensor) for the model's (name, full tensor) pairs, as `save_pretrained` writes them: through
    transformers' `revert_weight_conversion`, one conversion group at a time (a fused experts tensor gives its
    per-expert tensors), so that no more than one group is held. `names` lists every name `named` yields."""
    from transformers.core_model_loading import rename_source_key, revert_weight_conversion

    if not model._weight_conversions:
        yield from named
        return
    renamings, group_of = _reverse_groups(names, model)
    left = Counter(group_of.values())  # tensors still to come, per group
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        group = group_of[name]
        if group is None:  # no converter: only renamed, as revert_weight_conversion renames it
            yield rename_source_key(name, renamings, [])[0], tensor
            continue
        pending.setdefault(group, {})[name] = tensor
        left[group] -= 1
        if left[group] == 0:
            yield from revert_weight_conversion(model, pending.pop(group)).items()  # type: ignore[arg-type]


def _reverse_groups(names: Iterable[str], model: ModelShapes) -> tuple[list, dict[str, str | None]]:
    """`save_pretrained`'s renamings, and each name's conversion group (None: renamed only, no converter)."""
    from transformers.core_model_loading import rename_source_key

    renamings, reverse_converters = _split([t.reverse_transform() for t in model._weight_conversions[::-1]])
    group_of: dict[str, str | None] = {}
    for name in names:
        renamed, pattern = rename_source_key(name, [], reverse_converters)
        group_of[name] = renamed if pattern is not None else None
    return renamings, group_of


def renamed_only(names: Iterable[str], model: ModelShapes) -> dict[str, str]:
    """The stored name of each of `names` that `save_pretrained` only renames (no converter joins or splits it):
    such a tensor's every block is a block of the stored tensor, at the same place."""
    from transformers.core_model_loading import rename_source_key

    names = list(names)
    if not model._weight_conversions:
        return {name: name for name in names}
    renamings, group_of = _reverse_groups(names, model)
    return {name: rename_source_key(name, renamings, [])[0] for name in names if group_of[name] is None}


def layout_of(model: Any, state: dict[str, Any]) -> ModelShapes:
    """The model's HF layout: its conversions (`checkpoint_conversions`, kept on the model when it was built) over
    `state`, its tensors by model name."""
    return ModelShapes(
        getattr(model, "checkpoint_conversions", []), model.config, {n: t.shape for n, t in state.items()}
    )
