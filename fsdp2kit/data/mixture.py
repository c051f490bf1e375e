"""Weighted mixtures of sources and the evaluation set.

A mixture (`data.source: [{path, weight}, ...]`) keeps each source's own token store and samples. An epoch is as
many samples as all the sources hold together; source i gives round(w_i / sum(w) x that) of them, drawn from a
seeded permutation of its samples that is cycled (a fresh permutation each time round) when it gives more than it
has. The sources' samples are interleaved stratified: the k-th sample of source i sits at (k + u) / q_i of the epoch,
u a seeded jitter in [0, 1), so that any run of consecutive samples holds each source's share (within a sample or
two). The order depends only on the seed and the epoch: a resumed run reads exactly what the whole run would have.

The evaluation set is `data.eval_source` (any form `source` takes; a mixture's entries are evaluated whole), or
`data.eval_fraction` of the training samples held out (seeded; of each source of a mixture), which training then
never reads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fsdp2kit.config.schema import DataConfig, WeightedSource, is_mixture
from fsdp2kit.data.dataset import Sample
from fsdp2kit.data.registry import dataset_names
from fsdp2kit.data.samples import TrainingSamples
from fsdp2kit.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Streams of random numbers, told apart by the last word of their numpy seed sequence.
_PERMUTATION, _JITTER, _HOLD_OUT = 0, 1, 2


class SubsetSamples:
    """The samples of `base` at `indices` (in that order): a held-out evaluation set, or what training keeps."""

    def __init__(self, base: Any, indices: np.ndarray) -> None:
        self.base, self.indices = base, indices

    @property
    def width(self) -> int:
        return int(self.base.width)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> Any:
        return self.base[int(self.indices[index])]

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        return np.asarray(self.base.lengths(self.indices[np.asarray(indices)]))


class ConcatSamples:
    """Several sets of samples one after another: sample `offsets[i] + j` is sample j of part i."""

    def __init__(self, parts: list[Any]) -> None:
        self.parts = parts
        self.offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)

    @property
    def width(self) -> int:
        return int(self.parts[0].width)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each index's part and its index within that part."""
        parts = np.searchsorted(self.offsets, indices, side="right") - 1
        return parts, indices - self.offsets[parts]

    def __getitem__(self, index: int) -> Sample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        parts, within = self.locate(np.array([index]))
        return self.parts[int(parts[0])][int(within[0])]

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        parts, within = self.locate(np.asarray(indices, dtype=np.int64))
        lengths = np.zeros(len(parts), dtype=np.int64)
        for part in np.unique(parts).tolist():
            chosen = parts == part
            lengths[chosen] = self.parts[part].lengths(within[chosen])
        return lengths


