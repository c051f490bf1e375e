"""What a trainer rank sends a rollout engine in a weight sync: `WeightMessage`s, each a list of blocks of HF
tensors (whole values, or the positions and values that changed) with a CRC-32 over everything it carries, and its
bytes for a transport (safetensors, its header as metadata). A message read from bytes is checked before anything in
it is believed: a flipped byte, a truncated message or a crafted one is a `CorruptMessage`, never a wrong tensor."""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, cast

import torch

FORMAT = "fsdp2kit-weight-sync/1"
# Which weights a sync carries: the whole model in HF names, or only a LoRA run's adapters in peft's file names.
PARTS = ("model", "adapter")
# The integer type of each element size: positions that changed are found by comparing bits, not values (a NaN
# equals itself, -0.0 differs from 0.0), so the receiver ends with exactly the bits a full sync would give.
BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2)
}
# The types a block's gaps between changed positions may take, smallest first (signed: torch has no uint16 math).
GAP_TYPES = (torch.uint8, torch.int16, torch.int32, torch.int64)


class CorruptMessage(ValueError):
    """A message whose bytes or checksum do not hold together: dropped, and its sync with it."""


@dataclass
class Block:
    """A block of one tensor: `full[offset[0] : offset[0] + shape[0], ...]`. `gaps` None: `values` is the whole block,
    row-major; else `values[i]` is the block's element at flat position `start + gaps[0] + ... + gaps[i]`: the
    changed positions in order, each as its distance from the one before, in the smallest integer type that holds the
    largest (`GAP_TYPES`): two bytes a position where changes are a few percent of the values, not four or eight."""

    name: str
    full_shape: tuple[int, ...]
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    values: torch.Tensor
    gaps: torch.Tensor | None = None
    start: int = 0

    @property
    def nbytes(self) -> int:
        extra = 0 if self.gaps is None else self.gaps.nbytes
        return self.values.nbytes + extra

    def positions(self) -> torch.Tensor:
        """The changed elements' flat positions in the block (int64)."""
        assert self.gaps is not None, "a whole block has no positions"
        return self.start + torch.cumsum(self.gaps.to(torch.int64), 0)

    def header(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "full_shape": list(self.full_shape),
            "offset": list(self.offset),
            "shape": list(self.shape),
            "dtype": str(self.values.dtype).removeprefix("torch."),
            "sparse": self.gaps is not None,
            "start": self.start,
        }


@dataclass
class WeightMessage:
    """One message of one sync. A sync (`sync_id`, the same on every sender rank) brings the receiver to `version`
    (the trainer's step): from nothing (`base_version` None: every block whole, and together they cover every
    tensor) or from `base_version` (only what changed). Each sender rank numbers its messages (`index`) and says
    on its last how many it sent (`count`), so the receiver knows when the sync is whole."""

    sync_id: int
    version: int
    base_version: int | None
    part: str
    sender: int
    senders: int
    index: int
    count: int | None
    blocks: list[Block] = field(default_factory=list)
    config: dict[str, Any] | None = None
    checksum: int = 0

    @property
    def nbytes(self) -> int:
        """The tensors' bytes: what the message moves besides its small header."""
        return sum(block.nbytes for block in self.blocks)

    def header(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "sync_id": self.sync_id,
            "version": self.version,
            "base_version": self.base_version,
            "part": self.part,
            "sender": self.sender,
            "senders": self.senders,
            "index": self.index,
            "count": self.count,
            "config": self.config,
            "blocks": [block.header() for block in self.blocks],
        }

    def computed_checksum(self) -> int:
        """CRC-32 over the header (less the checksum) and every tensor's bytes, in order."""
        crc = zlib.crc32(json.dumps(self.header(), sort_keys=True).encode())
        for tensor in self._tensors().values():
            crc = zlib.crc32(_bytes_of(tensor), crc)
        return crc

    def seal(self) -> WeightMessage:
        self.checksum = self.computed_checksum()
        return self

    def verify(self) -> None:
        """Raise CorruptMessage unless the checksum holds (an in-memory message is checked as one read from bytes)."""
        if self.checksum != self.computed_checksum():
            raise CorruptMessage(
                f"weight sync message {self.index} of rank {self.sender} (version {self.version}): checksum mismatch"
            )

    def _tensors(self) -> dict[str, torch.Tensor]:
        tensors = {}
        for i, block in enumerate(self.blocks):
            tensors[f"v{i}"] = block.values
            if block.gaps is not None:
                tensors[f"p{i}"] = block.gaps
        return tensors

    def to_bytes(self) -> bytes:
        """The message for a transport: safetensors bytes, the header and checksum in its metadata."""
        from safetensors.torch import save

        header = {**self.header(), "checksum": self.checksum}
        tensors = {key: tensor.contiguous() for key, tensor in self._tensors().items()}
        return save(tensors, metadata={"weight_sync": json.dumps(header, sort_keys=True)})

    @classmethod
    def from_bytes(cls, data: bytes) -> WeightMessage:
        """A message read back and checked: its checksum, and that every block's shapes, dtype and positions fit the
        tensor it names (bounded work whatever the bytes are)."""
        from safetensors import SafetensorError
        from safetensors.torch import load

        try:
            header = json.loads(_metadata(data)["weight_sync"])
            tensors = load(data)
            message = _message(header, tensors)
        except (SafetensorError, ValueError, KeyError, TypeError, OverflowError, RuntimeError) as exc:
            raise CorruptMessage(f"weight sync message unreadable ({type(exc).__name__}: {exc})") from None
        message.verify()
        return message


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's metadata, read as safetensors lays it out (8-byte little-endian length, JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    length = int.from_bytes(data[:8], "little")
    if length > len(data) - 8:
        raise ValueError("header longer than the message")
    metadata = json.loads(data[8 : 8 + length]).get("__metadata__")
    if not isinstance(metadata, dict) or not isinstance(metadata.get("weight_sync"), str):
        raise ValueError("no weight_sync header")
    return metadata


