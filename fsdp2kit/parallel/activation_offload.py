"""`apply_activation_offload`: the tensors a planned module saves for backward wait in host memory (MindSpeed-MM's
`activation_offload_plan`).

During a planned module's forward, autograd's saved-tensor hooks hand every saved activation (not parameters: FSDP
frees and regathers those itself) to a `Transfer`, which starts its copy to the host. The device tensor is released
when the next planned module starts, once its copy has finished, so the copy overlaps the module's own compute. In
backward, the first saved tensor a module needs brings all of that module's tensors back and starts the previous
module's (the next to run backward): one module of prefetch. The last planned module keeps its tensors: its backward
comes first. With recompute on the same module this wraps the checkpoint, so only the checkpoint's inputs move.

The transfer is injectable: `PinnedHost` (CUDA: pinned host memory, a side stream and events), `HostCopy` (a
synchronous copy, to test the hooks on a CPU) and `Departed` (only the shape is kept: what `fsdp2kit plan` traces
with fake tensors, where the bytes leave the device)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.autograd.graph import saved_tensors_hooks

from fsdp2kit.parallel.forward_patch import Forward, replace_forward


@dataclass
class Copy:
    """A tensor being copied, and the event its copy records (None: already done)."""

    tensor: torch.Tensor
    done: Any = None


class Transfer(Protocol):
    def to_host(self, tensor: torch.Tensor) -> Copy: ...

    def to_device(self, host: torch.Tensor, device: torch.device) -> Copy: ...

    def wait(self, copy: Copy) -> None:
        """The compute stream waits for the copy (its source may then be freed, its result read)."""


class PinnedHost:
    """CUDA: copies on a side stream to and from pinned host memory. Device tensors are allocated on the compute
    stream, so freeing them follows the compute stream's order once it has waited for the copy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> Copy:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            target.copy_(source, non_blocking=True)
            return Copy(target, self.stream.record_event())

    def to_host(self, tensor: torch.Tensor) -> Copy:
        return self._copy(torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True), tensor)

    def to_device(self, host: torch.Tensor, device: torch.device) -> Copy:
        return self._copy(torch.empty(host.shape, dtype=host.dtype, device=device), host)

    def wait(self, copy: Copy) -> None:
        if copy.done is not None:
            torch.cuda.current_stream(self.device).wait_event(copy.done)


class HostCopy:
    """A synchronous copy into memory of its own: the hooks' behaviour on a CPU, where nothing needs to move."""

    def to_host(self, tensor: torch.Tensor) -> Copy:
        return Copy(tensor.detach().clone())

    def to_device(self, host: torch.Tensor, device: torch.device) -> Copy:
        return Copy(host.clone())

    def wait(self, copy: Copy) -> None:
        return None


class Departed:
    """Keeps nothing but the shape, and brings back an empty tensor of it: memory accounting under fake tensors."""

    def to_host(self, tensor: torch.Tensor) -> Copy:
        return Copy(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"))

    def to_device(self, host: torch.Tensor, device: torch.device) -> Copy:
        return Copy(torch.empty(host.shape, dtype=host.dtype, device=device))

    def wait(self, copy: Copy) -> None:
        return None


@dataclass(eq=False)
class Offloaded:
    """One saved tensor while its module's backward has not started: the host copy, the device tensor until that
    copy has finished, then the tensor brought back."""

    module: int
    host: Copy
    device_tensor: torch.Tensor | None
    device: torch.device
    restored: Copy | None = None


def _movable(tensor: torch.Tensor, device: torch.device) -> bool:
    """Activations on the compute device; a parameter (or a view of one, as `linear` saves `weight.t()`) stays."""
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter):
        return False
    return tensor.device.type == device.type and tensor.numel() > 0


@dataclass
class ActivationOffload:
    """The hooks' state for one model: each planned module's tensors by module index (forward order)."""

    transfer: Transfer
    device: torch.device
    last: int  # the last planned module keeps its tensors
    away: dict[int, dict[int, Offloaded]] = field(default_factory=dict)  # module -> id(tensor) -> its copy
    counts: dict[str, int] = field(default_factory=lambda: {"offloaded": 0, "restored": 0})

    def release(self, keep: int) -> None:
        """Every module's device tensors but `keep`'s are given up, once their copies have finished reading them."""
        for module, items in self.away.items():
            if module == keep:
                continue
            for item in items.values():
                if item.device_tensor is not None:
                    self.transfer.wait(item.host)
                    item.device_tensor = None

    def pack(self, module: int, tensor: torch.Tensor) -> Any:
        if module == self.last or not _movable(tensor, self.device):
            return tensor
        items = self.away.setdefault(module, {})
        if id(tensor) not in items:  # the same tensor saved by several ops moves once
            items[id(tensor)] = Offloaded(module, self.transfer.to_host(tensor), tensor, tensor.device)
            self.counts["offloaded"] += 1
        return items[id(tensor)]

    def bring_back(self, module: int) -> None:
        """Start the copies of all of `module`'s tensors (allocated now: they are needed next)."""
        for item in self.away.pop(module, {}).values():
            self._restore(item)

    def _restore(self, item: Offloaded) -> None:
        if item.restored is not None:
            return
        if item.device_tensor is not None:  # not released yet (no planned module ran after it)
            item.restored = Copy(item.device_tensor)
        else:
            item.restored = self.transfer.to_device(item.host.tensor, item.device)
        item.device_tensor = None
        self.counts["restored"] += 1

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        self.bring_back(packed.module)
        self.bring_back(packed.module - 1)  # prefetch: the module whose backward runs next
        self._restore(packed)  # a tensor of a forward whose module ran again before this backward
        assert packed.restored is not None
        self.transfer.wait(packed.restored)
        return packed.restored.tensor

    def forward_of(self, index: int, forward: Forward) -> Forward:
        def offloaded(*args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():
                return forward(*args, **kwargs)
            self.release(keep=index)
            self.away.pop(index, None)  # a previous forward of this module whose backward did not run
            with saved_tensors_hooks(lambda tensor: self.pack(index, tensor), self.unpack):
                return forward(*args, **kwargs)

        return offloaded


def apply_activation_offload(
    model: nn.Module, module_names: list[str], transfer: Transfer, device: torch.device
) -> ActivationOffload | None:
    """Each named module (in forward order) sends the tensors it saves for backward through `transfer`; the state
    is returned for inspection (None when no module is named)."""
    if not module_names:
        return None
    state = ActivationOffload(transfer, device, last=len(module_names) - 1)
    index = {id(model.get_submodule(name)): i for i, name in enumerate(module_names)}
    replace_forward(model, module_names, lambda module, forward: state.forward_of(index[id(module)], forward))
    return state
