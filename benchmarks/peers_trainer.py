"""One rank of benchmarks/peers.py's Trainer arm, under torchrun in the main environment: SFT steps of the same model
on the same rows, either by transformers' `Trainer` with Accelerate's FSDP2 (`fsdp_config.fsdp_version: 2`) or by
fsdp2kit's `Strategy.train_step` with its default loss; each optimizer step timed.

Both sides: the model folder's weights in fp32, sdpa attention, no recompute, AdamW (lr 1e-3, betas 0.9/0.999, eps
1e-8, weight decay 0.1 on the matrices only: the Trainer's decay groups are fsdp2kit's for this model), constant
learning rate, gradients clipped to norm 1, micro-batches of `micro` rows accumulated to `rows_per_step` rows per
optimizer step over all ranks, the token-mean cross-entropy over the whole step's targets (the Trainer's
`num_items_in_batch` across devices). The rows are split as Accelerate's data loader splits a sequential sampler's
batches (`BatchSamplerShard`: global micro-batch i goes to rank i % world), so every rank takes the same rows on
both sides. After the first step each side computes the log-probs of the first two rows (eval mode, no grad): the
weights after one step, compared; the first step's loss too. Not the gradient norm: the Trainer's is torch's fp32
`get_total_norm`, 1.3e-4 relative below the float64 norm of the same gradients here, which fsdp2kit's is.

Accelerate runs FSDP only on accelerators: on a CPU (gloo) `AcceleratorState` leaves `distributed_type` at MULTI_CPU
even when given an FSDP plugin (accelerate/state.py: FSDP is set only for MULTI_GPU/NPU/XPU/... types), and the
Trainer then trains the model under DDP without a word. `accelerate_fsdp_on_cpu` sets the one attribute that
branch would set; everything after it is Accelerate's own FSDP2 code (`fsdp2_prepare_model`: `fully_shard` per
decoder layer and the root), checked here: the trained model must be an FSDPModule.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from peers import Record

LEARNING_RATE, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-3, 0.1, 1.0
PAD = 0


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def sft_rows(count: int, length: int, vocab: int) -> dict[str, torch.Tensor]:
    """`count` seeded SFT rows right-padded to `length`: a prompt of length/16 to length/4 tokens (no targets), a
    response up to a real length of length/2 to length, then padding (id 0, masked, no targets)."""
    generator = torch.Generator().manual_seed(52)
    ids = torch.randint(3, vocab, (count, length), generator=generator)
    prompt = torch.randint(length // 16, length // 4, (count, 1), generator=generator)
    real = torch.randint(length // 2, length + 1, (count, 1), generator=generator)
    positions = torch.arange(length)[None, :]
    mask = positions < real
    targets = mask & (positions >= prompt)
    return {
        "input_ids": ids.masked_fill(~mask, PAD),
        "attention_mask": mask.long(),
        "labels": ids.masked_fill(~targets, -100),
    }


def rank_micro_batches(
    rows: dict[str, torch.Tensor], step: int, rank: int, world: int, micro: int, accumulation: int
) -> list[dict[str, torch.Tensor]]:
    """This rank's micro-batches of optimizer step `step`, as Accelerate deals a sequential sampler's batches."""
    batches = []
    for index in range(accumulation):
        first = ((step * accumulation + index) * world + rank) * micro
        batches.append({key: value[first : first + micro] for key, value in rows.items()})
    return batches


def probe_log_probs(log_probs: torch.Tensor, probe: dict[str, torch.Tensor]) -> list:
    """The probe rows' next-token log-probs, 0 where the next token is padding."""
    return (log_probs.float() * probe["attention_mask"][:, 1:]).tolist()


def run_fsdp2kit(settings: dict[str, Any], rows: dict[str, torch.Tensor], plan: dict[str, int]) -> dict[str, Any]:
    import fsdp2kit

    config = {
        "model": {
            "name_or_path": settings["model"],
            "dtype": "fp32",
            "gradient_checkpointing": False,
            "attn_implementation": "sdpa",
        },
        "training": {
            "learning_rate": LEARNING_RATE,
            "weight_decay": WEIGHT_DECAY,
            "lr_scheduler_type": "constant",
            "warmup_steps": 0,
            "max_steps": plan["steps"],
            "max_grad_norm": MAX_GRAD_NORM,
            "per_device_train_batch_size": plan["micro"],
            "gradient_accumulation_steps": plan["accumulation"],
            "output_dir": f"{settings['out']}.run",
        },
        "strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {"reshard_after_forward": True}},
    }
    strategy = fsdp2kit.Strategy.from_config(config)
    record = Record()
    record.setup_done()
    rank, world = dist.get_rank(), dist.get_world_size()
    step = record.timed("train_step", strategy.train_step, barrier)
    first: dict[str, Any] = {}
    log_probs: list = []
    for index in range(plan["steps"]):
        result = step(rank_micro_batches(rows, index, rank, world, plan["micro"], plan["accumulation"]))
        if index == 0:
            first = {"loss": result["loss"]}
            probe = {key: rows[key][:2] for key in ("input_ids", "attention_mask")}
            log_probs = probe_log_probs(strategy.forward_step(probe)["log_probs"], probe)
    record.write(settings["out"], rank, log_probs, first)
    return first


