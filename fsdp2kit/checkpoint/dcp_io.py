"""Reading DCP checkpoints without running code from them.

DCP pickles a checkpoint's `.metadata` and its non-tensor values (optimizer hyper-parameters); a plain unpickler
runs whatever a crafted file asks for. Checkpoints are shared as model sources, so every read here goes through
`SafeFileSystemReader` (metadata: only DCP's own metadata classes) and `SafeLoadPlanner` (values: torch's
weights-only unpickler). A leaf module: torch and fsdp2kit.errors only.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from fsdp2kit.errors import UserError

METADATA_FILE = ".metadata"

# Everything DCP's FileSystemWriter pickles into `.metadata` (torch 2.13): its metadata dataclasses, the storage
# index of the filesystem writer, sizes, dtypes, layouts and the checkpoint path it was written to.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("pathlib", "PosixPath"): Path,
    ("pathlib", "WindowsPath"): Path,
    ("pathlib", "PurePosixPath"): Path,
    ("pathlib", "PureWindowsPath"): Path,
    ("collections", "OrderedDict"): dict,
}


class UnsafeCheckpoint(pickle.UnpicklingError):
    """A checkpoint's metadata names something a DCP checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpoint(
            f"it asks to load '{module}.{name}', which no DCP checkpoint holds; refusing to unpickle it "
            "(a crafted checkpoint can run code that way)"
        )


class SafeFileSystemReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` unpickled by an allow-list of DCP's metadata classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpoint(f"it holds a {type(metadata).__name__}, not DCP metadata")
        if metadata.storage_meta is None:  # as DCP's own reader does: the load id marks this read
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, but a checkpoint's non-tensor values must pass torch's weights-only unpickler first
    (DCP itself reads them with `weights_only=False`)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint(
                f"its value '{read_item.dest_index.fqn}' is not plain data; refusing to unpickle it "
                "(a crafted checkpoint can run code that way)"
            ) from None
        value.seek(0)
        super().load_bytes(read_item, value)


def failure_reason(exc: BaseException) -> str:
    """The last line of an exception's message. DCP's CheckpointException holds each failed rank's
    (exception, stack summary): the first rank's exception is the reason, its frames are noise."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = str(exc).strip()
    return text.splitlines()[-1][:300] if text else type(exc).__name__


def read_metadata(folder: Path, error_prefix: str) -> Metadata:
    """A checkpoint's DCP metadata, or one UserError sentence."""
    try:
        return SafeFileSystemReader(str(folder)).read_metadata()
    except Exception as exc:  # missing, truncated, not a pickle, or not DCP's
        raise UserError(f"{error_prefix}: '{folder / METADATA_FILE}' cannot be read: {failure_reason(exc)}") from None


def damage(folder: Path) -> str | None:
    """Why a checkpoint cannot be read in full, without reading its tensors: unreadable metadata, or a data file
    that is missing or shorter than the metadata says (a deleted or truncated shard). None when it looks whole."""
    try:
        metadata = read_metadata(folder, "checkpoint")
    except UserError as exc:
        return str(exc).removeprefix("checkpoint: ")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = folder / name
        if not file.is_file():
            return f"'{file}' is missing"
        if file.stat().st_size < size:
            return f"'{file}' is truncated ({file.stat().st_size} of {size} bytes)"
    return None


def read_dcp(state: dict, folder: Path, error_prefix: str, no_dist: bool = False) -> None:
    """`dcp.load` into `state` in place; any failure (missing key or rank file, shape mismatch, truncated file,
    unsafe metadata) becomes one UserError sentence. DCP raises CheckpointException, a BaseException. The metadata
    is read first on its own: DCP would log a failed read with its traceback before falling back to per-rank files."""
    read_metadata(folder, error_prefix)
    try:
        dcp.load(
            state,
            storage_reader=SafeFileSystemReader(str(folder)),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
    except (Exception, CheckpointException) as exc:  # a damaged file is named, rather than a bare EOFError
        raise UserError(f"{error_prefix}: {damage(folder) or failure_reason(exc)}") from None


MODEL_PREFIX = "model."
LOAD_GROUP_BYTES = 1024**3


def is_dcp(path: Path) -> bool:
    return (path / METADATA_FILE).is_file()


def model_tensors(src: Path) -> dict[str, dcp_metadata.TensorStorageMetadata]:
    """The model tensors a checkpoint holds, by name, with their sizes and dtypes (read from .metadata only)."""
    metadata = read_metadata(src, "convert")
    return {
        key[len(MODEL_PREFIX) :]: meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and isinstance(meta, dcp_metadata.TensorStorageMetadata)
    }


def read_dcp_model(
    src: Path, names: list[str], tensors: dict[str, dcp_metadata.TensorStorageMetadata]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors from a sharded checkpoint, loaded in groups of about LOAD_GROUP_BYTES."""
    group: dict[str, torch.Tensor] = {}
    size = 0
    for i, name in enumerate(names):
        meta = tensors[name]
        group[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
        size += group[name].numel() * group[name].element_size()
        if size >= LOAD_GROUP_BYTES or i == len(names) - 1:
            read_dcp({"model": group}, src, f"convert: checkpoint '{src}' is incomplete or corrupt", no_dist=True)
            yield from group.items()
            group, size = {}, 0


def stored_model_keys(path: Path, cannot_load: str) -> set[str]:
    """The names of the model tensors a checkpoint holds (from its .metadata); `cannot_load` prefixes a failure."""
    stored = read_metadata(path, cannot_load).state_dict_metadata
    return {key[len(MODEL_PREFIX) :] for key in stored if key.startswith(MODEL_PREFIX)}


def refuse_extra_model_tensors(path: Path, model_keys: set[str] | dict[str, Any], cannot_load: str) -> None:
    """DCP loads the tensors a state dict asks for and ignores the rest: a checkpoint of a larger model (more layers,
    another head) would load into this one truncated, without a word. Refused, naming the first extra tensor."""
    extra = sorted(key for key in stored_model_keys(path, cannot_load) if key not in model_keys)
    if extra:
        raise UserError(
            f"{cannot_load}: it holds {len(extra)} model tensors this model lacks (first '{extra[0]}'), so it was "
            "saved from another model; give the same model and model.config"
        )
