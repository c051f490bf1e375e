"""Documents -> token samples -> micro-batches, in an order that depends only on the seed and the global sample
index, so any world size and accumulation split of the same global batch sees the same samples."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

import torch

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.errors import UserError

IGNORE_INDEX = -100
_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}


def load_documents(cfg: DataConfig) -> list[str]:
    if cfg.source == "builtin:corpus":
        from fsdp2kit.data.builtin import corpus_documents

        return corpus_documents()
    if cfg.source.startswith("builtin:"):
        raise UserError(f"data.source: unknown built-in dataset '{cfg.source}'; valid: builtin:corpus")
    path = Path(cfg.source)
    if path.is_dir():
        if not (path / "dataset_info.json").exists() and not (path / "dataset_dict.json").exists():
            raise UserError(f"data.source: '{path}' is a folder but not a saved HF dataset (no dataset_info.json)")
        import datasets

        dataset = datasets.load_from_disk(str(path))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
    else:
        files = sorted(glob.glob(cfg.source)) if any(c in cfg.source for c in "*?[") else [cfg.source]
        if not files or not all(Path(f).is_file() for f in files):
            raise UserError(f"data.source: no such file '{cfg.source}'")
        kinds = {_FILE_KINDS.get(Path(f).suffix) for f in files}
        if None in kinds or len(kinds) > 1:
            raise UserError(f"data.source: '{cfg.source}' must be *.jsonl, *.parquet or *.txt files of one kind")
        import datasets

        try:
            dataset = datasets.load_dataset(kinds.pop(), data_files=files, split="train")
        except Exception as exc:  # datasets raises many types for unreadable files
            raise UserError(f"data.source: cannot read '{cfg.source}': {exc}") from None
    key = "text" if "text" in dataset.column_names and cfg.text_key not in dataset.column_names else cfg.text_key
    if key not in dataset.column_names:
        raise UserError(f"data.text_key: '{cfg.text_key}' is not a field of '{cfg.source}'; fields: {dataset.column_names}")
    return [t for t in dataset[key] if isinstance(t, str) and t]


def tokenize_samples(documents: list[str], tokenizer, cfg: DataConfig) -> list[torch.Tensor]:
    """Each sample holds seq_len + 1 tokens (inputs and their shifted targets). Packing joins documents with EOS
    and cuts windows; without packing each document is one (truncated) sample."""
    eos = tokenizer.eos_token_id
    encoded = tokenizer(documents, add_special_tokens=True)["input_ids"]
    width = cfg.seq_len + 1
    if not cfg.pack:
        return [torch.tensor(ids[:width]) for ids in encoded if len(ids) >= 2]
    stream: list[int] = []
    for ids in encoded:
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    count = len(stream) // width
    return list(torch.tensor(stream[: count * width]).view(count, width))


def collate(samples: list[torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample; padded positions are masked from attention and loss."""
    length = max(len(s) for s in samples) - 1
    batch = len(samples)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, sample in enumerate(samples):
        n = len(sample) - 1
        input_ids[i, :n] = sample[:-1]
        labels[i, :n] = sample[1:]
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask}


@dataclass
class GlobalBatches:
    """Step s uses the global samples [s*G, (s+1)*G) of a seeded per-epoch permutation; rank r takes its
    contiguous `per_rank` share, cut into micro-batches. The position is just the step (world-size free)."""

    samples: list[torch.Tensor]
    micro_batch_size: int
    accumulation_steps: int
    data_parallel_size: int
    data_parallel_rank: int
    seed: int
    shuffle: bool
    pad_id: int

    def __post_init__(self) -> None:
        if self.steps_per_epoch == 0:
            raise UserError(f"data: the dataset yields {len(self.samples)} samples, fewer than one global batch of "
                            f"{self.global_batch_size} (per_device_train_batch_size x gradient_accumulation_steps x ranks)")
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
        indices = order[start: start + per_rank].tolist()
        return [collate([self.samples[i] for i in indices[m: m + self.micro_batch_size]], self.pad_id)
                for m in range(0, per_rank, self.micro_batch_size)]
