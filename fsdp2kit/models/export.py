"""Write a model as an HF safetensors folder (config, weights, tokenizer) that `transformers` loads.

Tensors are streamed: gathered one at a time and flushed to `model-0000k-of-0000n.safetensors` files of at most
`max_shard_bytes`, so rank 0 never holds more than one shard file plus one tensor — never the whole model."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.durable import as_the_umask_allows, disk_full_message, ran_out_of_space
from fsdp2kit.errors import RunFault
from fsdp2kit.models.build import tied_weight_names
from fsdp2kit.models.hf_layout import ModelShapes, layout_of, renamed_only, stored_tensors
from fsdp2kit.models.lora import merged_full_tensor, merged_state
from fsdp2kit.models.shards import WeightShard, shard_of
from fsdp2kit.parallel.module_paths import model_class_name

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MAX_SHARD_BYTES = 2 * 1024**3
PART_FILES = ".part-*.safetensors"  # shard files being written, renamed to their names by `SafetensorsWriter.close`
# The weights files of an export (save_pretrained's names): one of another shard count left in the folder would be
# read beside this one's (a stale index names files this export did not write).
WEIGHT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "added_tokens.json",
    "chat_template.json",
    "preprocessor_config.json",  # a vision-language model's image processor, video processor and processor
    "video_preprocessor_config.json",
    "processor_config.json",
)


class SafetensorsWriter:
    """Collects tensors into shard files as they arrive; `close()` names the files and writes the index, and
    `abandon()` removes what an export that did not finish wrote."""

    def __init__(self, out_dir: Path, max_shard_bytes: int = MAX_SHARD_BYTES):
        self.out_dir = out_dir
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[list[str]] = []
        self.total_bytes = 0
        self.named: list[Path] = []  # the weights files `close` has written under their names
        self.made_folder = not out_dir.exists()
        out_dir.mkdir(parents=True, exist_ok=True)
        _remove_part_files(out_dir)  # of an export killed outright (SIGKILL), which could not remove its own

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        from safetensors.torch import save_file

        save_file(self.pending, str(self.out_dir / f".part-{len(self.files)}.safetensors"), metadata={"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> None:
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
        )
        for stale in self.out_dir.iterdir():  # an earlier export's weights: never mixed with this one's
            if WEIGHT_FILES.fullmatch(stale.name) and stale.is_file():
                stale.unlink()
        for i, name in enumerate(names):
            as_the_umask_allows(self.out_dir / f".part-{i}.safetensors")
            os.replace(self.out_dir / f".part-{i}.safetensors", self.out_dir / name)
            self.named.append(self.out_dir / name)
        if count > 1:
            weight_map = {tensor: names[i] for i, tensors in enumerate(self.files) for tensor in tensors}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            self.named.append(self.out_dir / "model.safetensors.index.json")
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    def abandon(self) -> None:
        """Remove the weights of an export that did not finish (an interrupt, a full disk): its shard files being
        written and those `close` had named, and the folder if it made it and nothing else is there; an earlier
        export's weights are left as they were until `close`."""
        _remove_part_files(self.out_dir)
        for path in self.named:
            path.unlink(missing_ok=True)
        if self.made_folder and not any(self.out_dir.iterdir()):
            self.out_dir.rmdir()


def _remove_part_files(out_dir: Path) -> None:
    for partial in out_dir.glob(PART_FILES):
        partial.unlink(missing_ok=True)


def copy_present_files(src: Path, dst: Path, names: Iterable[str]) -> None:
    """Copy those of `names` that exist in `src` (a tokenizer has some of TOKENIZER_FILES, never all)."""
    for name in names:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def write_config_and_tokenizer(
    out_dir: Path,
    hf_config: PretrainedConfig,
    tokenizer_path: Path | None,
    dtype: torch.dtype,
    architecture: str | None = None,
) -> None:
    """config.json (in `dtype`; `architecture`: the class that holds the weights, as `save_pretrained` names it: a
    critic started from a causal LM's folder is no longer its source's class) and the tokenizer's files."""
    hf_config = copy.deepcopy(hf_config)
    hf_config.dtype = dtype
    if architecture is not None:
        hf_config.architectures = [architecture]
    hf_config.save_pretrained(out_dir)
    if tokenizer_path is not None:
        copy_present_files(tokenizer_path, out_dir, TOKENIZER_FILES)


