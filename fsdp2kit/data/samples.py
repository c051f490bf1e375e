"""Training samples cut lazily from a token store, and which of them each rank trains on at each step.

The order depends only on the seed and the global sample index, so any world size and accumulation split of the same
global batch sees the same samples, and resuming at a step resumes the data exactly. Nothing per token or per document
is held in Python objects: a sample is computed from the store's offsets when a micro-batch asks for it, by a
background thread while the previous step computes."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np
import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.dataset import Sample, collate
from fsdp2kit.data.store import TokenStore, token_store
from fsdp2kit.errors import UserError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


_MASK_BLOCK_TOKENS = 1 << 24  # tokens of a conversation store's mask read at once when counting samples with targets


def conversation_window(store: TokenStore, index: int, width: int) -> tuple[int, np.ndarray]:
    """Where conversation `index` starts in the store and the trained mask of its first tokens: all of them, or when
    it is longer than `width`, up to the end of the last trained turn that ends within `width` (else `width`)."""
    assert store.masks is not None
    start, stop = int(store.offsets[index]), int(store.offsets[index + 1])
    mask = store.masks[start : min(stop, start + width + 1)].astype(bool)
    if len(mask) <= width:
        return start, mask
    ends = np.flatnonzero(mask[:-1] & ~mask[1:])
    return start, mask[: int(ends[-1]) + 1 if len(ends) else width].copy()


class TrainingSamples:
    """Without packing sample i is a document truncated to seq_len + 1 tokens. With packing the documents (each
    ending in EOS) form one stream cut into windows of seq_len + 1 tokens; with `document_mask` each window carries
    positions that restart at every document, from which transformers builds a block-diagonal causal mask. A
    document's first token and an SFT prompt's tokens are never targets; a conversation's targets are its store
    mask (an unpacked one longer than seq_len is cut after the last whole trained turn that fits); samples without
    any target are skipped (for conversations, counted in the log). Held in memory: the index of the kept samples,
    and only when some are skipped."""

    def __init__(self, store: TokenStore, seq_len: int, pack: bool, document_mask: bool):
        self.store = store
        self.width = seq_len + 1
        self.pack = pack
        self.document_mask = document_mask
        self._kept: np.ndarray | None = None  # the kept samples' windows or documents; None: all are kept
        if store.prompt_lengths is not None or store.masks is not None or store.meta["min_document_tokens"] < 2:
            kept = self._with_targets(pack) if store.masks is None else self._with_mask_targets(pack)
            self._kept = None if kept.all() else np.flatnonzero(kept)
            if store.masks is not None and self._kept is not None:
                _print_once(
                    f"data: {len(kept) - len(self._kept)} of {len(kept)} {'windows' if pack else 'conversations'} "
                    f"have no token to train on within data.seq_len = {seq_len} and are left out"
                )
        # Otherwise every sample has a target, found without any per-document array: a document of 2+ tokens has
        # targets after its first token, and no window's 2+ positions after its first can all start documents.
        units = store.num_tokens // self.width if pack else store.num_documents
        self._count = units if self._kept is None else len(self._kept)

    def _with_targets(self, pack: bool) -> np.ndarray:
        """Which windows (packing) or documents have a loss target, for any prompt and document lengths."""
        store, offsets = self.store, self.store.offsets
        lengths = np.diff(offsets)
        untrained = np.minimum(self._first_target(np.arange(store.num_documents)), lengths)
        if not pack:
            return untrained < np.minimum(lengths, self.width)
        starts = np.arange(store.num_tokens // self.width, dtype=np.int64) * self.width
        before = np.concatenate([[0], np.cumsum(untrained)])  # untrained tokens of the documents before d

        def untrained_below(position: np.ndarray) -> np.ndarray:
            doc = np.minimum(np.searchsorted(offsets, position, side="right") - 1, store.num_documents - 1)
            return before[doc] + np.minimum(position - offsets[doc], untrained[doc])

        targets = (self.width - 1) - (untrained_below(starts + self.width) - untrained_below(starts + 1))
        return targets > 0

    def _with_mask_targets(self, pack: bool) -> np.ndarray:
        """Which windows (packing) or conversations have a trained token after their first, from the store mask,
        read a block of about _MASK_BLOCK_TOKENS at a time: memory stays flat whatever the corpus size."""
        store, masks, width = self.store, self.store.masks, self.width
        assert masks is not None
        if pack:
            windows = store.num_tokens // width
            per_block = max(1, _MASK_BLOCK_TOKENS // width)
            kept = np.zeros(windows, dtype=bool)
            for first in range(0, windows, per_block):
                last = min(first + per_block, windows)
                block = np.asarray(masks[first * width : last * width]).reshape(last - first, width)
                kept[first:last] = block[:, 1:].any(axis=1)
            return kept
        offsets = np.asarray(store.offsets)
        bounds = np.unique(np.searchsorted(offsets, np.arange(0, store.num_tokens, _MASK_BLOCK_TOKENS), "right") - 1)
        kept = np.zeros(store.num_documents, dtype=bool)
        for first, last in zip(bounds, [*bounds[1:], store.num_documents], strict=True):
            base = offsets[first]
            before = np.concatenate([[0], np.cumsum(masks[base : offsets[last]], dtype=np.int64)])
            starts = offsets[first:last]
            ends = np.minimum(offsets[first + 1 : last + 1], starts + width)
            kept[first:last] = before[ends - base] - before[starts - base] > 0
        return kept

    def _cut_conversation(self, unit: int) -> Sample:
        """A conversation, cut (when longer than seq_len + 1 tokens) after the last trained turn that ends within
        them, else at seq_len + 1."""
        start, mask = conversation_window(self.store, unit, self.width)
        tokens = self.store.tokens[start : start + len(mask)].astype(np.int64)
        return Sample(torch.from_numpy(tokens), torch.from_numpy(mask))

    @classmethod
    def from_config(cls, cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TrainingSamples:
        """The samples of the config's data, from its token store (built first if absent)."""
        return cls(token_store(cfg, tokenizer), cfg.seq_len, cfg.pack, cfg.document_mask)

    def _first_target(self, documents: np.ndarray) -> np.ndarray:
        """Per document, the position of its first loss target: after the prompt, and never position 0."""
        if self.store.prompt_lengths is None:
            return np.ones(len(documents), dtype=np.int64)
        return np.maximum(self.store.prompt_lengths[documents].astype(np.int64), 1)

    def __len__(self) -> int:
        return self._count

    def _unit(self, index: int) -> int:
        """The window (packing) or document of sample `index`."""
        if not 0 <= index < self._count:
            raise IndexError(index)
        return index if self._kept is None else int(self._kept[index])

    def __getitem__(self, index: int) -> Sample:
        unit = self._unit(index)
        if not self.pack and self.store.masks is not None:
            return self._cut_conversation(unit)
        if not self.pack:
            document = self.store.document(unit)[: self.width]
            trained = np.arange(len(document)) >= self._first_target(np.array([unit]))[0]
            return Sample(torch.from_numpy(document.astype(np.int64)), torch.from_numpy(trained))
        start = unit * self.width
        position = np.arange(start, start + self.width)
        doc = np.searchsorted(self.store.offsets, position, side="right") - 1
        doc_start = self.store.offsets[doc]
        if self.store.masks is None:
            trained = position - doc_start >= self._first_target(doc)
        else:
            trained = self.store.masks[start : start + self.width].astype(bool)
        positions = torch.from_numpy(position - np.maximum(doc_start, start)) if self.document_mask else None
        tokens = torch.from_numpy(self.store.tokens[start : start + self.width].astype(np.int64))
        return Sample(tokens, torch.from_numpy(trained), positions)

    def lengths(self, indices: np.ndarray) -> np.ndarray:
        """Tokens of each sample (inputs + 1), from the offsets alone."""
        if self.pack:
            return np.full(len(indices), self.width, dtype=np.int64)
        units = indices if self._kept is None else self._kept[indices]
        return np.minimum(self.store.offsets[units + 1] - self.store.offsets[units], self.width)


