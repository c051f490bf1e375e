"""One context-parallel rank's attention at real lengths on one GPU (issue 48's 32k+ figures; the device here lends
world size 1): what a rank of CP c computes for one layer, its queries (chunks r and 2c-1-r of 2c: `token_order`)
over every key and value of the sequence (as `_GatherKeys` hands them), forward and backward, in bf16, by the path
fsdp2kit takes on CUDA (FlexAttention, compiled, through the block mask of the rank's rows at global indices:
`parallel/sequence_masks.py:_FlexSequenceMask`) and by the one it took before (sdpa with the dense [T/c, T] mask),
beside one unsplit GPU (c = 1: sdpa's causal flash kernel over the whole sequence).

Per (T, c, rank r in {0, c-1}): the peak of allocated memory above the inputs, the median time of --repeats
forward+backward passes after a warm-up (CUDA events), and the largest difference of the two paths' outputs
relative to the largest output. The first and last rank hold the least and most of the causal work's front: their
times should agree (balance). A path that runs out of memory is recorded as such.

The shape: one layer of Qwen2.5-7B (28 heads, 4 key/value heads of 128), batch 1. Prints one JSON object.
Run (on the GPU): python benchmarks/context_parallel_gpu.py [--lengths 32768 65536 131072] [--sizes 1 4 8]
On a CPU (`--device cpu`, small --lengths) it runs forward only, as torch has no CPU backward for FlexAttention: a
check of the script, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM = 28, 4, 128


def rank_inputs(
    length: int, size: int, rank: int, device: torch.device, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, torch.Tensor], list[torch.Tensor]]:
    """The global indices of the rank's queries and of the gathered keys, and its q [1, H, T/c, D] and the gathered
    k, v [1, H_kv, T, D] (bf16; leaves that take gradients on CUDA)."""
    from fsdp2kit.parallel.sequence_layout import token_order

    order = token_order(length, size, 1)
    indices = (order[rank].flatten().to(device), order.flatten().to(device))
    shapes = [(1, HEADS, indices[0].numel(), HEAD_DIM), *[(1, KV_HEADS, length, HEAD_DIM)] * 2]
    tensors = [torch.randn(shape, generator=generator).to(device, torch.bfloat16) for shape in shapes]
    return indices, [t.requires_grad_(device.type == "cuda") for t in tensors]


def flex_path(indices: tuple[torch.Tensor, torch.Tensor], length: int) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """fsdp2kit's CUDA path: the block mask of the rank's rows (made once, as one micro-batch's layers share it)."""
    from fsdp2kit.parallel.document_attention import document_flex_attention
    from fsdp2kit.parallel.sequence_masks import _FlexSequenceMask

    device = indices[0].device
    block_mask = _FlexSequenceMask()(None, 1, indices, length, None, device)
    module = torch.nn.Module()
    return lambda qkv: document_flex_attention(module, *qkv, block_mask)[0]


def dense_path(indices: tuple[torch.Tensor, torch.Tensor]) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """The path before: transformers' sdpa with the dense causal mask by global index (made inside, as each step made
    it), the key/value heads repeated as it repeats them beside a mask."""
    from transformers.integrations.sdpa_attention import repeat_kv

    def attend(qkv: list[torch.Tensor]) -> torch.Tensor:
        q, k, v = qkv
        mask = indices[0][:, None] >= indices[1][None, :]
        k, v = (repeat_kv(t, HEADS // KV_HEADS) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, mask).transpose(1, 2)

    return attend


def unsplit_path(qkv: list[torch.Tensor]) -> torch.Tensor:
    q, k, v = qkv
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


def measure(attend: Callable, qkv: list[torch.Tensor], repeats: int, backward: bool) -> dict[str, Any]:
    """Peak allocated bytes above the inputs and median seconds of a forward (and backward) pass; the output."""
    cuda = qkv[0].is_cuda

    def once() -> torch.Tensor:
        output = attend(qkv)
        if backward:
            output.backward(torch.ones_like(output))
        return output.detach()

    try:
        output = once()  # warm-up: compilation, the block mask's kernels
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated() if cuda else 0
            start = time.perf_counter()
            output = once()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
    except torch.OutOfMemoryError:
        return {"out_of_memory": True}
    finally:
        for t in qkv:
            t.grad = None
    return {"seconds": statistics.median(times), "peak_bytes": peak, "output": output}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 65536, 131072])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    backward = device.type == "cuda"
    rows = []
    for length in args.lengths:
        for size in args.sizes:
            generator = torch.Generator().manual_seed(length + size)
            for rank in sorted({0, size - 1}):
                indices, qkv = rank_inputs(length, size, rank, device, generator)
                row: dict[str, Any] = {"seq_len": length, "context_parallel_size": size, "rank": rank}
                if size == 1:
                    result = measure(unsplit_path, qkv, args.repeats, backward)
                    result.pop("output", None)
                    rows.append({**row, "unsplit_sdpa": result})
                    continue
                flex = measure(flex_path(indices, length), qkv, args.repeats, backward)
                dense = measure(dense_path(indices), qkv, args.repeats, backward)
                got, expected = flex.pop("output", None), dense.pop("output", None)
                if got is not None and expected is not None:
                    scale = float(expected.float().abs().max())
                    row["max_diff_relative"] = float((got.float() - expected.float()).abs().max()) / scale
                rows.append({**row, "flex": flex, "dense_mask": dense})
                print(json.dumps(rows[-1]), flush=True, file=sys.stderr)
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    shape = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bf16", "batch": 1}
    print(json.dumps({"benchmark": "context_parallel_gpu", "device": card, "shape": shape, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