def accelerate_fsdp_on_cpu() -> None:
    """Accelerate's state given an FSDP plugin on a CPU: FSDP, as it is on an accelerator (see the module's text)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    build = AcceleratorState.__init__

    def build_with_fsdp(self: Any, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        build(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # As that branch ends: every later AcceleratorState() copies PartialState's type back over its own
            # (the optimizer's wrapper makes one), which would leave `is_fsdp2` False from then on.
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = build_with_fsdp  # type: ignore[method-assign]


class Rows(torch.utils.data.Dataset):
    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows["input_ids"])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[index] for key, value in self.rows.items()}


def trainer_arguments(settings: dict[str, Any], plan: dict[str, int]) -> dict[str, Any]:
    """TrainingArguments (or TRL's SFTConfig, a subclass) for the settings both sides share (the module's text)."""
    return {
        "output_dir": f"{settings['out']}.run",
        "use_cpu": True,
        "ddp_backend": "gloo",
        "per_device_train_batch_size": plan["micro"],
        "gradient_accumulation_steps": plan["accumulation"],
        "max_steps": plan["steps"],
        "learning_rate": LEARNING_RATE,
        "weight_decay": WEIGHT_DECAY,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": "adamw_torch",
        "train_sampling_strategy": "sequential",
        "gradient_checkpointing": False,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "fsdp": True,
        "fsdp_config": {
            "fsdp_version": 2,
            "reshard_after_forward": True,
            "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"],
        },
    }


def build_trainer(model: Any, arguments: dict[str, Any], rows: dict[str, torch.Tensor], callback: Any) -> Any:
    """transformers' Trainer over the padded rows as they are."""
    from transformers import Trainer, TrainingArguments

    return Trainer(model=model, args=TrainingArguments(**arguments), train_dataset=Rows(rows), callbacks=[callback])


def build_sft_trainer(model: Any, arguments: dict[str, Any], rows: dict[str, torch.Tensor], callback: Any) -> Any:
    """TRL's SFTTrainer as its users give it tokenized rows: each row's real tokens and labels (-100 on the prompt),
    which TRL's collator pads (right, labels -100) and masks; TRL's defaults that would change the computation set
    as the other side has them (`bf16` and `gradient_checkpointing` default to True in SFTConfig, `max_length` to
    1024 truncation). TRL's own loss path, its fused LM head (log-probs, entropy and top-1 in tiles) included."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    real = rows["attention_mask"].sum(1).tolist()
    dataset = Dataset.from_dict(
        {
            "input_ids": [row[:length].tolist() for row, length in zip(rows["input_ids"], real, strict=True)],
            "labels": [row[:length].tolist() for row, length in zip(rows["labels"], real, strict=True)],
        }
    )
    config = SFTConfig(**arguments, bf16=False, max_length=None)
    return SFTTrainer(model=model, args=config, train_dataset=dataset, callbacks=[callback])


def run_trainer(settings: dict[str, Any], rows: dict[str, torch.Tensor], plan: dict[str, int]) -> dict[str, Any]:
    """The Trainer (or TRL's SFTTrainer) training the rows, each optimizer step timed."""
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, TrainerCallback

    accelerate_fsdp_on_cpu()
    record = Record()
    probe = {key: rows[key][:2] for key in ("input_ids", "attention_mask")}
    found: dict[str, Any] = {}

    class StepTimes(TrainerCallback):
        """Rank 0's seconds per optimizer step (on_step_begin to on_step_end: the micro-batches' forward and
        backward, clipping, the optimizer and scheduler steps, zero_grad), RSS once the Trainer has prepared the
        model and optimizer, and the probe's log-probs after the first step."""

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            record.setup_done()

        def on_step_begin(self, *args: Any, **kwargs: Any) -> None:
            record.begin(barrier)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            record.end("train_step")
            if state.global_step == 1:
                wrapped = trainer.model_wrapped
                found["fsdp2"] = isinstance(wrapped, FSDPModule)
                wrapped.eval()
                with torch.no_grad():
                    logits = wrapped(**probe).logits
                log_probs = logits[:, :-1].log_softmax(-1).gather(-1, probe["input_ids"][:, 1:, None]).squeeze(-1)
                found["log_probs"] = probe_log_probs(log_probs, probe)
                wrapped.train()
                for module in wrapped.modules():  # as the training step leaves them: sharded
                    if isinstance(module, FSDPModule):
                        module.reshard()

    build = build_sft_trainer if settings["backend"] == "sft_trainer" else build_trainer
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32, attn_implementation="sdpa")
    trainer = build(model, trainer_arguments(settings, plan), rows, StepTimes())
    trainer.train()
    if not found.get("fsdp2"):
        raise SystemExit(f"the Trainer did not train under FSDP2 (its model: {type(trainer.model_wrapped).__name__})")
    if not trainer.accelerator.is_fsdp2:  # its no_sync between micro-batches would not be FSDP2's (a reduction each)
        raise SystemExit("the Trainer's Accelerator did not stay in FSDP2 mode (is_fsdp2 is False after training)")
    logged = next(entry for entry in trainer.state.log_history if "loss" in entry)
    first = {"loss": logged["loss"]}
    record.write(settings["out"], dist.get_rank(), found["log_probs"], first)
    return first


def main() -> None:
    settings = json.loads(sys.argv[1])
    sft = settings["sft"]
    world = int(os.environ["WORLD_SIZE"])
    micro = sft["micro_rows"]
    plan = {"steps": sft["steps"], "micro": micro, "accumulation": sft["rows_per_step"] // (micro * world)}
    vocab = json.loads((Path(settings["model"]) / "config.json").read_text())["vocab_size"]
    rows = sft_rows(sft["steps"] * sft["rows_per_step"], sft["length"], vocab)
    first = (run_fsdp2kit if settings["backend"] == "fsdp2kit" else run_trainer)(settings, rows, plan)
    print(f"{settings['backend']} first step: {first}", file=sys.stderr)
    barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
