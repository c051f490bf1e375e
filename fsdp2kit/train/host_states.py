"""Training states (parameters, gradients, optimizer state) moved to host memory and back, fast and bitwise: an RL
loop frees the accelerator for its rollout engine every iteration, so the move is on its critical path.

Every tensor keeps its identity: each device storage's bytes are copied into host buffers and the storage is
resized to nothing (as FSDP frees its unsharded parameters), and on the way back it is resized and refilled. No
module, parameter, DTensor or optimizer-state entry is rebuilt, so nothing that refers to them (FSDP's groups, the
optimizer, compiled code) sees a change. The host buffers are slabs allocated once (pinned on CUDA, so copies run
asynchronously at the link's speed) and reused by every later move; the copies are queued without waiting, and
the caller ends each move with one synchronisation (or none, to overlap it with other work)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

# One host slab: a power of two (torch's pinned allocator rounds each allocation up to one, so any other size wastes
# up to half of it), large enough that a copy is long, small enough that the last one wastes little.
SLAB_BYTES = 256 << 20


@dataclass(frozen=True)
class Segment:
    """Bytes [start, start + nbytes) of one storage go to bytes [slab_start, ...) of one slab."""

    storage: int  # index into the moved storages
    start: int
    slab: int
    slab_start: int
    nbytes: int


def copy_plan(storage_bytes: list[int], slab_bytes: list[int]) -> list[Segment]:
    """The storages laid end to end over the slabs in order: a storage larger than what is left of a slab continues
    in the next one. The slabs must hold the total."""
    if sum(storage_bytes) > sum(slab_bytes):
        raise ValueError(f"{sum(storage_bytes)} bytes do not fit in slabs of {sum(slab_bytes)} bytes")
    segments = []
    slab, used = 0, 0
    for index, size in enumerate(storage_bytes):
        start = 0
        while start < size:
            if used == slab_bytes[slab]:
                slab, used = slab + 1, 0
                continue
            nbytes = min(size - start, slab_bytes[slab] - used)
            segments.append(Segment(index, start, slab, used, nbytes))
            start, used = start + nbytes, used + nbytes
    return segments


def slab_sizes(total: int, have: list[int], slab_bytes: int = SLAB_BYTES) -> list[int]:
    """The sizes of the slabs to add to `have` so that all hold `total` bytes: full slabs, and the last one the
    smallest power of two that holds the rest."""
    added: list[int] = []
    missing = total - sum(have)
    while missing > 0:
        size = min(slab_bytes, 1 << (missing - 1).bit_length())
        added.append(size)
        missing -= size
    return added


def state_tensors(model: nn.Module, optimizer: torch.optim.Optimizer | None, kind: str) -> list[torch.Tensor]:
    """What one kind of state is: `model_params` are the parameters (this rank's shards), their gradients if any,
    and the buffers; `optimizer_states` the optimizer's moments and steps. A forward without backward leaves the
    root's parameters gathered: they are resharded first, so that only the shards remain to move."""
    if kind == "optimizer_states":
        states = optimizer.state.values() if optimizer is not None else []
        return [value for state in states for value in state.values() if isinstance(value, torch.Tensor)]
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    params = list(model.parameters())
    return [*params, *(p.grad for p in params if p.grad is not None), *model.buffers()]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class HostStates:
    """Tensors' device memory parked in reused host slabs: `offload` then `load` restores every byte."""

    def __init__(self, device: torch.device, slab_bytes: int = SLAB_BYTES) -> None:
        self.device = device
        self.slab_bytes = slab_bytes
        self.slabs: list[torch.Tensor] = []
        self._parked: list[torch.UntypedStorage] = []  # the storages now emptied, in plan order
        self._sizes: list[int] = []  # their sizes in bytes
        self._plan: list[Segment] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._parked)

    def offload(self, tensors: Iterable[torch.Tensor]) -> int:
        """Queue the copies of the storages of `tensors` that live on the device (each once, however many tensors
        view it) to the host slabs and free them; returns the bytes moved. The caller synchronises the device once
        before reading the slabs (`load` needs no wait: its copies queue behind these). A second offload before
        `load` moves nothing."""
        if self.offloaded:
            return 0
        storages = self._device_storages(tensors)
        sizes = [storage.nbytes() for storage in storages]
        self._grow(sum(sizes))
        plan = copy_plan(sizes, [slab.numel() for slab in self.slabs])
        views = [_bytes(storage) for storage in storages]
        for segment in plan:
            self._slab_part(segment).copy_(views[segment.storage][segment.start :][: segment.nbytes], non_blocking=True)
        for view, storage in zip(views, storages, strict=True):
            if view.is_cuda:  # freed now, its memory is not reused by any stream before the copy has read it
                view.record_stream(torch.cuda.current_stream(view.device))
            storage.resize_(0)
        self._parked, self._sizes, self._plan = storages, sizes, plan
        return sum(sizes)

    def load(self) -> int:
        """Refill every storage `offload` emptied from the host slabs (the copies queued on the device's current
        stream, ahead of anything that reads them); returns the bytes moved."""
        storages, sizes, plan = self._parked, self._sizes, self._plan
        for storage, size in zip(storages, sizes, strict=True):
            storage.resize_(size)
        views = [_bytes(storage) for storage in storages]
        for segment in plan:
            views[segment.storage][segment.start :][: segment.nbytes].copy_(self._slab_part(segment), non_blocking=True)
        self._parked, self._sizes, self._plan = [], [], []
        return sum(sizes)

    def _device_storages(self, tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            storage = _local(tensor).untyped_storage()
            if storage.device.type == self.device.type and storage.nbytes() > 0:  # one device per rank
                seen.setdefault(storage.data_ptr(), storage)
        return list(seen.values())

    def _grow(self, total: int) -> None:
        pin = self.device.type == "cuda"
        for size in slab_sizes(total, [slab.numel() for slab in self.slabs], self.slab_bytes):
            self.slabs.append(torch.empty(size, dtype=torch.uint8, pin_memory=pin))

    def _slab_part(self, segment: Segment) -> torch.Tensor:
        return self.slabs[segment.slab][segment.slab_start :][: segment.nbytes]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A storage's bytes as a flat uint8 tensor on its device."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))
