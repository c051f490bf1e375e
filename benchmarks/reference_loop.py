"""The hand-written training loops fsdp2kit is compared with, one rank of them (start it with torchrun).

Each takes the same HF model folder (same initial weights), the same micro-batches (fsdp2kit's data pipeline, so the
tokens are identical), AdamW with the same settings, a constant learning rate, clipping at 1.0, and the loss summed
over tokens and divided by the global target-token count, as fsdp2kit does:

- `fsdp2`: `fully_shard` on each decoder layer, then the root (about 30 lines: what a user would write by hand);
- `fsdp1`: torch's `FullyShardedDataParallel`, FULL_SHARD, transformer auto-wrap on the decoder layer class;
- `ddp`: torch's `DistributedDataParallel` as it comes, `no_sync` while accumulating (what NO_SHARD is measured by);
- `accelerate`: `Accelerator().prepare(...)` with `accumulate()`; on a CPU-only machine Accelerate runs DDP.

With `--without-position-ids` the packed rows go in without their position ids (each row one causal sequence, as
a minimal loop on packed data often feeds them). With `--synthetic-batches` the micro-batches are random tokens made
up front (no data pipeline at all), and with
`--track-memory` the whole loop runs under torch's MemTracker (live tensor bytes, the base class of the tracker
fsdp2kit's `training.track_memory` uses).

Rank 0 writes one JSON object to --out: per-step tokens/s and losses, its peak memory, and Accelerate's mode.
On a GPU each rank uses its CUDA device (NCCL); on CPU, gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AutoModelForCausalLM


def micro_batches_per_step(args: argparse.Namespace, rank: int, world_size: int):
    from fsdp2kit.config.schema import DataConfig
    from fsdp2kit.data.builtin import tokenizer_dir
    from fsdp2kit.data.dataset import load_tokenizer
    from fsdp2kit.data.samples import GlobalBatches, TrainingSamples

    data = DataConfig(source="builtin:corpus", seq_len=args.seq_len)
    tokenizer = load_tokenizer(tokenizer_dir())
    samples = TrainingSamples.from_config(data, tokenizer)
    batches = GlobalBatches(
        samples, args.batch, args.accumulation, world_size, rank, args.seed, True, tokenizer.pad_token_id or 0
    )
    return [batches.micro_batches(step) for step in range(args.steps)]


def synthetic_micro_batches(args: argparse.Namespace, rank: int, vocab: int):
    """`--synthetic-batches`: random tokens of the same shapes, made before the loop, no data pipeline at all
    (labels are the next token, the last position without a target)."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    steps = []
    for _ in range(args.steps):
        step = []
        for _ in range(args.accumulation):
            input_ids = torch.randint(vocab, (args.batch, args.seq_len), generator=generator)
            labels = torch.roll(input_ids, -1, dims=1)
            labels[:, -1] = -100
            step.append({"input_ids": input_ids, "labels": labels})
        steps.append(step)
    return steps


def loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction="sum")


def wrap(model: torch.nn.Module, impl: str, device: torch.device, bf16: bool = False, compile_layers: bool = False):
    """The model as each stack shards it, and the clip function it offers. fsdp2 with `bf16` computes in bf16 and
    reduces in fp32 over fp32 weights; with `compile_layers` each decoder layer is compiled before it is sharded."""
    layer_class = type(model.model.layers[0])
    if impl == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        bf16_compute = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
        policy = MixedPrecisionPolicy(**bf16_compute)
        for layer in model.model.layers:
            if compile_layers:
                layer.compile()
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model, torch.nn.utils.clip_grad_norm_
    if impl == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        wrapped = FullyShardedDataParallel(
            model,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_class}),
            device_id=device,
            use_orig_params=True,
        )
        return wrapped, lambda params, norm: wrapped.clip_grad_norm_(norm)
    if impl == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
        return ddp, torch.nn.utils.clip_grad_norm_
    raise ValueError(impl)


@dataclass
class MinimalLoop:
    """What one step of a hand-written loop needs: the wrapped model, its optimizer and clip function, how it turns
    gradient sync off during accumulation (`sync(last)` is entered around each micro-batch) and runs backward."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    clip: Callable
    sync: Callable[[bool], contextlib.AbstractContextManager]
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward
    tracker: Any = None


def fsdp2_sync(model: Any) -> Callable[[bool], contextlib.AbstractContextManager]:
    """`fully_shard`'s switch: reduce-scatter only after the last micro-batch."""

    def sync(last: bool) -> contextlib.AbstractContextManager:
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    return sync


