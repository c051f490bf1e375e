"""One trainer rank of a GRPO-style loop whose rollout engine is another process (tests/weight_sync_receiver.py):
each step the rollout's delta-synced model samples the completions, the actor trains on them, and the weights go to
the rollout four ways: `full_weights` gathered (rank 0 sends), `sharded` (each rank its blocks, whole), `delta`
(each rank what changed, from a background sync while a LoRA actor takes its own step) and, for that LoRA actor,
`adapter` only. After every step rank 0 checks that each bf16 model holds the actor's weights cast to bf16, bit for
bit (CRC-32 of every tensor), and that the peft model's log-probs are the LoRA actor's.

    torchrun --nproc-per-node N weight_sync_worker.py BASE_FOLDER OUT STEPS [KILL_AT]

KILL_AT: at that step the rollout process kills itself in the middle of the delta sync; rank 0 starts another and
the next syncs heal it. Rank 0 writes OUT (JSON): per step the versions and checks, the syncs' stats, the warnings."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from multiprocessing.connection import Client
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
from weight_sync_receiver import AUTHKEY, crc, get, put

import fsdp2kit
from fsdp2kit.distributed import shutdown

HERE = Path(__file__).parent
PROMPT, COMPLETION, PROMPTS, GROUP = 4, 6, 2, 4
CHANNELS = ("sharded", "delta", "adapter")


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start_rollout(base: Path) -> tuple[subprocess.Popen | None, int]:
    """Rank 0 starts the rollout process, which listens on a port the system picks and prints it; every rank learns
    it."""
    process, port = None, torch.tensor([0])
    if dist.get_rank() == 0:
        command = [sys.executable, str(HERE / "weight_sync_receiver.py"), str(base)]
        process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        port[0] = int(cast(IO[str], process.stdout).readline())
    dist.broadcast(port, 0)
    return process, int(port)


def connect(port: int) -> Any:
    """This rank's line to the rollout process (listening already: it prints its port once it listens)."""
    connection = Client(("127.0.0.1", port), authkey=AUTHKEY)
    put(connection, ("hello", dist.get_rank(), dist.get_world_size()))
    return connection


def grpo_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch["completion_mask"]
    ratio = torch.exp(log_probs - batch["old_log_probs"])
    advantages = batch["advantages"][:, None]
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    return (-surrogate * mask).sum(), mask.sum()


def rollout_batch(actor: fsdp2kit.Strategy, rollout: Any, step: int) -> dict[str, torch.Tensor]:
    """Prompts of this rank, completions sampled by the rollout process, group-normalised rewards (the share of even
    token ids: it differs within a group, so every step trains)."""
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    prompts = torch.randint(3, 64, (PROMPTS, PROMPT), generator=generator).repeat_interleave(GROUP, 0)
    put(rollout, ("sample", prompts, 1000 * step + dist.get_rank(), COMPLETION))
    sequences = get(rollout)
    reward = (sequences[:, PROMPT:] % 2 == 0).float().mean(1).view(PROMPTS, GROUP)  # even tokens: some of each group
    advantages = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).flatten()
    mask = torch.zeros(sequences.shape[0], sequences.shape[1] - 1)
    mask[:, PROMPT - 1 :] = 1.0
    batch = {"input_ids": sequences, "completion_mask": mask, "advantages": advantages}
    batch["old_log_probs"] = actor.forward_step(batch)["log_probs"]
    return batch


def sync_full(actor: fsdp2kit.Strategy, rollout: Any) -> None:
    from safetensors.torch import save

    weights = {name: tensor.clone() for name, tensor in actor.full_weights(dtype=torch.bfloat16)}
    if dist.get_rank() == 0:
        put(rollout, ("full", actor.steps_done, save(weights)))


def status(rollout: Any) -> dict[str, Any] | None:
    """Each rank says it has sent all it had, then rank 0 asks the rollout (which answers once it has read every
    rank's messages): every rank gets its versions (and rank 0 the CRCs); None where it is gone."""
    report: list[Any] = [None]
    try:
        put(rollout, ("sent",))
    except (OSError, EOFError):
        pass
    if dist.get_rank() == 0:
        try:
            put(rollout, ("status",))
            report = [get(rollout)]
        except (OSError, EOFError):
            pass
    dist.broadcast_object_list(report, 0)
    return report[0]