def _message(header: dict[str, Any], tensors: dict[str, torch.Tensor]) -> WeightMessage:
    if header.get("format") != FORMAT or header.get("part") not in PARTS:
        raise ValueError(f"format {header.get('format')!r}, part {header.get('part')!r}")
    blocks = [_block(entry, i, tensors) for i, entry in enumerate(header["blocks"])]
    ints = ("sync_id", "version", "sender", "senders", "index")
    if not all(isinstance(header[key], int) for key in ints) or not 0 <= header["sender"] < header["senders"]:
        raise ValueError("sync, version or sender numbers")
    count = _optional_int(header["count"])
    if header["index"] < 0 or (count is not None and count <= header["index"]):
        raise ValueError(f"message {header['index']} of a count of {count}")
    message = WeightMessage(
        **{key: header[key] for key in ints},
        base_version=_optional_int(header["base_version"]),
        part=header["part"],
        count=count,
        blocks=blocks,
        config=header["config"],
        checksum=int(header["checksum"]),
    )
    return message


def _optional_int(value: Any) -> int | None:
    if value is not None and not isinstance(value, int):
        raise ValueError(f"{value!r} is not a number")
    return value


def _block(entry: dict[str, Any], i: int, tensors: dict[str, torch.Tensor]) -> Block:
    """One block from its header entry and tensors, its sizes checked against each other."""
    full_shape, offset, shape = (tuple(int(x) for x in entry[key]) for key in ("full_shape", "offset", "shape"))
    if not len(full_shape) == len(offset) == len(shape):
        raise ValueError(f"block {entry['name']!r}: shapes of different ranks")
    if any(o < 0 or s < 0 or o + s > f for o, s, f in zip(offset, shape, full_shape, strict=True)):
        raise ValueError(f"block {entry['name']!r}: {shape} at {offset} is outside {full_shape}")
    values = tensors[f"v{i}"]
    if str(values.dtype).removeprefix("torch.") != entry["dtype"] or values.dim() != 1:
        raise ValueError(f"block {entry['name']!r}: values of another dtype or shape")
    gaps = tensors[f"p{i}"] if entry["sparse"] else None
    numel = math.prod(shape)
    if gaps is None and values.numel() != numel:
        raise ValueError(f"block {entry['name']!r}: {values.numel()} values for {numel} elements")
    block = Block(str(entry["name"]), full_shape, offset, shape, values, gaps, int(entry["start"]))
    if gaps is not None:
        _check_gaps(block, numel)
    return block


def _check_gaps(block: Block, numel: int) -> None:
    """Positions strictly increasing inside the block, one per value."""
    gaps = cast(torch.Tensor, block.gaps)
    if gaps.dtype not in GAP_TYPES or gaps.shape != block.values.shape or gaps.numel() == 0:
        raise ValueError(f"block {block.name!r}: positions do not match the values")
    if not 0 <= block.start < numel or int(gaps[0]) != 0 or (gaps.numel() > 1 and int(gaps[1:].min()) < 1):
        raise ValueError(f"block {block.name!r}: positions out of order")
    if block.start + int(gaps.to(torch.int64).sum()) >= numel:
        raise ValueError(f"block {block.name!r}: a position outside the block")


def _bytes_of(tensor: torch.Tensor) -> Any:
    """A tensor's bytes (a buffer zlib reads), without a copy where it is contiguous on the host."""
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
