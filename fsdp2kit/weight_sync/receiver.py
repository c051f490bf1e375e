"""The rollout side of a weight sync: `WeightReceiver` applies `WeightMessage`s to a model's tensors (a
`transformers` model's by HF name, or a peft model's adapters by peft's file names), one version at a time.

A sync's messages are held until every sender's are in and each checksum holds, then applied together: the tensors
never hold a mix of two versions, and a sync with a lost or damaged message is never applied (its version is never
reached, which the receiver's `version` tells the trainer; the trainer then sends the next version whole)."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from fsdp2kit.weight_sync.messages import Block, CorruptMessage, WeightMessage

log = logging.getLogger("fsdp2kit.weight_sync")


@dataclass
class _Sync:
    """The messages of one sync so far, by sender and index, and each sender's count once its last is in."""

    first: WeightMessage
    messages: dict[tuple[int, int], WeightMessage] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, message: WeightMessage) -> None:
        same = (message.version, message.base_version, message.part, message.senders)
        if same != (self.first.version, self.first.base_version, self.first.part, self.first.senders):
            raise CorruptMessage(f"weight sync {message.sync_id}: messages of two versions or senders")
        if (message.sender, message.index) in self.messages:
            raise CorruptMessage(
                f"weight sync {message.sync_id}: message {message.index} of rank {message.sender} twice"
            )
        self.messages[(message.sender, message.index)] = message
        if message.count is not None:
            self.counts[message.sender] = message.count

    @property
    def whole(self) -> bool:
        senders = self.first.senders
        if len(self.counts) < senders:
            return False
        return all((rank, i) in self.messages for rank in range(senders) for i in range(self.counts[rank]))


class WeightReceiver:
    """Holds `tensors` (updated in place, so a model whose tensors they are runs on the new weights) and the version
    they are at (None: no sync applied yet)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], part: str = "model", pending_syncs: int = 2) -> None:
        self.tensors = dict(tensors)
        self.part = part
        self.version: int | None = None
        self.pending: dict[int, _Sync] = {}
        self.pending_syncs = pending_syncs  # syncs held incomplete at once: an older one is dropped (bounded memory)
        self.applied_sync = -1
        self.config: dict | None = None

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> WeightReceiver:
        """A `transformers` model's tensors by their HF names; a tied output weight once, under its source's name
        (as `save_pretrained` and the trainer's exports hold it)."""
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for name, tensor in model.state_dict().items():
            if tensor.untyped_storage().data_ptr() not in seen:
                seen.add(tensor.untyped_storage().data_ptr())
                tensors[name] = tensor
        return cls(tensors)

    @classmethod
    def for_adapter(cls, peft_model: torch.nn.Module) -> WeightReceiver:
        """A `peft.PeftModel`'s adapter tensors under the keys of its adapter_model.safetensors."""
        from peft import get_peft_model_state_dict

        return cls(get_peft_model_state_dict(peft_model), part="adapter")

    def receive(self, message: WeightMessage | bytes) -> int | None:
        """Take one message (as sent, or its bytes); the version reached when it completes a sync, else None. A
        damaged message is dropped with one log line; its sync never completes."""
        try:
            if isinstance(message, bytes):
                message = WeightMessage.from_bytes(message)
            else:
                message.verify()
            if message.sync_id <= self.applied_sync:
                raise CorruptMessage(f"weight sync {message.sync_id}: a message after its sync was applied")
            sync = self.pending.setdefault(message.sync_id, _Sync(message))
            sync.add(message)
        except CorruptMessage as exc:
            log.warning("%s: dropped; the receiver stays at version %s", exc, self.version)
            return None
        self._bound_pending()
        return self._apply(message.sync_id) if sync.whole else None

    def _bound_pending(self) -> None:
        while len(self.pending) > self.pending_syncs:
            oldest = min(self.pending)
            sync = self.pending.pop(oldest)
            log.warning(
                "weight sync %s (version %s) never completed (a message was lost): dropped; the receiver stays at "
                "version %s",
                oldest,
                sync.first.version,
                self.version,
            )

    def _apply(self, sync_id: int) -> int | None:
        sync = self.pending.pop(sync_id)
        for older in [key for key in self.pending if key < sync_id]:
            del self.pending[older]
        self.applied_sync = sync_id
        first = sync.first
        if first.part != self.part:
            raise ValueError(f"weight sync: a sync of the {first.part} weights to a receiver of the {self.part}'s")
        if first.base_version is not None and first.base_version != self.version:
            log.warning(
                "weight sync %s: changes from version %s, but the receiver holds version %s: dropped",
                sync_id,
                first.base_version,
                self.version,
            )
            return None
        blocks = [block for _, message in sorted(sync.messages.items()) for block in message.blocks]
        self._check(blocks, whole=first.base_version is None)
        for block in blocks:
            _apply_block(self.tensors[block.name], block)
        self.version = first.version
        self.config = next((m.config for m in sync.messages.values() if m.config), self.config)
        return self.version

    def _check(self, blocks: list[Block], whole: bool) -> None:
        """Every block names a tensor of ours, of its shape and dtype; a full sync covers every tensor, its blocks
        apart from one another (so that their sizes add up to the tensor's only where they tile it)."""
        placed: dict[str, list[Block]] = {name: [] for name in self.tensors}
        for block in blocks:
            tensor = self.tensors.get(block.name)
            if tensor is None:
                raise ValueError(f"weight sync: '{block.name}' is not a tensor of this receiver's {self.part}")
            if tuple(tensor.shape) != block.full_shape or tensor.dtype != block.values.dtype:
                raise ValueError(
                    f"weight sync: '{block.name}' is {block.values.dtype} {list(block.full_shape)} in the sync, "
                    f"{tensor.dtype} {list(tensor.shape)} here"
                )
            placed[block.name].append(block)
        if whole:
            for name, tensor in self.tensors.items():
                _check_tiling(name, placed[name], tensor.numel())


def _check_tiling(name: str, blocks: list[Block], numel: int) -> None:
    """The blocks of a full sync tile the tensor: no two overlap, and together they hold every element."""
    held = sum(math.prod(block.shape) for block in blocks)
    if held != numel:
        raise ValueError(f"weight sync: a full sync that does not cover '{name}' ({held} of {numel} elements)")
    for i, first in enumerate(blocks):
        for second in blocks[i + 1 :]:
            spans = zip(first.offset, first.shape, second.offset, second.shape, strict=True)
            if all(a < c + n and c < a + m for a, m, c, n in spans):
                raise ValueError(f"weight sync: a full sync with overlapping blocks of '{name}'")


@torch.no_grad()
def _apply_block(tensor: torch.Tensor, block: Block) -> None:
    region = tensor[tuple(slice(o, o + s) for o, s in zip(block.offset, block.shape, strict=True))]
    values = block.values.to(tensor.device)
    if block.gaps is None:
        region.copy_(values.view(block.shape))
        return
    positions = block.positions().to(tensor.device)
    if region.is_contiguous():
        region.view(-1)[positions] = values
        return
    coordinates = torch.stack(torch.unravel_index(positions, block.shape))  # the block's coordinates of each value
    where = coordinates + torch.tensor(block.offset, device=tensor.device)[:, None]
    tensor[tuple(where)] = values
