"""NO_SHARD on gloo: every rank keeps whole parameters and the replicas average their gradients as
DistributedDataParallel does, with asynchronous all-reduces that overlap the rest of backward.

FSDP2's own replication (HSDP on a [replicas, 1] mesh) issues each group's all-reduce as a blocking call. On CUDA
that call only enqueues work on a side stream, so backward goes on; on gloo it holds the backward thread until the
slowest replica reaches the same group, at every group. Here each group is sharded over a shard group of one (this
rank: no collective) and its gradients, once FSDP has laid them out, are all-reduced without waiting; the waits
come together at the end of backward, before anything reads a gradient."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule


def replicas_reduce_asynchronously(mesh: DeviceMesh) -> bool:
    """A [replicas, 1] mesh of several replicas on gloo (the CPU): the layout NO_SHARD and fsdp_size 1 give."""
    return mesh.device_type == "cpu" and mesh.ndim == 2 and mesh.size(1) == 1 and mesh.size(0) > 1


def shard_group_of_one(mesh: DeviceMesh) -> DeviceMesh:
    """The mesh each group is sharded over: this rank alone (its replica's shard dimension)."""
    assert mesh.mesh_dim_names is not None  # build_mesh names every dimension
    return mesh[mesh.mesh_dim_names[1]]


class ReplicaAllReduce:
    """The gradient all-reduce over the replicas, one per shard group: FSDP calls `hook_for(group)` with the
    group's laid-out gradient buffer, whose views become the gradients.

    The all-reduce may run while backward goes on only when nothing reads that buffer before the end of backward:
    FSDP casts it right away when it reduces in another dtype than the master weights, and adds it to a gradient
    already there (a micro-batch reduced before, with sync_each_batch); then it is waited for at once."""

    def __init__(self, mesh: DeviceMesh, buffer_is_the_gradient: bool):
        self.group = mesh.get_group(0)
        self.buffer_is_the_gradient = buffer_is_the_gradient
        self.pending: list[dist.Work] = []

    def hook_for(self, module: FSDPModule) -> Callable[[torch.Tensor], None]:
        group = module._get_fsdp_state()._fsdp_param_group  # the one group (torch 2.11: an attribute; 2.13: a property)
        params = [p.sharded_param for p in group.fsdp_params] if group is not None else []

        def all_reduce(buffer: torch.Tensor) -> None:
            work = dist.all_reduce(buffer, op=dist.ReduceOp.AVG, group=self.group, async_op=True)
            overlaps = self.buffer_is_the_gradient and all(p.grad is None for p in params)
            if overlaps and torch._C._current_graph_task_id() != -1:  # inside backward: wait at its end
                if not self.pending:
                    torch.autograd.Variable._execution_engine.queue_callback(self.wait)
                self.pending.append(work)
            else:
                work.wait()

        return all_reduce

    def wait(self) -> None:
        works, self.pending = self.pending, []
        for work in works:
            work.wait()


def reduce_across_replicas(groups: list[FSDPModule], mesh: DeviceMesh, buffer_is_the_gradient: bool) -> None:
    """Give each shard group (the root included) the replicas' all-reduce."""
    reducer = ReplicaAllReduce(mesh, buffer_is_the_gradient)
    for module in groups:
        module.set_all_reduce_hook(reducer.hook_for(module))
