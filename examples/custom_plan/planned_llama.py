"""A Llama that brings its own sharding plan, as MindSpeed-MM's `FSDP2Mixin._fully_shard` does.

fsdp2kit builds this class instead of `AutoModelForCausalLM` when the config names it
(`model.model_class: examples/custom_plan/planned_llama.py:PlannedLlamaForCausalLM`), and then calls
`_fully_shard` in place of its own plan. The YAML keeps only the base keys (mesh, dtypes, reshard, prefetch).
"""

from __future__ import annotations

from torch.distributed.fsdp import fully_shard
from transformers import LlamaForCausalLM


class PlannedLlamaForCausalLM(LlamaForCausalLM):
    def _fully_shard(self, fsdp_kwargs: dict) -> None:
        """Shard groups finer than one per decoder layer: each layer's attention and MLP on their own, and the
        input embeddings and the LM head on their own.

        `fsdp_kwargs` holds what the config asked for: mesh, mp_policy, reshard_after_forward, offload_policy and
        ignored_params. Call `fully_shard` bottom-up (inner modules first); fsdp2kit shards the root afterwards,
        with whatever no group took (here the layer norms)."""
        fully_shard(self.model.embed_tokens, **fsdp_kwargs)
        for layer in self.model.layers:
            fully_shard(layer.self_attn, **fsdp_kwargs)
            fully_shard(layer.mlp, **fsdp_kwargs)
        fully_shard(self.lm_head, **fsdp_kwargs)