@torch.no_grad()
def hf_tensors(
    model: nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model whole, as the family's `save_pretrained` writes it (`hf_layout`: fused experts as
    per-expert tensors, renamed keys): a LoRA model's with its adapters merged into the base weights, a tied output
    weight once, under its source. A collective: all ranks iterate it to the end, each tensor all-gathered in turn
    (a conversion group, such as one layer's fused experts, is held until it is whole)."""
    state, names, layout = _exported_state(model)
    yield from stored_tensors(_gathered(state, names, dtype, device), names, layout)


@torch.no_grad()
def hf_shards(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[WeightShard]:
    """The model as `hf_tensors` gives it, each rank yielding only its own blocks, in the same order on every rank.
    A tensor the HF folder stores as the model holds it (under its name or a renamed one) is this rank's FSDP shard,
    gathered by no one, copied (in `dtype`).
    A tensor that is joined or split to be stored (fused experts), or a LoRA layer's merged weight, is gathered as
    `hf_tensors` gathers it (a collective) and sent by one rank, in turn, from its whole copy."""
    state, names, layout = _exported_state(model)
    stored_as = renamed_only(names, layout)
    own = [name for name in names if name in stored_as and state[name][1] is None]
    for name in own:
        yield shard_of(stored_as[name], state[name][0].detach(), dtype)
    joined = [name for name in names if name not in set(own)]
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    for index, (name, full) in enumerate(stored_tensors(_gathered(state, joined), joined, layout)):
        whole = full.to(dtype or full.dtype, copy=True)
        yield WeightShard(name, whole, tuple(full.shape), (0,) * full.dim(), index % world == rank)


def _exported_state(model: nn.Module) -> tuple[dict[str, Any], list[str], ModelShapes]:
    """The model's tensors under their own names with the LoRA layers that merge into them, the names an export
    holds (a tied output weight once, under its source) and the HF layout over them."""
    state = merged_state(model)
    names = [name for name in state if name not in tied_weight_names(model)]
    return state, names, layout_of(model, {n: t for n, (t, _) in state.items()})


def _gathered(
    state: dict[str, Any],
    names: list[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each of `names` whole, its adapter merged in (every rank joins each gather), in `dtype` on `device`."""
    for name in names:
        full = merged_full_tensor(*state[name]).detach()
        yield name, full.to(device=device or full.device, dtype=dtype or full.dtype)


@torch.no_grad()
def export_hf(
    model: nn.Module,
    out_dir: Path,
    tokenizer_path: Path,
    dtype: str,
    is_main: bool,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """A collective: every rank must call it, as each sharded tensor is all-gathered by all ranks in turn. Only
    rank 0 (`is_main`) keeps the gathered tensors, on CPU, until their shard file is written; it also writes the
    config and tokenizer. Tensors are stored under the names of the family's HF folders (`save_pretrained`'s), a
    LoRA model's with its adapters merged into the base weights, a tied output weight once, under its source."""
    writer = SafetensorsWriter(out_dir, max_shard_bytes) if is_main else None
    try:
        for name, full in hf_tensors(model, torch_dtype(dtype), device="cpu"):  # all ranks join each all-gather
            if writer is not None:
                writer.add(name, full)
        if writer is not None:
            writer.close()
            config = cast("PretrainedConfig", model.config)
            write_config_and_tokenizer(out_dir, config, tokenizer_path, torch_dtype(dtype), model_class_name(model))
    except BaseException as exc:  # a KeyboardInterrupt too: no partial weights are left, whatever stopped it
        if writer is not None:
            writer.abandon()
        if writer is None or not isinstance(exc, Exception) or not ran_out_of_space(out_dir, exc):
            raise
        needed = sum(t.numel() for t in model.state_dict().values()) * torch_dtype(dtype).itemsize
        intact = "the checkpoints are intact: `fsdp2kit convert CHECKPOINT DST --to hf` writes it from one"
        raise RunFault(disk_full_message(out_dir, "the HF folder", needed, intact)) from None
