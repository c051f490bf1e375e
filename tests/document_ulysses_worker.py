"""One rank of tests/test_document_attention.py's Ulysses and context-parallel case, launched as `python
tests/document_ulysses_worker.py MODEL_DIR OUT` under torchrun with 2 ranks: fsdp2kit's sharded model at
model.ulysses_size 2 and at model.context_parallel_size 2 on packed documents, each once as the build picks on this CPU
(sdpa: blocks of the fused kernel, a dense document mask only on demand) and once with FlexAttention picked as on
CUDA (forward only: torch has no CPU backward for it). Rank 0 saves each path's whole-sequence logits, its attention,
the kind of mask its batch carried and whether a dense one was made to OUT; and what a training forward at
context_parallel_size 2 kept of the keys and values it gathered, with and without a caller's saved-tensor hooks."""

from __future__ import annotations

import gc
import sys
import weakref

import torch
import torch.distributed as dist
from conftest import sharded_model
from test_document_attention import job, packed_batch

from fsdp2kit.distributed import init_distributed, shutdown
from fsdp2kit.parallel import context_parallel, document_attention
from fsdp2kit.parallel.sequence_layout import gathered_order, sequence_mask


@torch.no_grad()
def sequence_logits(model_dir: str, parallel: str) -> dict[str, object]:
    """The packed batch's logits through the build's own Ulysses or context-parallel (`parallel`) path: each rank's
    share, gathered in rank order and put back in the sequence's."""
    sharded = sharded_model(job(model_dir, **{parallel: 2}), init_distributed(None), training=False)
    ids, positions = packed_batch()
    shard = sharded.variant.shard_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, sharded.sp_group)
    local = sharded.model(**{k: v for k, v in shard.items() if k != "labels"}, use_cache=False).logits
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, local.contiguous())
    assert "attention_mask" not in shard  # the wrapper reads the group's mask; the model gets none
    mask = sequence_mask(sharded.sp_group)
    order = gathered_order(sharded.sp_group)
    logits = torch.cat(pieces, 1)
    return {
        "logits": logits if order is None else logits[:, torch.argsort(order)],
        "attention": sharded.model.config._attn_implementation,
        "mask": type(mask).__name__,
        "mask_made": getattr(mask, "_mask", None) is not None,  # a dense mask on demand that an attention call made
    }


def kept_for_backward(model_dir: str) -> dict[str, object]:
    """At context_parallel_size 2, a training forward of the packed batch: how many keys and values the attention
    all-gathered, how many of those are still alive after it (it keeps the rank's block of them for its backward),
    and whether the backward (which gathers them again) gave every parameter a finite gradient; then the sequence
    lengths of what the same forward saves under a caller's saved-tensor hooks (as recompute's or activation
    offload's), which must get everything, the gathered tensors too."""
    sharded = sharded_model(job(model_dir, context_parallel_size=2), init_distributed(None), training=True)
    ids, positions = packed_batch()
    shard = sharded.variant.shard_batch({"input_ids": ids, "labels": ids, "position_ids": positions}, sharded.sp_group)
    inputs = {k: v for k, v in shard.items() if k != "labels"}
    gathered: list[weakref.ref] = []
    gather = context_parallel._GatherKeys.apply

    def recorded(x: torch.Tensor, group: object) -> torch.Tensor:
        out = gather(x, group)
        gathered.append(weakref.ref(out))
        return out

    context_parallel._GatherKeys.apply = recorded  # type: ignore[method-assign]
    logits = sharded.model(**inputs, use_cache=False).logits
    gc.collect()
    alive = sum(ref() is not None for ref in gathered)
    logits.float().square().mean().backward()
    grads = [p.grad for p in sharded.model.parameters()]
    finite = all(g is not None and bool(torch.isfinite(g.full_tensor()).all()) for g in grads)
    context_parallel._GatherKeys.apply = gather  # type: ignore[method-assign]
    lengths: set[int] = set()

    def record(tensor: torch.Tensor) -> torch.Tensor:
        lengths.update([tensor.shape[2]] if tensor.dim() == 4 else [])
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(record, lambda tensor: tensor):
        sharded.model(**inputs, use_cache=False)
    return {"gathered": len(gathered), "alive": alive, "finite": finite, "length": ids.shape[1], "hooked": lengths}


def run(model_dir: str, out: str) -> None:
    parallel = ("ulysses_size", "context_parallel_size")
    seen = {f"dense {name}": sequence_logits(model_dir, name) for name in parallel}
    seen["kept context_parallel_size"] = kept_for_backward(model_dir)
    flex = (document_attention.DOCUMENT_FLEX, "as on CUDA")
    document_attention.document_path = lambda *_: flex  # type: ignore[assignment]
    seen.update({f"flex {name}": sequence_logits(model_dir, name) for name in parallel})
    if dist.get_rank() == 0:
        torch.save(seen, out)
    shutdown()


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