class MixedSamples:
    """Samples of several sources interleaved in proportion to their weights (see the module's doc). Indices are
    those of the sources' samples concatenated (`pool`); `len()` is an epoch's length, and `epoch_order` is the
    order `GlobalBatches` reads."""

    def __init__(self, parts: list[Any], weights: list[float], names: list[str]) -> None:
        self.pool = ConcatSamples(parts)
        self.weights, self.names = weights, names
        total, weight_sum = len(self.pool), sum(weights)
        self.quotas = [max(1, round(w / weight_sum * total)) for w in weights]

    @property
    def width(self) -> int:
        return self.pool.width

    def __len__(self) -> int:
        return sum(self.quotas)

    def __getitem__(self, index: int) -> Sample:
        return self.pool[index]

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        return self.pool.lengths(indices)

    def _draws(self, source: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
        """Source `source`'s samples in epoch `epoch`: the next `quota` of its stream of permutations."""
        size, quota = len(self.pool.parts[source]), self.quotas[source]
        stream = np.arange(epoch * quota, (epoch + 1) * quota, dtype=np.int64)
        cycles, within = np.divmod(stream, size)
        local = np.empty(quota, dtype=np.int64)
        for cycle in np.unique(cycles).tolist():
            chosen = cycles == cycle
            rng = np.random.default_rng([seed, source, cycle, _PERMUTATION])
            order = rng.permutation(size) if shuffle else np.arange(size)
            local[chosen] = order[within[chosen]]
        return self.pool.offsets[source] + local

    def epoch_order(self, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
        """The pool indices of epoch `epoch`, each source's share spread evenly over it."""
        ids, times = [], []
        for source, quota in enumerate(self.quotas):
            ids.append(self._draws(source, epoch, seed, shuffle))
            jitter = np.random.default_rng([seed, source, epoch, _JITTER]).random(quota) if shuffle else 0.5
            times.append((np.arange(quota) + jitter) / quota)
        order = np.argsort(np.concatenate(times), kind="stable")
        return torch.from_numpy(np.concatenate(ids)[order])

    def describe(self) -> list[str]:
        """One line per source: its weight, and what it gives an epoch of what it holds."""
        lines = []
        for number, (name, weight, quota) in enumerate(zip(self.names, self.weights, self.quotas, strict=True)):
            size = len(self.pool.parts[number])
            lines.append(
                f"data.source[{number}] {name}: weight {weight:g}, {quota} samples per epoch of its {size} "
                f"(repeated {quota / size:.2f} times)"
            )
        return lines


def _entries(source: str | list[str] | list[WeightedSource], dataset_dir: str | None = None) -> list[WeightedSource]:
    """A source's entries: those of a mixture, each dataset it names in data.dataset_dir, or the source itself with
    weight 1."""
    if is_mixture(source):
        return list(source)  # type: ignore[arg-type]
    if dataset_dir is not None:
        return [WeightedSource(path=name) for name in dataset_names(source)]  # type: ignore[arg-type]
    return [WeightedSource(path=source)]


def source_name(path: str | list[str]) -> str:
    """A short name of one source for the log."""
    if isinstance(path, list):
        return f"{Path(path[0]).name} (+{len(path) - 1} files)" if len(path) > 1 else Path(path[0]).name
    return path if path.startswith("builtin:") else Path(path).name


def describe_source(source: str | list[str] | list[WeightedSource]) -> str:
    """How the log names a data source (a mixture: its entries' names and weights)."""
    if not is_mixture(source):
        return str(source)
    return "a mixture of " + ", ".join(f"{source_name(e.path)} ({e.weight:g})" for e in _entries(source))


def source_configs(data: DataConfig) -> list[tuple[str, DataConfig]]:
    """One data config per source a run reads (a mixture's entries, then the evaluation source's), each with the key
    that names it (`named_as`): the token stores `prepare` builds ahead of a run."""
    paths = [("data.source", e.path) for e in _entries(data.source, data.dataset_dir)]
    if data.eval_source is not None:
        with named_as("data.eval_source"):
            paths += [("data.eval_source", e.path) for e in _entries(data.eval_source, data.dataset_dir)]
    return [(key, data.model_copy(update={"source": path, "eval_source": None})) for key, path in paths]


def hold_out(samples: Any, fraction: float, seed: int, source: int = 0) -> tuple[SubsetSamples, SubsetSamples]:
    """(what training keeps, the held-out evaluation set): round(fraction x the samples), at least one, chosen by a
    permutation seeded with the seed (and the source's number in a mixture)."""
    size = len(samples)
    held = max(1, round(fraction * size))
    if held >= size:
        raise UserError(
            f"data.eval_fraction: {fraction:g} of {size} samples holds out all of them; lower it or give more data"
        )
    chosen = np.random.default_rng([seed, source, 0, _HOLD_OUT]).permutation(size)
    return SubsetSamples(samples, np.sort(chosen[held:])), SubsetSamples(samples, np.sort(chosen[:held]))


@contextmanager
def named_as(key: str) -> Iterator[None]:
    """The evaluation set is read as a `source` of its own: a refusal of it names the key the user wrote (`key`)."""
    try:
        yield
    except UserError as exc:
        message = str(exc)
        if key == "data.source" or not message.startswith("data.source"):
            raise
        raise UserError(key + message.removeprefix("data.source")) from None


def split_samples(data: DataConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> tuple[Any, Any]:
    """The training samples (one source's, a mixture, or several named datasets one after another as LLaMA-Factory's
    mix_strategy concat reads them) and the evaluation set (None without one)."""
    entries = _entries(data.source, data.dataset_dir)
    parts: list[Any] = [
        TrainingSamples.from_config(data.model_copy(update={"source": e.path}), tokenizer) for e in entries
    ]
    held: list[Any] = []
    if data.eval_fraction is not None:
        split = [hold_out(part, data.eval_fraction, seed, number) for number, part in enumerate(parts)]
        parts, held = [kept for kept, _ in split], [out for _, out in split]
    train = (
        MixedSamples(parts, [e.weight for e in entries], [source_name(e.path) for e in entries])
        if is_mixture(data.source)
        else ConcatSamples(parts)
        if len(parts) > 1
        else parts[0]
    )
    if data.eval_source is not None:
        with named_as("data.eval_source"):
            held = [
                TrainingSamples.from_config(data.model_copy(update={"source": e.path}), tokenizer)
                for e in _entries(data.eval_source, data.dataset_dir)
            ]
    if not held:
        return train, None
    if not sum(len(part) for part in held):
        raise UserError(
            "data.eval_source: it gives no sample with a loss target (every document empty or prompt, or, packed, "
            "fewer tokens than one window of data.seq_len + 1)"
        )
    return train, held[0] if len(held) == 1 else ConcatSamples(held)


def data_lines(samples: Any, eval_samples: Any, data: DataConfig) -> list[str]:
    """What the log says about a run's data besides the store: a mixture's sources, the evaluation set."""
    lines = samples.describe() if isinstance(samples, MixedSamples) else []
    if eval_samples is not None:
        origin = (
            f"{data.eval_fraction:g} of the training samples held out"
            if data.eval_fraction is not None
            else describe_source(data.eval_source)  # type: ignore[arg-type]
        )
        lines.append(f"evaluation set: {len(eval_samples)} samples ({origin})")
    return lines


def samples_taken(batches: Any, steps: range) -> list[str]:
    """What each source of a mixture gave to `steps` (a run's, resumed or not): one line; [] for one source."""
    samples = batches.samples
    if not isinstance(samples, MixedSamples) or not steps:
        return []
    counts = np.zeros(len(samples.quotas), dtype=np.int64)
    size, per_epoch = batches.global_batch_size, batches.steps_per_epoch
    for epoch in range(steps.start // per_epoch, (steps.stop - 1) // per_epoch + 1):
        first = max(steps.start - epoch * per_epoch, 0)
        last = min(steps.stop - epoch * per_epoch, per_epoch)
        ids = samples.epoch_order(epoch, batches.seed, batches.shuffle)[first * size : last * size]
        counts += np.bincount(samples.pool.locate(ids.numpy())[0], minlength=len(counts))
    taken = ", ".join(f"{count} from {name}" for count, name in zip(counts.tolist(), samples.names, strict=True))
    return [f"data: steps {steps.start + 1}-{steps.stop} took {int(counts.sum())} samples: {taken}"]