def check(report: dict[str, Any], actor: fsdp2kit.Strategy, lora: fsdp2kit.Strategy, rollout: Any) -> dict:
    """Each bf16 channel bitwise equal to the actor cast to bf16; the peft model's log-probs against the LoRA
    actor's."""
    want = {name: crc(tensor) for name, tensor in actor.full_weights(dtype=torch.bfloat16)}
    ids = torch.randint(3, 64, (2, 10), generator=torch.Generator().manual_seed(actor.steps_done))
    trainer = lora.forward_step({"input_ids": ids})["log_probs"]
    result: dict[str, Any] = {"versions": {c: v for c, (v, _) in report.items()}}
    if dist.get_rank() == 0:
        result["equal"] = {c: report[c][1] == want for c in ("full", "sharded", "delta")}
        put(rollout, ("logprobs", ids))
        result["logprob_error"] = float((get(rollout) - trainer).abs().max())
    return result


def syncs(senders: dict[str, Any], actor: fsdp2kit.Strategy, lora: fsdp2kit.Strategy, rollout: Any, kill: bool):
    """This step's syncs; a rollout gone in the middle is caught on every rank (False: start another)."""
    versions = status(rollout) or {}
    stats: dict[str, Any] = {}
    sent_ok = torch.tensor([1])
    try:
        if kill and dist.get_rank() == 0:
            put(rollout, ("die", 0))  # at the first message of the delta: the rest are in flight or unsent
        sync_full(actor, rollout)

        def send(channel: str):
            return lambda message: put(rollout, ("sync", channel, message.to_bytes()))

        stats["sharded"] = senders["sharded"].sync(versions.get("sharded", (None,))[0], send("sharded"))
        lora_batch = rollout_batch(lora, rollout, 1000 + actor.steps_done)  # before: the sync's thread owns the line
        senders["delta"].start(versions.get("delta", (None,))[0], send("delta"))
        lora.train_step([lora_batch], loss_fn=grpo_loss)  # a step while the delta sync runs in the background
        stats["delta"] = senders["delta"].wait()
        stats["adapter"] = senders["adapter"].sync(versions.get("adapter", (None,))[0], send("adapter"))
    except (OSError, EOFError):
        sent_ok[0] = 0
        try:
            senders["delta"].wait()
        except (OSError, EOFError):
            pass
    dist.all_reduce(sent_ok, op=dist.ReduceOp.MIN)
    return bool(sent_ok), {k: vars(v) if v is not None else None for k, v in stats.items()}


def main(base: Path, out: Path, steps: int, kill_at: int | None) -> None:
    warnings = Warnings()
    logging.getLogger("fsdp2kit.weight_sync").addHandler(warnings)
    training = {"learning_rate": 1e-4, "warmup_steps": 0, "max_steps": steps + 2, "lr_scheduler_type": "constant"}
    actor = fsdp2kit.Strategy.from_config({"model": {"name_or_path": str(base)}, "training": training})
    lora_model = {"name_or_path": str(base), "dtype": "fp32", "lora": {"rank": 4, "target_modules": "all-linear"}}
    lora = fsdp2kit.Strategy.from_config({"model": lora_model, "training": {**training, "learning_rate": 1e-2}})
    senders = {
        "sharded": actor.weight_sender(dtype=torch.bfloat16, delta=False, bucket_bytes=1 << 15),
        "delta": actor.weight_sender(dtype=torch.bfloat16, bucket_bytes=1 << 15),
        "adapter": lora.weight_sender(part="adapter"),
    }
    process, port = start_rollout(base)
    rollout = connect(port)
    records = []
    for step in range(steps + 1):
        if step:
            actor.train_step([rollout_batch(actor, rollout, step)], loss_fn=grpo_loss)
        sent, stats = syncs(senders, actor, lora, rollout, kill=step == kill_at)
        report = status(rollout)
        if not sent or report is None:  # the rollout died: start another and sync again, from nothing
            if process is not None:
                process.wait(timeout=60)
            rollout.close()
            process, port = start_rollout(base)
            rollout = connect(port)
            sent, stats = syncs(senders, actor, lora, rollout, kill=False)
            report = status(rollout)
        assert sent and report is not None
        checked = check(report, actor, lora, rollout)
        records.append({"step": step, "restarted": step == kill_at, "stats": stats, **checked})
    put(rollout, ("bye",))
    if process is not None:
        process.wait(timeout=60)
        out.write_text(json.dumps({"records": records, "warnings": warnings.lines}))


if __name__ == "__main__":
    try:
        main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]) if len(sys.argv) > 4 else None)
    finally:
        shutdown()
