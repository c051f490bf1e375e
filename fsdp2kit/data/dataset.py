"""Documents -> token samples -> micro-batches, in an order that depends only on the seed and the global sample
index, so any world size and accumulation split of the same global batch sees the same samples."""

from __future__ import annotations

import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, cast

import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.errors import UserError

IGNORE_INDEX = -100
_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


class PromptResponse(NamedTuple):
    """An SFT example: the prompt is context only, the loss is on the response (and the EOS after it)."""

    prompt: str
    response: str


def _read_table(source: str | list[str]):
    """A local HF dataset folder or *.jsonl / *.parquet / *.txt files (a glob or a list), as a `datasets.Dataset`,
    and which of those it was ('disk', 'json', 'parquet' or 'text')."""
    import datasets

    datasets.disable_progress_bars()  # a bar per split of a local file is noise in a training log
    if isinstance(source, list):
        files = source
    elif Path(source).is_dir():
        path = Path(source)
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise UserError(f"data.source: '{path}' is a folder but not a saved HF dataset (no dataset_info.json)")
        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
        return dataset, "disk"
    else:
        files = sorted(glob.glob(source)) if any(c in source for c in "*?[") else [source]
    missing = [f for f in files if not Path(f).is_file()]
    if not files or missing:
        raise UserError(f"data.source: no such file '{missing[0] if missing else source}'")
    kinds = {_FILE_KINDS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise UserError(f"data.source: '{source}' must be *.jsonl, *.parquet or *.txt files of one kind")
    kind = kinds.pop()
    try:
        return datasets.load_dataset(kind, data_files=files, split="train"), kind
    except Exception as exc:  # datasets raises many types for unreadable files
        raise UserError(f"data.source: cannot read '{source}': {exc}") from None


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    """The tokenizer of a model folder, a checkpoint or `data.tokenizer`, through transformers; a corrupt or
    incomplete one is one sentence naming the folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # tokenizers and transformers raise many types for unreadable files
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise UserError(f"data.tokenizer: the tokenizer in '{path}' cannot be loaded: {reason}") from None


def load_documents(cfg: DataConfig) -> list[str] | list[PromptResponse]:
    """The source's documents in file order (the first `max_samples`): texts, or prompt/response pairs when the
    source has both `prompt_key` and `response_key` fields. Empty texts and responses are dropped."""
    try:
        return _documents(cfg)
    except UnicodeDecodeError as exc:  # datasets decodes a file's text lazily, column by column
        raise UserError(
            f"data.source: '{cfg.source}' is not UTF-8 text (byte {exc.object[exc.start]:#04x}: {exc.reason}); "
            "re-save it as UTF-8"
        ) from None


def _documents(cfg: DataConfig) -> list[str] | list[PromptResponse]:
    if cfg.source == "builtin:corpus":
        from fsdp2kit.data.builtin import corpus_documents

        return corpus_documents()[: cfg.max_samples]
    if isinstance(cfg.source, str) and cfg.source.startswith("builtin:"):
        raise UserError(f"data.source: unknown built-in dataset '{cfg.source}'; valid: builtin:corpus")
    table, kind = _read_table(cfg.source)
    text_key = "text" if kind == "text" else cfg.text_key  # a text file's lines have no field names to choose from
    table = table.select(range(min(cfg.max_samples, len(table)))) if cfg.max_samples is not None else table
    if cfg.prompt_key in table.column_names and cfg.response_key in table.column_names:
        queries = table[cfg.query_key] if cfg.query_key in table.column_names else [None] * len(table)
        return [
            PromptResponse((p if isinstance(p, str) else "") + (f"\n{q}" if isinstance(q, str) and q else ""), r)
            for p, q, r in zip(table[cfg.prompt_key], queries, table[cfg.response_key], strict=True)
            if isinstance(r, str) and r
        ]
    if text_key not in table.column_names:
        raise UserError(
            f"data.text_key: '{cfg.source}' has no field '{text_key}' (nor both '{cfg.prompt_key}' "
            f"and '{cfg.response_key}' for SFT); its fields: {', '.join(table.column_names)}"
        )
    return [t for t in table[text_key] if isinstance(t, str) and t]


@dataclass(frozen=True)
class Sample:
    """Up to seq_len + 1 tokens: the model reads tokens[:-1] and predicts tokens[1:]. `trained[i]` says whether
    token i is a loss target; `positions` (packing with document_mask) is each token's position in its document."""

    tokens: torch.Tensor
    trained: torch.Tensor
    positions: torch.Tensor | None = None

    @classmethod
    def document(cls, tokens: torch.Tensor) -> Sample:
        """One whole document, every token after the first trained on."""
        trained = torch.ones(len(tokens), dtype=torch.bool)
        trained[0] = False
        return cls(tokens, trained)


def encode_documents(
    documents: list[str] | list[PromptResponse], tokenizer, append_eos: bool = True
) -> list[tuple[list[int], int]]:
    """Each document's token ids (with EOS appended for training), and how many leading ids are prompt (not
    trained on). A prompt gets the tokenizer's default special tokens (e.g. BOS); the response is joined as ids."""
    eos = [tokenizer.eos_token_id] if append_eos and tokenizer.eos_token_id is not None else []
    if all(isinstance(d, str) for d in documents):
        return [(ids + eos, 0) for ids in tokenizer(list(documents))["input_ids"]]
    pairs = cast(list[PromptResponse], documents)  # a source is all texts or all prompt/response pairs
    prompts = tokenizer([d.prompt for d in pairs])["input_ids"]
    responses = tokenizer([d.response for d in pairs], add_special_tokens=False)["input_ids"]
    return [(p + r + eos, len(p)) for p, r in zip(prompts, responses, strict=True)]


def _positions_in_document(starts: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting at every True of `starts` (and at the window's first token)."""
    index = torch.arange(len(starts))
    starts = starts.clone()
    starts[0] = True
    return index - torch.cummax(torch.where(starts, index, 0), dim=0).values


def tokenize_samples(documents: list[str] | list[PromptResponse], tokenizer, cfg: DataConfig) -> list[Sample]:
    """Without packing each document is one sample, truncated to seq_len + 1 tokens. Packing joins the documents
    (each ending in EOS) into one stream and cuts windows of seq_len + 1 tokens; the trained-on mask travels with
    the tokens, and with `document_mask` so do positions that restart at each document, from which transformers
    builds a block-diagonal causal mask: no token attends across a document boundary. A document's first token is
    never a target (nothing of its own document precedes it); samples without any target are dropped."""
    width = cfg.seq_len + 1
    encoded = encode_documents(documents, tokenizer)
    trained_masks = []
    for ids, prompt_len in encoded:
        trained = torch.ones(len(ids), dtype=torch.bool)
        trained[: max(prompt_len, 1)] = False
        trained_masks.append(trained)
    if not cfg.pack:
        samples = [
            Sample(torch.tensor(ids[:width]), trained[:width])
            for (ids, _), trained in zip(encoded, trained_masks, strict=True)
        ]
        return [s for s in samples if s.trained[1:].any()]
    tokens = torch.tensor([t for ids, _ in encoded for t in ids], dtype=torch.long)
    trained = torch.cat(trained_masks) if trained_masks else torch.zeros(0, dtype=torch.bool)
    starts = torch.cat([torch.arange(len(ids)) == 0 for ids, _ in encoded]) if encoded else trained
    count = len(tokens) // width
    windows = [slice(i * width, (i + 1) * width) for i in range(count)]
    samples = [
        Sample(tokens[w], trained[w], _positions_in_document(starts[w]) if cfg.document_mask else None) for w in windows
    ]
    return [s for s in samples if s.trained[1:].any()]


def collate(samples: list[Sample] | list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The model's inputs and the labels. Samples are right-padded to the longest; padding is masked from attention
    (`attention_mask`) and loss. Packed samples with document positions are never padded and carry `position_ids`
    instead of an attention mask. A plain tensor is one document's tokens."""
    rows = [s if isinstance(s, Sample) else Sample.document(s) for s in samples]
    length = max(len(s.tokens) for s in rows) - 1
    batch = len(rows)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, sample in enumerate(rows):
        n = len(sample.tokens) - 1
        input_ids[i, :n] = sample.tokens[:-1]
        labels[i, :n] = sample.tokens[1:].masked_fill(~sample.trained[1:], IGNORE_INDEX)
        attention_mask[i, :n] = 1
    positions = [s.positions[:-1] for s in rows if s.positions is not None]
    if len(positions) == batch:
        return {
            "input_ids": input_ids,
            "position_ids": torch.stack(positions),
            "labels": labels,
        }
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward: all but the labels."""
    return {key: value for key, value in batch.items() if key != "labels"}


def input_token_count(batch: dict[str, torch.Tensor]) -> int:
    """Tokens the model reads, padding excluded."""
    mask = batch.get("attention_mask")
    return int(mask.sum()) if mask is not None else batch["input_ids"].numel()


@dataclass
class GlobalBatches:
    """Step s uses the global samples [s*G, (s+1)*G) of a seeded per-epoch permutation; rank r takes its
    contiguous `per_rank` share, cut into micro-batches. The position is just the step (world-size free)."""

    samples: Sequence
    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int
    data_parallel_rank: int
    seed: int
    shuffle: bool
    pad_id: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise UserError(
                f"data: the dataset yields {len(self.samples)} samples, fewer than one global batch of "
                f"{self.global_batch_size} (per_device_train_batch_size x gradient_accumulation_steps x ranks)"
            )
        self._orders: dict[int, torch.Tensor] = {}

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.accumulation_steps * self.data_parallel_size

    @property
    def steps_per_epoch(self) -> int:
        return len(self.samples) // self.global_batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._orders = {epoch: torch.randperm(len(self.samples), generator=generator)}
            else:
                self._orders = {epoch: torch.arange(len(self.samples))}
        return self._orders[epoch]

    def micro_batches(self, step: int) -> list[dict[str, torch.Tensor]]:
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        per_rank = self.micro_batch_size * self.accumulation_steps
        start = within * self.global_batch_size + self.data_parallel_rank * per_rank
        indices = order[start : start + per_rank].tolist()
        return [
            self.collate_indices(indices[m : m + self.micro_batch_size])
            for m in range(0, per_rank, self.micro_batch_size)
        ]

    def collate_indices(self, indices: list[int]) -> dict[str, torch.Tensor]:
        """The micro-batch of these samples (a subclass may build its samples here, lazily)."""
        return collate([self.samples[i] for i in indices], self.pad_id)