def ddp_sync(model: Any) -> Callable[[bool], contextlib.AbstractContextManager]:
    """DDP's switch: `no_sync` for every micro-batch but the last."""

    def sync(last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else model.no_sync()

    return sync


def minimal_step(loop: MinimalLoop, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float]:
    """One optimizer step over this rank's micro-batches, minimising the summed loss over the global target-token
    count as fsdp2kit does. Returns the step's loss and the tokens of all ranks."""
    world_size = dist.get_world_size()
    device = micro_batches[0]["input_ids"].device
    targets_here = sum(int((mb["labels"] != -100).sum()) for mb in micro_batches)
    counts = torch.tensor(
        [targets_here, sum(mb["input_ids"].numel() for mb in micro_batches)], dtype=torch.float64, device=device
    )
    dist.all_reduce(counts)
    targets, tokens = counts.tolist()
    total = torch.zeros((), dtype=torch.float64, device=device)
    for index, batch in enumerate(micro_batches):
        with loop.sync(index == len(micro_batches) - 1):
            micro = loss_sum(loop.model, batch)
            loop.backward(micro * world_size / targets)
        total += micro.detach().double()
        if loop.tracker is not None:
            loop.tracker.reset_mod_stats()  # per-module stats of one forward/backward (fsdp2kit does the same)
    dist.all_reduce(total)
    loop.clip(list(loop.model.parameters()), 1.0)
    loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    return total.item() / targets, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=["fsdp2", "fsdp1", "ddp", "accelerate"], required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument(
        "--track-memory",
        action="store_true",
        help="count live tensor bytes (torch's MemTracker, the base of the FSDPMemTracker fsdp2kit uses; slower)",
    )
    parser.add_argument(
        "--synthetic-batches",
        action="store_true",
        help="random token batches made up front instead of fsdp2kit's data pipeline (what the pipeline costs)",
    )
    parser.add_argument(
        "--without-position-ids",
        action="store_true",
        help="feed the packed rows without their position ids: one causal sequence a row, the documents attending "
        "to each other (a minimal loop on packed data as commonly written)",
    )
    parser.add_argument("--bf16", action="store_true", help="fsdp2: bf16 compute, fp32 reduce; fused AdamW on CUDA")
    parser.add_argument("--compile", action="store_true", help="fsdp2: each decoder layer compiled (torch.compile)")
    parser.add_argument(
        "--allocator",
        choices=["glibc", "return", "fsdp2kit"],
        default="glibc",
        help="glibc's own settings (a loop as a user writes it), large frees always returned to the OS "
        "(fsdp2kit before), or fsdp2kit's: one heap, returned while loading, reused by the steps "
        "(benchmarks/mallopt_cost.py)",
    )
    args = parser.parse_args()
    from fsdp2kit.distributed import return_large_frees_to_os, reuse_freed_memory, share_one_heap

    if args.allocator == "fsdp2kit":
        share_one_heap()
    if args.allocator != "glibc":
        return_large_frees_to_os()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    accelerator = None
    if args.impl == "accelerate":
        from accelerate import Accelerator

        accelerator = Accelerator(gradient_accumulation_steps=args.accumulation, cpu=not cuda)
    else:
        if cuda:
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device)
    if args.synthetic_batches:
        steps = synthetic_micro_batches(args, rank, model.config.vocab_size)
    else:
        steps = micro_batches_per_step(args, rank, world_size)
    if args.without_position_ids:
        steps = [[{k: v for k, v in mb.items() if k != "position_ids"} for mb in step] for step in steps]
    model.train()
    if accelerator is None:
        model, clip = wrap(model, args.impl, device, args.bf16, args.compile)
        fused = {"fused": True} if args.bf16 and cuda else {"foreach": True}
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, **fused)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, foreach=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        clip = accelerator.clip_grad_norm_

    tracker = None
    if args.track_memory:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        if args.impl == "fsdp1":
            # use_orig_params: a module's parameters are non-leaf views of the flat parameter during its forward,
            # where no grad hook can go. Every byte is still counted (grads as the allocations they are), only
            # gradients are not told apart from temporaries.
            track = tracker._track_module_params_and_buffers
            tracker._track_module_params_and_buffers = lambda module, install_grad_hooks=True: track(module, False)
        tracker.track_external(model, optimizer)
        tracker.__enter__()
    if args.allocator == "fsdp2kit":
        reuse_freed_memory(device)
    loop = MinimalLoop(model, optimizer, clip, lambda last: contextlib.nullcontext(), tracker=tracker)
    if accelerator is not None:
        # Accelerate divides the loss by the accumulation steps itself: undo that to match the others.
        loop.sync = lambda last: accelerator.accumulate(model)
        loop.backward = lambda loss: accelerator.backward(loss * args.accumulation)
    elif args.impl == "fsdp2":
        loop.sync = fsdp2_sync(model)
    elif args.impl == "ddp":
        loop.sync = ddp_sync(model)
    tokens_per_s, losses = [], []
    for micro_batches in steps:
        started = time.perf_counter()
        loss, tokens = minimal_step(loop, [{k: v.to(device) for k, v in mb.items()} for mb in micro_batches])
        losses.append(loss)
        tokens_per_s.append(tokens / (time.perf_counter() - started))
    if tracker is not None:
        tracker.__exit__(None, None, None)
    if rank == 0:
        result = {
            "tokens_per_s": tokens_per_s,
            "losses": losses,
            # the CUDA allocator's peak on a GPU, the process's peak RSS on CPU (as fsdp2kit's peak_rss_bytes)
            "peak_mem_bytes": torch.cuda.max_memory_allocated(device)
            if cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        }
        if tracker is not None:
            from fsdp2kit.train.memory import tracker_peak

            peak = tracker_peak(tracker, device)
            result["tracked_peak_bytes"] = peak.pop("total", 0)
            result["tracked_peak_categories"] = peak
        if accelerator is not None:
            result["accelerate_mode"] = str(accelerator.distributed_type).rsplit(".", 1)[-1]
        with open(args.out, "w") as handle:
            json.dump(result, handle)
    if os.environ.get("WORLD_SIZE") and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
