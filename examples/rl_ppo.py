"""PPO with a critic on the CPU (or GPUs), with fsdp2kit as the training back-end of both the policy and the value
model, the way an RL framework's actor and critic workers drive theirs.

Each step, on every rank: a rollout model (plain transformers on the strategy's device, its weights refreshed from
the policy through `Strategy.weight_sender`: only what changed) samples a completion for each prompt; a rule scores
it (+1 for each completion token equal to one chosen token, -1 for each other, averaged: a score in [-1, 1], each
token's share given as it is said); the critic (`model.model_class: transformers:LlamaForTokenClassification`, one
label) gives the values [B, T] of the states, from which GAE makes the advantages and returns; the policy's
`train_step` takes the clipped-ratio loss and the critic's `train_step` the clipped value loss on its `values`. A
tiny model learns this from scratch in a minute. Every tensor lives on the strategies' device, so the same script
runs on GPUs.

    python examples/rl_ppo.py --nproc 2 --steps 30 --output-dir runs/rl_ppo

writes OUTPUT_DIR/metrics.jsonl (step, reward, value_loss, policy_loss), one line per step, and prints the same.
"""

from __future__ import annotations

import argparse

import rl_scaffold as rl
import torch

import fsdp2kit

CLIP, VALUE_CLIP = 0.2, 0.2
GAMMA, LAMBDA = 1.0, 0.95
# The critic: the same architecture with a value head (one output per token) instead of the LM head.
CRITIC = {"model_class": "transformers:LlamaForTokenClassification", "config": {**rl.TINY, "num_labels": 1}}


def gae(rewards: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimates and returns over the completion tokens ([B, C]: the reward of each token and
    the value of the state it was drawn in; after the last token the episode ends)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for i in reversed(range(rewards.shape[1])):
        following = values[:, i + 1] if i + 1 < rewards.shape[1] else torch.zeros_like(running)
        running = rewards[:, i] + GAMMA * following - values[:, i] + GAMMA * LAMBDA * running
        advantages[:, i] = running
    return advantages, advantages + values


def completion_part(per_position: torch.Tensor) -> torch.Tensor:
    """Of a [B, T-1] tensor whose position t belongs to token t + 1 (log-probs; the values of the states tokens are
    drawn in), the completion tokens' part [B, C]."""
    return per_position[:, rl.PROMPT - 1 :]


def policy_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped-ratio surrogate over the completion tokens: (their summed loss, their count)."""
    new = completion_part(log_probs)
    ratio = torch.exp(new - batch["old_log_probs"])
    advantages = batch["advantages"]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    return -surrogate.sum(), torch.tensor(float(new.numel()), device=new.device)


def value_loss(values: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss on the values of the states the completion tokens were drawn in."""
    new, old, returns = completion_part(values[:, :-1]), batch["old_values"], batch["returns"]
    clipped = old + (new - old).clamp(-VALUE_CLIP, VALUE_CLIP)
    loss = 0.5 * torch.maximum((new - returns).square(), (clipped - returns).square())
    return loss.sum(), torch.tensor(float(new.numel()), device=new.device)


def rollout_batch(
    actor: fsdp2kit.Strategy,
    critic: fsdp2kit.Strategy,
    rollout: torch.nn.Module,
    args: argparse.Namespace,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Sample, score and annotate one batch: the micro-batch that both train_steps get."""
    sequences = rl.sample(rollout, rl.random_prompts(args.prompts, generator), generator)
    completion = sequences[:, rl.PROMPT :]
    rewards = torch.where(completion == rl.TARGET, 1.0, -1.0) / rl.COMPLETION  # each token's share, as it is said
    batch = {"input_ids": sequences, "score": rewards.sum(dim=1)}
    batch["old_log_probs"] = completion_part(actor.forward_step(batch)["log_probs"])
    batch["old_values"] = completion_part(critic.forward_step(batch)["values"][:, :-1])
    advantages, batch["returns"] = gae(rewards, batch["old_values"])
    batch["advantages"] = (advantages - advantages.mean()) / (advantages.std() + 1e-6)
    return batch


def train(args: argparse.Namespace) -> None:
    actor = fsdp2kit.Strategy.from_config(rl.model_config({"config": rl.TINY}, 2e-2, args))
    critic = fsdp2kit.Strategy.from_config(rl.model_config(CRITIC, 1e-2, args))

    def step(rollout: torch.nn.Module, generator: torch.Generator) -> dict[str, float]:
        batch = rollout_batch(actor, critic, rollout, args, generator)
        values = critic.train_step([batch], value_loss)
        policy = actor.train_step([batch], policy_loss)
        (reward,) = rl.mean_over_ranks(batch["score"].mean().reshape(1))
        return {"reward": reward, "value_loss": values["loss"], "policy_loss": policy["loss"]}

    rl.run_steps(actor, args, step)


def main() -> None:
    rl.launch(__file__, rl.arguments(__doc__.splitlines()[0], steps=30, output_dir="runs/rl_ppo", prompts=16), train)


if __name__ == "__main__":
    main()
