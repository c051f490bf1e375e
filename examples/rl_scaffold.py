"""The scaffolding examples/rl_grpo.py and examples/rl_ppo.py share, so that each of them reads as its algorithm only:
the toy task (a tiny Llama, random prompts, one rewarded token), the strategies' config, sampling from the rollout
model, launching the ranks, and the step loop that keeps the rollout model in sync and writes metrics.jsonl.

It sits next to the scripts; running one of them puts this folder on the import path.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import fsdp2kit

VOCAB = 32  # a small vocabulary: a random policy already says the rewarded token now and then
TARGET = 7  # the rewarded token
PROMPT, COMPLETION = 4, 8  # tokens
TINY = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


def model_config(
    model: dict[str, Any], learning_rate: float, args: argparse.Namespace, strategy_name: str | None = None
) -> dict[str, Any]:
    """A Strategy's config for the tiny model (`model` adds to or overrides the model section)."""
    config: dict[str, Any] = {
        "model": {"name_or_path": "builtin:tiny-llama", **model},
        "training": {
            "learning_rate": learning_rate,
            "lr_scheduler_type": "constant",
            "max_steps": args.steps,
            "max_grad_norm": 1.0,
            "seed": 0,
            "output_dir": args.output_dir,
        },
    }
    if strategy_name is not None:
        config["strategy_args"] = {"strategy_name": strategy_name}
    return config


def random_prompts(count: int, generator: torch.Generator) -> torch.Tensor:
    """[count, PROMPT] prompt tokens on the generator's device (ids from 3 up: clear of the special tokens)."""
    return torch.randint(3, VOCAB, (count, PROMPT), generator=generator, device=generator.device)


@torch.no_grad()
def sample(rollout: torch.nn.Module, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Completions drawn token by token from the rollout model's own distribution (temperature 1)."""
    sequences = prompts
    for _ in range(COMPLETION):
        logits = rollout(input_ids=sequences).logits[:, -1].float()
        token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
        sequences = torch.cat([sequences, token], dim=1)
    return sequences


def mean_over_ranks(values: torch.Tensor) -> list[float]:
    """Each entry of a 1-D tensor averaged over the ranks (every rank gets the same numbers)."""
    values = values.clone()
    dist.all_reduce(values)
    return (values / dist.get_world_size()).tolist()


def run_steps(
    actor: fsdp2kit.Strategy,
    args: argparse.Namespace,
    step: Callable[[torch.nn.Module, torch.Generator], dict[str, float]],
) -> None:
    """args.steps times: bring every rank's rollout model (plain transformers, on the actor's device: it shares its
    accelerator) to the actor's weights, run `step` (rollout model, this rank's generator) -> its metrics, and have
    rank 0 print them and append them to OUTPUT_DIR/metrics.jsonl.

    The weights travel as a rollout engine would take them (docs/weight_sync.md): each rank sends its own blocks of
    the weights, the first time whole and then only what changed, and a `WeightReceiver` applies them to the rollout
    model once it has every rank's; here the ranks' messages are exchanged with an all-gather."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.weight_sync import WeightReceiver

    device = actor.runtime.device
    rollout = AutoModelForCausalLM.from_config(actor.sharded.source.hf_config).to(device).eval()
    receiver = WeightReceiver.for_model(rollout)
    sender = actor.weight_sender(dtype=next(rollout.parameters()).dtype)
    rank = dist.get_rank()
    generator = torch.Generator(device).manual_seed(1234 + rank)
    metrics = Path(args.output_dir) / "metrics.jsonl"
    if rank == 0:
        metrics.parent.mkdir(parents=True, exist_ok=True)
        metrics.write_text("")
    for number in range(1, args.steps + 1):
        mine: list[bytes] = []
        synced = sender.sync(receiver.version, lambda message, mine=mine: mine.append(message.to_bytes()))
        every: list[list[bytes]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, mine)
        for data in (message for messages in every for message in messages):
            receiver.receive(data)
        assert receiver.version == actor.steps_done, "the rollout model missed a weight sync"
        record = {"step": number, "synced_mb": round(synced.bytes / 2**20, 3), **step(rollout, generator)}
        if rank == 0:
            print(json.dumps(record), flush=True)
            with metrics.open("a") as handle:
                handle.write(json.dumps(record) + "\n")


def arguments(description: str, steps: int, output_dir: str, prompts: int) -> argparse.ArgumentParser:
    """The options every RL example takes (a script adds its own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to launch (torch's elastic launcher)")
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--output-dir", default=output_dir)
    parser.add_argument("--prompts", type=int, default=prompts, help="prompts per rank and step")
    return parser


def launch(script: str, parser: argparse.ArgumentParser, train: Callable[[argparse.Namespace], None]) -> None:
    """Outside the launcher with --nproc > 1, start the ranks, each running `script` with the parsed options (the
    launcher's own parser would take --nproc for its --nproc-per-node); otherwise (a rank, or one process) train and
    close the process group."""
    args = parser.parse_args()
    if args.nproc > 1 and "RANK" not in os.environ:
        from fsdp2kit.distributed import free_port

        options = {f"--{key.replace('_', '-')}": str(value) for key, value in vars(args).items() if key != "nproc"}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)]
        launcher += ["--master-port", str(free_port()), script, *(item for pair in options.items() for item in pair)]
        raise SystemExit(subprocess.call(launcher, env={**os.environ, "OMP_NUM_THREADS": "1"}))
    try:
        train(args)
    finally:
        from fsdp2kit.distributed import shutdown

        shutdown()
