"""One rank of tests/test_ulysses.py's head-split case, launched as `python tests/ulysses_heads_worker.py OUT` under
torchrun with 4 ranks: the Ulysses attention function alone, in float64, on each rank's quarter of a sequence, against
the same attention over the whole sequence in one piece, for head counts 4 does not divide (uneven heads per rank,
GQA with repeated key/value heads, GPT-OSS's per-head sinks) and one it does. Rank 0 saves, per case, the largest
difference of the output and of the gradients of query, key, value (and the sinks) to OUT."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from transformers import GptOssConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, eager_attention_forward

from fsdp2kit.parallel.sequence_layout import remember_tokens
from fsdp2kit.parallel.ulysses import _ulysses_attention

DIM = 8
CASES = {  # name: (query heads, key/value heads, inner attention)
    "6 heads, 3 kv (2, 2, 1, 1)": (6, 3, "sdpa"),
    "5 heads, 1 kv (2, 1, 1, 1)": (5, 1, "sdpa"),
    "8 heads, 2 kv (aligned)": (8, 2, "sdpa"),
    "6 heads, 2 kv, GPT-OSS sinks, eager": (6, 2, "eager"),
}


def attention_module(heads: int, kv_heads: int, inner: str) -> Any:
    """What the inner attention reads of the module: GPT-OSS's own attention (its sinks, random) for eager."""
    if inner == "sdpa":
        return SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    config = GptOssConfig(
        hidden_size=16, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=DIM, num_hidden_layers=1
    )
    module = GptOssAttention(config, 0).double()
    with torch.no_grad():
        module.sinks.normal_()
    return module


def whole(module: Any, inner: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The attention over the whole sequence in one piece, causal."""
    if inner == "sdpa":
        return sdpa_attention_forward(module, query, key, value, None, is_causal=True)[0]
    length = query.shape[2]
    future = torch.ones(length, length, dtype=torch.bool).tril().logical_not()
    causal = torch.zeros(length, length, dtype=query.dtype).masked_fill(future, torch.finfo(query.dtype).min)
    return eager_attention_forward(module, query, key, value, causal[None, None], scaling=DIM**-0.5)[0]


def differences(heads: int, kv_heads: int, inner: str, group: dist.ProcessGroup) -> dict[str, float]:
    size, rank = group.size(), group.rank()
    length = 3 * size
    torch.manual_seed(0)
    module = attention_module(heads, kv_heads, inner)
    tensors = [torch.randn(2, count, length, DIM, dtype=torch.float64) for count in (heads, kv_heads, kv_heads)]
    weights = torch.randn(2, length, heads, DIM, dtype=torch.float64)
    full = [t.clone().requires_grad_() for t in tensors]
    (whole(module, inner, *full) * weights).sum().backward()
    sinks = getattr(module, "sinks", None)
    expected_sinks = None if sinks is None else sinks.grad.clone()
    if sinks is not None:
        sinks.grad = None
    local = slice(rank * length // size, (rank + 1) * length // size)
    parts = [t[:, :, local].clone().requires_grad_() for t in tensors]
    remember_tokens(group, torch.ones(2, length, dtype=torch.bool), None)  # causal alone
    output, _ = _ulysses_attention(inner, group)(module, *parts, None, scaling=DIM**-0.5)
    (output * weights[:, local]).sum().backward()
    seen = {"output": (output - whole(module, inner, *tensors)[:, local]).abs().max()}
    for name, part, one in zip(("query", "key", "value"), parts, full, strict=True):
        seen[name] = (part.grad - one.grad[:, :, local]).abs().max()  # type: ignore[index]
    if sinks is not None:
        dist.all_reduce(sinks.grad, group=group)  # each rank's part: the gradient of its own heads' sinks
        seen["sinks"] = (sinks.grad - expected_sinks).abs().max()
    largest = torch.stack(list(seen.values()))
    dist.all_reduce(largest, dist.ReduceOp.MAX, group=group)
    return dict(zip(seen, largest.tolist(), strict=True))


def run(out: str) -> None:
    dist.init_process_group("gloo")
    group = dist.new_group(list(range(dist.get_world_size())))
    seen = {name: differences(*case, group) for name, case in CASES.items()}
    if dist.get_rank() == 0:
        torch.save(seen, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    run(sys.argv[1])
