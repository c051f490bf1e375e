"""The chunked LM head's cost in an RL training step (`Strategy.train_step` with a policy loss on log-probs): the
chunks' log-softmax kept from the forward for the backward (what fsdp2kit does where the logits fit in one chunk's
budget) against each chunk's logits recomputed in backward (what it did before, and still does beyond the budget).

One process, one Strategy: the two settings alternate step by step on the same batches (the order flipped every
pair), so the machine's drift hits both. The model is issue 52's shape: a ~23M Llama (hidden 384, 6 layers,
16384-token untied vocabulary), fp32, 8 rollouts of 256-512 tokens (right-padded to 512) a step, 2 micro-batches.
Prints one JSON object: median wall and CPU seconds per step for each setting and their ratio, the head's matmuls
per step, and each setting's peak of the chunk logits it holds.

Run: .venv/bin/python benchmarks/logprob_head.py [--pairs 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import load_average, model_folder  # noqa: E402

SHAPE = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 6,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "vocab_size": 16384,
    "tie_word_embeddings": False,
}
ROLLOUTS, LONGEST, SHORTEST = 8, 512, 256


def rollouts(seed: int) -> dict[str, torch.Tensor]:
    """8 prompt+response rows of 256-512 tokens, right-padded; advantages per row, the prompt (first 64) no target."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, SHAPE["vocab_size"], (ROLLOUTS, LONGEST), generator=generator)
    lengths = torch.randint(SHORTEST, LONGEST + 1, (ROLLOUTS,), generator=generator)
    mask = (torch.arange(LONGEST)[None] < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "advantages": torch.randn(ROLLOUTS, generator=generator)}


def policy_loss(log_probs: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE on the response tokens: -sum(advantage x log p) over them, weighted by their count."""
    targets = batch["attention_mask"][:, 1:].clone()
    targets[:, :63] = 0
    loss_sum = -(log_probs * batch["advantages"][:, None] * targets).sum()
    return loss_sum, targets.sum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=6, help="timed steps of each setting (after one warm-up each)")
    args = parser.parse_args()
    import fsdp2kit
    from fsdp2kit.distributed import shutdown
    from fsdp2kit.parallel import token_logprobs

    head_matmuls = [0]
    chunk_logits = token_logprobs._logits

    def counted(*args: object) -> object:
        head_matmuls[0] += 1
        return chunk_logits(*args)  # type: ignore[arg-type]

    token_logprobs._logits = counted  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as workdir:
        model = model_folder(Path(workdir), SHAPE, "llama23m-v16k")
        config = {
            "model": {"name_or_path": str(model), "attn_implementation": "sdpa"},
            "training": {"learning_rate": 1e-5, "lr_scheduler_type": "constant", "max_steps": 100},
        }
        strategy = fsdp2kit.Strategy.from_config(config)
        budget = strategy.kept_logits_bytes
        settings = {"kept": budget, "recomputed": 0}
        seconds: dict[str, list[float]] = {name: [] for name in settings}
        cpu: dict[str, list[float]] = {name: [] for name in settings}
        matmuls: dict[str, int] = {}
        try:
            for pair in range(args.pairs + 1):
                batch = rollouts(pair)
                micro = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
                order = list(settings) if pair % 2 == 0 else list(settings)[::-1]
                for name in order:
                    strategy.kept_logits_bytes = settings[name]
                    head_matmuls[0] = 0
                    wall, process = time.perf_counter(), time.process_time()
                    strategy.train_step(micro, policy_loss)
                    if pair:  # the first pair warms up
                        seconds[name].append(time.perf_counter() - wall)
                        cpu[name].append(time.process_time() - process)
                    matmuls[name] = head_matmuls[0]
        finally:
            shutdown()
    median = {name: statistics.median(values) for name, values in seconds.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    tokens = ROLLOUTS * (LONGEST - 1)
    print(
        json.dumps(
            {
                "benchmark": "logprob_head",
                "model": {**SHAPE, "parameters_m": 23},
                "step": f"{ROLLOUTS} rollouts x {LONGEST} tokens, 2 micro-batches, fp32, 1 rank",
                "seconds_per_step": median,
                "cpu_seconds_per_step": median_cpu,
                "kept_over_recomputed_time": median["kept"] / median["recomputed"],
                "kept_over_recomputed_cpu": median_cpu["kept"] / median_cpu["recomputed"],
                "head_logit_computations_per_step": matmuls,
                "kept_logits_mib_per_micro_batch": tokens // 2 * SHAPE["vocab_size"] * 4 / 2**20,
                "budget_mib": budget / 2**20,
                "load_average": load_average(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
