"""The global gradient norm over parameters sharded on different device meshes (the layout expert parallelism
gives: dense parts on the FSDP mesh, experts on their own mesh) equals the plain norm of the same gradients."""

from __future__ import annotations

import torch
from conftest import process_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp2kit.train.grads import clip_grad_norm


def test_norm_and_clipping_over_shards_on_two_meshes():
    grads = [torch.arange(4.0), torch.arange(8.0).reshape(4, 2), torch.full((3,), 2.0)]
    with process_group():
        dense = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        experts = init_device_mesh("cpu", (1, 1), mesh_dim_names=("efsdp", "ep"))
        params = [
            distribute_tensor(torch.zeros(4), dense, [Shard(0)]),
            distribute_tensor(torch.zeros(4, 2), experts, [Shard(0), Shard(0)]),
            torch.zeros(3),  # replicated (an ignored module's)
        ]
        for param, grad in zip(params, grads, strict=True):
            sharded = hasattr(param, "device_mesh")
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements) if sharded else grad.clone()
        norm = clip_grad_norm(params, max_norm=1.0)
        clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    expected = torch.cat([g.flatten() for g in grads]).norm()
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    scale = 1.0 / (expected + 1e-6)
    for got, grad in zip(clipped, grads, strict=True):
        torch.testing.assert_close(got, grad * scale, rtol=1e-6, atol=1e-7)
