"""GRPO with fsdp2kit as the training back-end, the way an RL framework's workers drive it (CPU or GPUs).

Each step, on every rank: a rollout model (plain transformers, its weights refreshed from the actor through
`Strategy.full_weights`) samples a group of completions for each prompt; a rule scores them (the reward is the
fraction of completion tokens equal to one chosen token); advantages are normalised within each group; a reference
`fsdp2_infer` strategy gives the reference log-probs of the KL term; and the actor's `Strategy.train_step` takes the
clipped-ratio loss. A tiny model learns this from scratch in a minute or two. Every tensor lives on the actor's
device, so the same script runs on GPUs.

    python examples/rl_grpo.py --nproc 2 --steps 40 --output-dir runs/rl_grpo

writes OUTPUT_DIR/metrics.jsonl (step, reward, kl, loss), one line per step, and prints the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp2kit

VOCAB = 32  # a small vocabulary: a random policy already says the rewarded token now and then
TARGET = 7  # the rewarded token
PROMPT, COMPLETION = 4, 8  # tokens
CLIP, KL_COEF = 0.2, 0.02


def model_config(strategy_name: str, steps: int, output_dir: str) -> dict[str, Any]:
    tiny = {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return {
        "model": {"name_or_path": "builtin:tiny-llama", "config": tiny},
        "training": {
            "learning_rate": 3e-3,
            "lr_scheduler_type": "constant",
            "max_steps": steps,
            "max_grad_norm": 1.0,
            "seed": 0,
            "output_dir": output_dir,
        },
        "strategy_args": {"strategy_name": strategy_name},
    }


@torch.no_grad()
def sample(rollout: torch.nn.Module, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Completions drawn token by token from the rollout model's own distribution (temperature 1)."""
    sequences = prompts
    for _ in range(COMPLETION):
        logits = rollout(input_ids=sequences).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        sequences = torch.cat([sequences, token], dim=1)
    return sequences


def grpo_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped-ratio surrogate with group-normalised advantages and a k3 KL to the reference, over the completion
    tokens: (their summed loss, their count)."""
    mask = batch["completion_mask"]
    ratio = torch.exp(log_probs - batch["old_log_probs"])
    advantages = batch["advantages"][:, None]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    delta = batch["ref_log_probs"] - log_probs
    kl = torch.exp(delta) - delta - 1
    return ((-surrogate + KL_COEF * kl) * mask).sum(), mask.sum()


def rollout_batch(
    actor: fsdp2kit.Strategy,
    reference: fsdp2kit.Strategy,
    rollout: torch.nn.Module,
    args: argparse.Namespace,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Sample, score and annotate one batch of groups: the micro-batch that train_step gets, on the rollout's
    device (the generator's)."""
    device = generator.device
    prompts = torch.randint(3, VOCAB, (args.prompts, PROMPT), generator=generator, device=device)
    sequences = sample(rollout, prompts.repeat_interleave(args.group, 0), generator)
    completion = sequences[:, PROMPT:]
    reward = (completion == TARGET).float().mean(dim=1)
    groups = reward.view(args.prompts, args.group)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1, device=device)
    mask[:, PROMPT - 1 :] = 1.0  # log_probs[:, t] scores token t + 1: the completion's tokens
    batch = {"input_ids": sequences, "completion_mask": mask, "advantages": advantages, "reward": reward}
    batch["old_log_probs"] = actor.forward_step(batch)["log_probs"]
    batch["ref_log_probs"] = reference.forward_step(batch)["log_probs"]
    return batch


def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    actor = fsdp2kit.Strategy.from_config(model_config("fsdp2_train", args.steps, args.output_dir))
    reference = fsdp2kit.Strategy.from_config(model_config("fsdp2_infer", args.steps, args.output_dir))
    device = actor.runtime.device  # each rank's rollout engine shares its accelerator with the actor
    rollout = AutoModelForCausalLM.from_config(actor.sharded.source.hf_config).to(device).eval()
    rank = dist.get_rank()
    generator = torch.Generator(device).manual_seed(1234 + rank)
    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    for step in range(1, args.steps + 1):
        rollout.load_state_dict(dict(actor.full_weights()))  # every rank keeps its rollout engine in sync
        batch = rollout_batch(actor, reference, rollout, args, generator)
        result = actor.train_step([batch], grpo_loss)
        mask = batch["completion_mask"]
        delta = batch["ref_log_probs"] - batch["old_log_probs"]
        stats = torch.stack([batch["reward"].mean(), ((delta.exp() - delta - 1) * mask).sum() / mask.sum()])
        dist.all_reduce(stats)
        reward, kl = (stats / dist.get_world_size()).tolist()
        record = {"step": step, "reward": reward, "kl": kl, "loss": result["loss"]}
        if rank == 0:
            print(json.dumps(record), flush=True)
            with (out / "metrics.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (torch's elastic launcher)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", default="runs/rl_grpo")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank and step")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    args = parser.parse_args()
    if args.nproc > 1 and "RANK" not in os.environ:  # the launcher: start the ranks, each running this script
        from fsdp2kit.distributed import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
        launcher += ["--master-port", str(free_port()), __file__]
        launcher += ["--steps", str(args.steps), "--output-dir", args.output_dir]
        launcher += ["--prompts", str(args.prompts), "--group", str(args.group)]
        raise SystemExit(subprocess.call(launcher, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        train(args)
    finally:
        from fsdp2kit.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    main()
