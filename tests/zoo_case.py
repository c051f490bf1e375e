"""The model zoo tests/test_zoo.py runs through fsdp2kit: one row per transformers causal-LM family, built from a tiny
config and saved by `save_pretrained` (as a downloaded model is), the batches it trains and scores, and the Strategy
config. tests/zoo_worker.py (the 2-rank side) reads the same table."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

LEARNING_RATE = 1e-2
ROWS, LENGTH = 2, 16

# Small enough that a family builds, loads, trains a step and exports in well under a second on one core.
TINY: dict[str, Any] = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "initializer_range": 0.1,  # logits of a few units, so a missed scale or cap shows in every log-prob
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


@dataclass(frozen=True)
class Family:
    """A transformers model_type and the settings its tiny config needs beyond TINY (what makes it differ from
    Llama, where that is a number: a logit scale, a soft-cap)."""

    model_type: str
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.model_type


MOE = {"num_experts": 4, "num_experts_per_tok": 2}
# Multi-head latent attention (low-rank queries and keys/values), one shared expert, layer 0 dense.
DEEPSEEK_V3 = {
    "num_key_value_heads": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "n_group": 1,
    "topk_group": 1,
}

FAMILIES: list[Family] = [
    Family("llama", {"head_dim": 8}),
    Family("mistral", {"head_dim": 8}),
    Family("qwen2"),
    Family("qwen3", {"head_dim": 8}),
    Family("gemma", {"head_dim": 8}),
    Family("gemma2", {"head_dim": 8, "final_logit_softcapping": 2.0, "attn_logit_softcapping": 5.0}),
    Family("gemma3_text", {"head_dim": 8, "final_logit_softcapping": 2.0, "sliding_window": 8}),
    Family("phi3"),
    Family("olmo2"),
    Family("granite", {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "attention_multiplier": 0.5}),
    Family("starcoder2"),
    Family("glm4", {"head_dim": 8}),
    Family("smollm3"),
    Family("cohere", {"logit_scale": 0.5}),
    Family("stablelm"),
    # Mixtures of experts (4 experts, 2 a token), as their checkpoints store the experts (docs/moe.md)
    Family("qwen2_moe", {**MOE, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}),
    Family("qwen3_moe", {**MOE, "head_dim": 8, "moe_intermediate_size": 16}),
    Family("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8}),
    Family("olmoe", MOE),
    Family("deepseek_v3", DEEPSEEK_V3),
    Family("gpt_oss", {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8, "sliding_window": 8}),
]


def family_folder(root: Path, family: Family) -> Path:
    """The family's tiny model with seeded random weights, saved by transformers with the built-in tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.data.builtin import VOCAB_SIZE, tokenizer_dir

    folder = root / family.name
    if (folder / "config.json").is_file():
        return folder
    config = AutoConfig.for_model(family.model_type, vocab_size=VOCAB_SIZE, **{**TINY, **family.config})
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, folder / file.name)
    return folder


def zoo_config(folder: Path, output_dir: Path, ulysses: int = 1) -> dict[str, Any]:
    """The Strategy config every family trains with: one AdamW step at a constant learning rate."""
    return {
        "model": {"name_or_path": str(folder), "ulysses_size": ulysses},
        "training": {
            "learning_rate": LEARNING_RATE,
            "lr_scheduler_type": "constant",
            "max_steps": 1,
            "max_grad_norm": 1.0,
            "loss_chunk_tokens": 8,  # every path through the chunked head, as a large vocabulary takes it
            # AdamW's first step is lr x sign(g) where |g| >> eps: a gradient of float32 noise would move its weight a
            # whole lr, and the comparisons of trained models would compare noise.
            "adam_epsilon": 1e-3,
            "output_dir": str(output_dir),
        },
    }


def zoo_batches(count: int) -> list[dict[str, torch.Tensor]]:
    """`count` seeded micro-batches (the last row right-padded), the same in every process."""
    from fsdp2kit.data.builtin import VOCAB_SIZE

    generator = torch.Generator().manual_seed(11)
    batches = []
    for _ in range(count):
        ids = torch.randint(3, VOCAB_SIZE, (ROWS, LENGTH), generator=generator)
        mask = torch.ones(ROWS, LENGTH, dtype=torch.long)
        mask[-1, LENGTH - 5 :] = 0
        batches.append({"input_ids": ids.masked_fill(mask == 0, 2), "attention_mask": mask})
    return batches


def probe_batch() -> dict[str, torch.Tensor]:
    """The batch whose log-probs are compared: before training, after it, and in transformers."""
    return zoo_batches(3)[-1]


def next_token_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The default loss as a user's loss_fn: -log p summed over the real next tokens, and their count. The same
    number, through the chunked head's per-token log-probs and their backward (the default takes the summed
    cross-entropy's own)."""
    real = batch["attention_mask"][:, 1:].to(log_probs.dtype)
    return -(log_probs * real).sum(), real.sum()


def train_and_score(strategy: Any, micro_batches: list[dict[str, torch.Tensor]], loss_fn: Any = None) -> dict[str, Any]:
    """The probe's log-probs, one optimizer step over this rank's micro-batches, the log-probs after."""
    before = strategy.forward_step(probe_batch())["log_probs"]
    step = strategy.train_step(micro_batches, loss_fn)
    after = strategy.forward_step(probe_batch())["log_probs"]
    return {"before": before, "loss": step["loss"], "grad_norm": step["grad_norm"], "after": after}
