"""A tiny Qwen3-MoE whose routers are told where to send the tokens, for tests/test_moe.py (as `model.model_class`).

Routing follows the position of the micro-batch in the global batch of GLOBAL_BATCH one-sample micro-batches,
not the rank that holds it, so every world size sees the same routing and trains to the same losses:
- position 0: every token to experts 0 and 1;
- position 1: the first half of the tokens to experts 2 and 3, the second half to experts 4 and 5.
On 2 ranks (and 6 experts), the ranks use disjoint experts, rank 0 two per layer and rank 1 four: their
per-expert collectives cannot pair up.
The router's own probabilities still weight the chosen experts, so the router keeps learning."""

from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeTopKRouter

GLOBAL_BATCH = 2
ROUTES = [[[0, 1]], [[2, 3], [4, 5]]]  # by position: the expert pair of each equal part of the tokens


class ForcedRoutingQwen3Moe(Qwen3MoeForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.training_forwards = 0
        self.position = 0
        for module in self.modules():
            if isinstance(module, Qwen3MoeTopKRouter):
                module.register_forward_hook(self._route)

    def forward(self, *args, **kwargs):
        if self.training:
            per_rank = GLOBAL_BATCH // dist.get_world_size()
            self.position = dist.get_rank() * per_rank + self.training_forwards % per_rank
            if self.training_forwards == 0:  # tells the test that this rank's first step has begun
                print(
                    f"forced routing: rank {dist.get_rank()}, position {self.position}, experts "
                    f"{ROUTES[self.position]}",
                    flush=True,
                )
            self.training_forwards += 1
        return super().forward(*args, **kwargs)

    def _route(self, router, args, output):
        logits = output[0]
        routes = ROUTES[self.position]
        allowed = torch.zeros_like(logits, dtype=torch.bool)
        for tokens, experts in zip(torch.arange(len(logits)).tensor_split(len(routes)), routes, strict=True):
            allowed[tokens[:, None], torch.tensor(experts)] = True
        probabilities = logits.float().masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        weights, indices = probabilities.topk(router.top_k, dim=-1)
        return logits, weights.to(logits.dtype), indices
