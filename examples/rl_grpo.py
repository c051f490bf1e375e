"""GRPO with fsdp2kit as the training back-end, the way an RL framework's workers drive it (CPU or GPUs).

Each step, on every rank: a rollout model (plain transformers, its weights refreshed from the actor through
`Strategy.weight_sender`: only what changed) samples a group of completions for each prompt; a rule scores them (the
reward is the fraction of completion tokens equal to one chosen token); advantages are normalised within each group;
a reference `fsdp2_infer` strategy gives the reference log-probs of the KL term; and the actor's
`Strategy.train_step` takes the clipped-ratio loss. A tiny model learns this from scratch in a minute or two. Every
tensor lives on the actor's device, so the same script runs on GPUs.

    python examples/rl_grpo.py --nproc 2 --steps 40 --output-dir runs/rl_grpo

writes OUTPUT_DIR/metrics.jsonl (step, reward, kl, loss), one line per step, and prints the same.
"""

from __future__ import annotations

import argparse

import rl_scaffold as rl
import torch

import fsdp2kit

CLIP, KL_COEF = 0.2, 0.02


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
    prompts = rl.random_prompts(args.prompts, generator).repeat_interleave(args.group, 0)  # each, group times
    sequences = rl.sample(rollout, prompts, generator)
    completion = sequences[:, rl.PROMPT :]
    reward = (completion == rl.TARGET).float().mean(dim=1)
    groups = reward.view(args.prompts, args.group)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1, device=device)
    mask[:, rl.PROMPT - 1 :] = 1.0  # log_probs[:, t] scores token t + 1: the completion's tokens
    batch = {"input_ids": sequences, "completion_mask": mask, "advantages": advantages, "reward": reward}
    batch["old_log_probs"] = actor.forward_step(batch)["log_probs"]
    batch["ref_log_probs"] = reference.forward_step(batch)["log_probs"]
    return batch


def train(args: argparse.Namespace) -> None:
    actor = fsdp2kit.Strategy.from_config(rl.model_config({"config": rl.TINY}, 3e-3, args, "fsdp2_train"))
    reference = fsdp2kit.Strategy.from_config(rl.model_config({"config": rl.TINY}, 3e-3, args, "fsdp2_infer"))

    def step(rollout: torch.nn.Module, generator: torch.Generator) -> dict[str, float]:
        batch = rollout_batch(actor, reference, rollout, args, generator)
        result = actor.train_step([batch], grpo_loss)
        mask = batch["completion_mask"]
        delta = batch["ref_log_probs"] - batch["old_log_probs"]
        kl = ((delta.exp() - delta - 1) * mask).sum() / mask.sum()
        reward, kl = rl.mean_over_ranks(torch.stack([batch["reward"].mean(), kl]))
        return {"reward": reward, "kl": kl, "loss": result["loss"]}

    rl.run_steps(actor, args, step)


def main() -> None:
    parser = rl.arguments(__doc__.splitlines()[0], steps=40, output_dir="runs/rl_grpo", prompts=4)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    rl.launch(__file__, parser, train)


if __name__ == "__main__":
    main()