@runtime_checkable
class TokenSamples(Protocol):
    """Token samples of one width (seq_len + 1) whose lengths are known without reading them: `TrainingSamples`, a
    mixture of them, a held-out part of them."""

    width: int

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...

    def lengths(self, indices: np.ndarray) -> np.ndarray: ...


def _print_once(line: str) -> None:
    """A line in the log of the first rank only (every rank cuts the same samples)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(line, flush=True)


def marked_text(sample: Sample, tokenizer: PreTrainedTokenizerBase, colour: bool = False) -> str:
    """A sample decoded, its loss targets marked: `[[...]]`, or green on a terminal (`prepare --show`)."""
    trained = sample.trained.tolist()
    tokens = sample.tokens.tolist()
    pieces: list[str] = []
    start = 0
    for end in range(1, len(tokens) + 1):
        if end == len(tokens) or trained[end] != trained[start]:
            text = str(tokenizer.decode(tokens[start:end]))
            mark = ("\x1b[32m", "\x1b[0m") if colour else ("[[", "]]")
            pieces.append(f"{mark[0]}{text}{mark[1]}" if trained[start] else text)
            start = end
    return "".join(pieces)


def token_budget_groups(lengths: list[np.ndarray], budget: int) -> list[list[list[int]]]:
    """Per rank, its samples (positions in its share) grouped into micro-batches of at most `budget` padded input
    tokens: sorted by length, filled in turn. Every rank gets as many micro-batches as the rank needing most (a
    micro-batch is a round of parameter all-gathers all ranks take part in), by halving its largest groups."""
    per_rank = []
    for rank_lengths in lengths:
        groups: list[list[int]] = []
        longest = 0
        for k in np.argsort(rank_lengths, kind="stable").tolist():
            inputs = int(rank_lengths[k]) - 1
            if groups and max(longest, inputs) * (len(groups[-1]) + 1) <= budget:
                groups[-1].append(k)
                longest = max(longest, inputs)
            else:
                groups.append([k])
                longest = inputs
        per_rank.append(groups)
    target = max(len(groups) for groups in per_rank)
    for groups in per_rank:
        while len(groups) < target:  # target <= samples per rank, so a group of two or more always exists
            largest = max(range(len(groups)), key=lambda g: len(groups[g]))
            half = len(groups[largest]) // 2
            groups[largest : largest + 1] = [groups[largest][:half], groups[largest][half:]]
    return per_rank


@dataclass
class GlobalBatches:
    """Step s uses the global samples [s*G, (s+1)*G) of a seeded per-epoch permutation; rank r takes its
    contiguous `per_rank` share, cut into micro-batches of `micro_batch_size` samples, or with
    `max_tokens_per_micro_batch` into micro-batches under that token budget. The position is just the step.
    Samples that lay out their own epochs (a mixture: `epoch_order`) give the order instead."""

    samples: Any  # TrainingSamples, or a subclass's own records (VL conversations)
    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int
    data_parallel_rank: int
    seed: int
    shuffle: bool
    pad_id: int
    max_tokens_per_micro_batch: int | None = None
    eval_samples: Any = None  # the evaluation set, of the same kind as `samples` (None: no evaluation)

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise UserError(
                f"data: the dataset yields {len(self.samples)} samples, fewer than one global batch of "
                f"{self.global_batch_size} (per_device_train_batch_size x gradient_accumulation_steps x ranks)"
            )
        budget, samples = self.max_tokens_per_micro_batch, self.samples
        if budget is not None and not isinstance(samples, TokenSamples):
            raise UserError("data.max_tokens_per_micro_batch: only for text data; unset it for vision-language data")
        if budget is not None and isinstance(samples, TokenSamples) and budget < samples.width - 1:
            raise UserError(
                f"data.max_tokens_per_micro_batch: {budget} is less than data.seq_len {samples.width - 1}; "
                "a micro-batch must hold the longest sample"
            )
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.data_parallel_size

    @property
    def per_rank(self) -> int:
        return self.micro_batch_size * self.accumulation_steps

    @property
    def steps_per_epoch(self) -> int:
        return len(self.samples) // self.global_batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if hasattr(self.samples, "epoch_order"):
                self._orders = {epoch: self.samples.epoch_order(epoch, self.seed, self.shuffle)}
            elif self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders = {epoch: torch.randperm(len(self.samples), generator=generator)}
            else:
                self._orders = {epoch: torch.arange(len(self.samples))}
        return self._orders[epoch]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        epoch, within = divmod(step, self.steps_per_epoch)
        first = within * self.global_batch_size
        shares = self._order(epoch)[first : first + self.global_batch_size].numpy().reshape(-1, self.per_rank)
        mine = shares[self.data_parallel_rank].tolist()
        if self.max_tokens_per_micro_batch is None:
            groups = [list(range(m, m + self.micro_batch_size)) for m in range(0, self.per_rank, self.micro_batch_size)]
        else:
            samples = cast(TokenSamples, self.samples)  # checked in __post_init__
            lengths = [samples.lengths(share) for share in shares]
            groups = token_budget_groups(lengths, self.max_tokens_per_micro_batch)[self.data_parallel_rank]
        return [self.collate_indices([mine[k] for k in group]) for group in groups]

    def collate_indices(self, indices: list[int], samples: Any = None) -> dict[str, torch.Tensor]:
        """The micro-batch of these samples (of `samples`, default the training ones; a subclass may build its
        samples here, lazily)."""
        samples = self.samples if samples is None else samples
        return collate([samples[i] for i in indices], self.pad_id)


class Prefetcher:
    """The micro-batches of the coming steps, collated by a background thread while the current step computes
    (pinned, on CUDA, so the copy to the device can be asynchronous). `next()` returns them in step order."""

    def __init__(self, batches: GlobalBatches, steps: range, pin_memory: bool, depth: int = 2):
        self._batches = batches
        self._pin = pin_memory
        self._queue: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(steps,), name="fsdp2kit-prefetch", daemon=True)
        self._thread.start()

    def _fill(self, steps: range) -> None:
        try:
            for step in steps:
                if self._stop.is_set():
                    return
                micro_batches = self._batches.micro_batches(step)
                if self._pin:
                    micro_batches = [{k: v.pin_memory() for k, v in mb.items()} for mb in micro_batches]
                self._put(micro_batches)
        except BaseException as exc:  # handed to the training thread, which raises it
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> list[dict[str, torch.Tensor]]:
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
