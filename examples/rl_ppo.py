"""PPO with a critic on the CPU (or GPUs), with fsdp2kit as the training back-end of both the policy and the value
model, the way an RL framework's actor and critic workers drive theirs.

Each step, on every rank: a rollout model (plain transformers on the strategy's device, its weights refreshed from
the policy through `Strategy.full_weights`) samples a completion for each prompt; a rule scores it (+1 for each
completion token equal to one chosen token, -1 for each other, averaged: a score in [-1, 1], each token's share
given as it is said); the critic (`model.model_class: transformers:LlamaForTokenClassification`, one label) gives the
values [B, T] of the states, from which GAE makes the advantages and returns; the policy's `train_step` takes the
clipped-ratio loss and the critic's `train_step` the clipped value loss on its `values`. A tiny model learns this
from scratch in a minute. Every tensor lives on the strategies' device, so the same script runs on GPUs.

    python examples/rl_ppo.py --nproc 2 --steps 30 --output-dir runs/rl_ppo

writes OUTPUT_DIR/metrics.jsonl (step, reward, value_loss, policy_loss), one line per step, and prints the same.
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
CLIP, VALUE_CLIP = 0.2, 0.2
GAMMA, LAMBDA = 1.0, 0.95
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
# The critic: the same architecture with a value head (one output per token) instead of the LM head.
CRITIC = {"model_class": "transformers:LlamaForTokenClassification", "config": {**TINY, "num_labels": 1}}


def model_config(model: dict[str, Any], learning_rate: float, steps: int, output_dir: str) -> dict[str, Any]:
    return {
        "model": {"name_or_path": "builtin:tiny-llama", **model},
        "training": {
            "learning_rate": learning_rate,
            "lr_scheduler_type": "constant",
            "max_steps": steps,
            "max_grad_norm": 1.0,
            "seed": 0,
            "output_dir": output_dir,
        },
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
    return per_position[:, PROMPT - 1 :]


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
    device = actor.runtime.device
    prompts = torch.randint(3, VOCAB, (args.prompts, PROMPT), generator=generator, device=device)
    sequences = sample(rollout, prompts, generator)
    completion = sequences[:, PROMPT:]
    rewards = torch.where(completion == TARGET, 1.0, -1.0) / COMPLETION  # each token's share, as it is said
    batch = {"input_ids": sequences, "score": rewards.sum(dim=1)}
    batch["old_log_probs"] = completion_part(actor.forward_step(batch)["log_probs"])
    batch["old_values"] = completion_part(critic.forward_step(batch)["values"][:, :-1])
    advantages, batch["returns"] = gae(rewards, batch["old_values"])
    batch["advantages"] = (advantages - advantages.mean()) / (advantages.std() + 1e-6)
    return batch


def train(args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM

    actor = fsdp2kit.Strategy.from_config(model_config({"config": TINY}, 2e-2, args.steps, args.output_dir))
    critic = fsdp2kit.Strategy.from_config(model_config(CRITIC, 1e-2, args.steps, args.output_dir))
    device = actor.runtime.device
    rollout = AutoModelForCausalLM.from_config(actor.sharded.source.hf_config).to(device).eval()
    rank = dist.get_rank()
    generator = torch.Generator(device=device).manual_seed(1234 + rank)
    out = Path(args.output_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    for step in range(1, args.steps + 1):
        rollout.load_state_dict(dict(actor.full_weights()))  # every rank keeps its rollout engine in sync
        batch = rollout_batch(actor, critic, rollout, args, generator)
        values = critic.train_step([batch], value_loss)
        policy = actor.train_step([batch], policy_loss)
        reward = batch["score"].mean().reshape(1)
        dist.all_reduce(reward)
        record = {
            "step": step,
            "reward": reward.item() / dist.get_world_size(),
            "value_loss": values["loss"],
            "policy_loss": policy["loss"],
        }
        if rank == 0:
            print(json.dumps(record), flush=True)
            with (out / "metrics.jsonl").open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (torch's elastic launcher)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--output-dir", default="runs/rl_ppo")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rank and step")
    args = parser.parse_args()
    if args.nproc > 1 and "RANK" not in os.environ:  # the launcher: start the ranks, each running this script
        from fsdp2kit.distributed import free_port

        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
        launcher += ["--master-port", str(free_port()), __file__]
        launcher += ["--steps", str(args.steps), "--output-dir", args.output_dir, "--prompts", str(args.prompts)]
        raise SystemExit(subprocess.call(launcher, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        train(args)
    finally:
        from fsdp2kit.distributed import shutdown

        shutdown()


if __name__ == "__main__":
    main()
