"""Context parallel's keys and values (`model.context_parallel_size`): each of the c ranks of a group attends for its
own queries over every key of the sequence, so the attention wrapper (parallel/ulysses.py) all-gathers keys and values
over the group (`_GatherKeys`, whose gradient is a reduce-scatter) and keeps only the rank's own block of them for the
backward, gathering them again there (`_gathered_again_in_backward`), so that what a layer keeps shrinks with c.

The rest of context parallel: which tokens a rank holds (the load-balanced chunks) is parallel/sequence_layout.py's
`token_order`; the masks over the gathered keys parallel/sequence_masks.py's; causal attention over them block by
block without a dense mask (CPU) parallel/context_attention.py; the groups parallel/mesh.py's `sequence_subgroups`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup


def _all_gathered(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Keys or values [batch, heads, seq/c, dim] all-gathered along the sequence over `group`, in rank order."""
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=2)


class _GatherKeys(torch.autograd.Function):
    """Keys or values [batch, heads, seq/c, dim] all-gathered along the sequence over the context-parallel group,
    in rank order. Its gradient: each rank's block gets the sum of every rank's gradient of it (a reduce-scatter,
    written as an all-to-all and a sum, which gloo runs too)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gathered(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        send = torch.stack(grad.chunk(ctx.group.size(), dim=2)).contiguous()
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=ctx.group)
        return received.sum(0), None


class _RankBlock(NamedTuple):
    """What a rank keeps for the backward in place of a gathered key or value (or a view of one: a row of the
    batch): its own block of it, and where the saved tensor lies in the gathered one."""

    block: torch.Tensor
    group: ProcessGroup
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt


@contextmanager
def _gathered_again_in_backward(
    group: ProcessGroup | None, pairs: list[tuple[torch.Tensor, torch.Tensor]]
) -> Iterator[None]:
    """Around the attention over keys and values all-gathered over the context-parallel `group` (`pairs`: each
    gathered tensor and this rank's block of it): whatever the attention saves of them for its backward is kept as
    the rank's block and gathered again when the backward reads it, as ring attention passes the blocks around again
    in its backward (torch's `context_parallel`). What a layer keeps for backward then shrinks with c (the gathered
    keys and values were the one part that did not), at one more all-gather of them per layer. Saved-tensor hooks do
    not nest (the innermost pair takes everything saved inside it): where another pair is active (recompute's, which
    drops what the attention saves until the backward; activation offload's, which moves it), ours would keep what
    that one drops or moves, so everything is left to it."""
    if group is None or _other_saved_tensors_hooks():
        yield
        return

    def pack(tensor: torch.Tensor) -> Any:
        for full, block in pairs:
            if tensor is full or tensor._base is full:  # the blocks of packed rows save a row's view
                return _RankBlock(block, group, tensor.size(), tensor.stride(), tensor.storage_offset())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, _gather_again):
        try:
            yield
        finally:
            pairs.clear()  # the hooks outlive the call (each saved tensor holds them): not the gathered tensors


def _other_saved_tensors_hooks() -> bool:
    """Whether saved-tensor hooks are active around this call. torch 2.6 and 2.7 lack the (private) query: there the
    answer is yes, which keeps the gathered tensors, as before."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(True) is not None


def _gather_again(saved: Any) -> torch.Tensor:
    """A saved tensor as the backward reads it: a gathered one (or its view) from the ranks' blocks again, laid out as
    the one the forward gathered (`torch.cat`'s contiguous result)."""
    if not isinstance(saved, _RankBlock):
        return saved
    return _all_gathered(saved.block, saved.group).as_strided(saved.size, saved.stride, saved.offset)
