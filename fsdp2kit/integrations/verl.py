"""verl's engine interface over `fsdp2kit.Strategy`. verl 0.9's TrainingWorker (`verl/workers/engine_workers.py`)
builds its engine with `EngineRegistry.new(model_type, backend, model_config=, engine_config=, optimizer_config=,
checkpoint_config=)` and drives it with the calls of `verl/workers/engine/base.py:BaseEngine`, as
`verl/workers/engine/fsdp/transformer_impl.py:FSDPEngine` answers them, on verl's batches: a TensorDict whose
`input_ids` are a jagged nested tensor (verl's NO_PADDING layout) with its settings (micro-batch size or token
budget, entropy, temperature) as non-tensor entries. `VerlEngine` answers those calls with a Strategy; `register`
puts it into verl's EngineRegistry. Nothing here imports verl (verl pins its own transformers); tensordict, which
verl's batches are made of, is imported where a batch is built."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp2kit.dtypes import short_name, torch_dtype
from fsdp2kit.errors import UserError
from fsdp2kit.strategy import Strategy
from fsdp2kit.train.packing import token_budget_ranges

# verl's loss function: loss_function(model_output=, data=, dp_group=) -> (loss, metrics).
VerlLoss = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
# The key of a Strategy batch that tells the adapter's loss which verl micro-batch it has.
MICRO_BATCH_KEY = "verl_micro_batch"
# verl's learning-rate schedules that fsdp2kit's schedule reproduces (warmup, then constant or cosine to zero).
SCHEDULES = ("constant", "cosine")


def job_config(model_config: Any, engine_config: Any, optimizer_config: Any) -> dict[str, Any]:
    """fsdp2kit's native config from verl's model, engine and optimizer configs. The keys read are those below;
    a verl setting that fsdp2kit would not honour as verl does is refused in one sentence."""
    schedule = getattr(optimizer_config, "warmup_style", None) or optimizer_config.lr_scheduler_type
    refusals = {
        f"optim.optimizer: {optimizer_config.optimizer} (fsdp2kit trains with AdamW)": optimizer_config.optimizer
        != "AdamW",
        f"optim.lr_scheduler_type: {schedule} (fsdp2kit's verl engine has {', '.join(SCHEDULES)})": schedule
        not in SCHEDULES,
        f"optim.min_lr_ratio: {optimizer_config.min_lr_ratio} (fsdp2kit's cosine decays to 0)": bool(
            optimizer_config.min_lr_ratio
        ),
        f"optim.num_cycles: {optimizer_config.num_cycles} (fsdp2kit's cosine is a half cycle, 0.5)": schedule
        == "cosine"
        and optimizer_config.num_cycles != 0.5,
    }
    refused = [what for what, applies in refusals.items() if applies]
    if refused:
        raise UserError(f"verl config: {refused[0]}")
    total = int(optimizer_config.total_training_steps)
    warmup = int(optimizer_config.lr_warmup_steps or 0)
    if warmup <= 0:  # verl's rule: the ratio of the total, rounded down
        warmup = int(optimizer_config.lr_warmup_steps_ratio * max(total, 0))
    return {
        "model": {
            "name_or_path": str(model_config.path),
            "trust_remote_code": bool(getattr(model_config, "trust_remote_code", False)),
            "ulysses_size": int(engine_config.ulysses_sequence_parallel_size),
            **model_head(model_config),
        },
        "strategy_args": {"strategy_name": "fsdp2_infer" if engine_config.forward_only else "fsdp2_train"},
        "training": {
            "learning_rate": float(optimizer_config.lr),
            "weight_decay": float(optimizer_config.weight_decay),
            "adam_beta1": float(optimizer_config.betas[0]),
            "adam_beta2": float(optimizer_config.betas[1]),
            "max_grad_norm": float(optimizer_config.clip_grad),
            "max_steps": total,
            "warmup_steps": warmup,
            "lr_scheduler_type": schedule,
            "seed": int(getattr(engine_config, "seed", 42)),
        },
    }


def model_head(model_config: Any) -> dict[str, Any]:
    """The model section's head for verl's model_type: a causal LM ("language_model"), or for a critic
    ("value_model") the family's ...ForTokenClassification with one label, as verl builds its critic."""
    model_type = getattr(model_config, "model_type", None) or "language_model"
    if model_type == "language_model":
        return {}
    if model_type != "value_model":
        raise UserError(f"verl model_type: {model_type} (fsdp2kit's verl engine has language_model, value_model)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    config_file = Path(model_config.path) / "config.json"
    family = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    class_name = MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES.get(family or "")
    if class_name is None:
        raise UserError(f"verl value_model: {config_file} names no model family with a token-classification class")
    return {"model_class": f"transformers:{class_name}", "config": {"num_labels": 1}}


class VerlEngine:
    """verl's engine calls answered by a `Strategy` (built in `initialize`, as verl's engines build their model
    there). `overrides` are fsdp2kit `--set` strings for what verl's configs do not say."""

    def __init__(
        self,
        model_config: Any,
        engine_config: Any,
        optimizer_config: Any,
        checkpoint_config: Any,
        overrides: tuple[str, ...] = (),
    ) -> None:
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.overrides = overrides
        self.mode: str | None = None
        self._strategy: Strategy | None = None
        self._saved: list[Path] = []  # this engine's checkpoints, oldest first (verl's max_ckpt_to_keep)

    def initialize(self) -> None:
        """Build the model, optimizer and schedule; states go to host memory where verl's offload flags say."""
        config = job_config(self.model_config, self.engine_config, self.optimizer_config)
        self._strategy = Strategy.from_config(config, overrides=self.overrides)
        self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled, grad=False)

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            raise UserError("verl engine: call initialize() first (it builds the model)")
        return self._strategy

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "optimizer_offload", False))

    # ---- modes ----------------------------------------------------------------------------------------------

    def train_mode(self, **kwargs: Any) -> AbstractContextManager[None]:
        """Training within: states loaded (those verl offloads) on entry and offloaded on exit, as verl's
        EngineTrainModeCtx does; `disable_auto_offload=True` leaves them where they are."""
        return self._mode("train", bool(kwargs.get("disable_auto_offload", False)))

    def eval_mode(self, **kwargs: Any) -> AbstractContextManager[None]:
        return self._mode("eval", bool(kwargs.get("disable_auto_offload", False)))

    @contextmanager
    def _mode(self, mode: str, keep_in_place: bool) -> Iterator[None]:
        optimizer = mode == "train" and self.is_optimizer_offload_enabled
        moves = not keep_in_place and (self.is_param_offload_enabled or optimizer)
        if moves:
            self.to("cuda", model=self.is_param_offload_enabled, optimizer=optimizer, grad=False)
        self.mode = mode
        try:
            yield
        finally:
            self.mode = None
            if moves:
                self.to("cpu", model=self.is_param_offload_enabled, optimizer=optimizer, grad=False)

    # ---- steps ----------------------------------------------------------------------------------------------

    def train_batch(self, data: Any, loss_function: VerlLoss) -> dict[str, Any]:
        """One optimizer step over this rank's batch, split into micro-batches as verl's engine splits it; the
        schedule waits for `lr_scheduler_step`. Returns verl's output: per micro-batch `loss` and `metrics` (lists),
        `metrics['grad_norm']`."""
        strategy = self.strategy
        run = _LossRun(loss_function, self.get_data_parallel_group(), self.get_data_parallel_size())
        parts = run.prepare(data, self._micro_ranges(data))
        entropy = bool(_setting(data, "calculate_entropy", False))
        loss_fn = run.loss_fn(parts, self.strategy.head.output, entropy)
        result = strategy.train_step([part.batch for part in parts], loss_fn, step_scheduler=False)
        metrics: dict[str, Any] = dict(run.metrics)
        metrics["grad_norm"] = result["grad_norm"]
        return {"model_output": {}, "loss": run.losses, "metrics": metrics}

    def infer_batch(self, data: Any, loss_function: VerlLoss | None = None) -> dict[str, Any]:
        """Log-probs (and entropy where `calculate_entropy`) of every token as verl's engine gives them: a jagged
        tensor like `input_ids`, position t holding log p(token t+1), 0 at each sequence's last position; a critic's
        `values`, one per token; with a loss function, its loss and metrics per micro-batch too."""
        run = _LossRun(loss_function, self.get_data_parallel_group(), self.get_data_parallel_size())
        parts = run.prepare(data, self._micro_ranges(data))
        entropy = bool(_setting(data, "calculate_entropy", False))
        kinds = [self.strategy.head.output, *(["entropy"] if entropy else [])]
        outputs: dict[str, list[torch.Tensor]] = {kind: [] for kind in kinds}
        for part in parts:
            result = self.strategy.forward_step(part.batch, entropy=entropy)
            model_output = {key: part.as_verl(key, result[key]) for key in outputs}
            for key, value in model_output.items():
                outputs[key] += list(value.unbind())
            run.call(part, model_output)
        return {
            "model_output": {k: torch.nested.as_nested_tensor(v, layout=torch.jagged) for k, v in outputs.items()},
            "loss": run.losses,
            "metrics": dict(run.metrics),
        }

    def forward_backward_batch(self, data: Any, loss_function: VerlLoss, forward_only: bool = False) -> Any:
        """forward_only: `infer_batch`. A backward without its optimizer step is refused: fsdp2kit's step takes
        the forward, backward, clipping and update together (verl's TrainingWorker calls `train_batch`)."""
        if not forward_only:
            raise UserError(
                "verl engine: forward_backward_batch(forward_only=False) alone is not supported; call train_batch "
                "(forward, backward and optimizer step together, as verl's TrainingWorker does)"
            )
        return self.infer_batch(data, loss_function)

    def optimizer_zero_grad(self) -> None:
        """Gradients cleared (fsdp2kit's step clears them after each update too)."""
        optimizer = self.strategy.optimizer
        if optimizer is None:
            raise UserError("verl engine: optimizer_zero_grad on a forward-only engine (engine_config.forward_only)")
        optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Refused on its own: `train_batch` clips and steps (see forward_backward_batch)."""
        raise UserError("verl engine: optimizer_step is part of train_batch in fsdp2kit; call train_batch")

    def lr_scheduler_step(self) -> float:
        """Advance the schedule (verl calls it once per RL step, after the mini-batches); the new learning rate."""
        return self.strategy.scheduler_step()

    # ---- weights, devices, data parallel --------------------------------------------------------------------

    def get_per_tensor_param(
        self, layered_summon: bool = False, base_sync_done: bool = False, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], dict | None]:
        """(HF name, full tensor) for the rollout engine, in the mixed-precision param dtype verl's engine sends
        (bf16 unless engine_config.mixed_precision says otherwise). Always the whole model (LoRA merged), which the
        None PEFT config tells verl, whatever `base_sync_done` says; gathering is bucketed (`layered_summon`'s
        purpose) by Strategy.full_weights."""
        precision = getattr(self.engine_config, "mixed_precision", None) or {}
        dtype = torch_dtype(short_name(precision.get("param_dtype", "bf16")))
        return self.strategy.full_weights(dtype=dtype), None

    def get_data_parallel_rank(self) -> int:
        return self.strategy.data_parallel_rank()

    def get_data_parallel_size(self) -> int:
        return self.strategy.data_parallel_size()

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.strategy.data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        """The first rank of each Ulysses group reports (every rank of it holds the same outputs)."""
        group = self.strategy.sharded.sp_group
        return group is None or group.rank() == 0

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Parameters and/or optimizer state to "cpu" or to this rank's accelerator; gradients are never held
        between fsdp2kit's steps, so `grad` moves nothing (verl requires it to come with `model`)."""
        if grad and not model:
            raise UserError("verl engine: to(grad=True) needs model=True (gradients move with the parameters)")
        include = [kind for kind, moved in (("model_params", model), ("optimizer_states", optimizer)) if moved]
        if not include:
            return
        if device == "cpu":
            self.strategy.offload_states(include=include)
        else:
            self.strategy.load_states(include=include)

    def disable_adapter(self) -> AbstractContextManager[None]:
        """verl asks for it to compute a LoRA model's reference log-probs without its adapters; fsdp2kit has no such
        forward (build the reference as its own fsdp2_infer Strategy)."""
        raise UserError("verl engine: no adapter-free forward in fsdp2kit; use a separate reference model")

    # ---- checkpoints ----------------------------------------------------------------------------------------

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """fsdp2kit's checkpoint (model, optimizer, schedule, RNG; atomic) at local_path; with max_ckpt_to_keep,
        this engine's older saves beyond that many are deleted, as verl's checkpoint manager does."""
        if hdfs_path is not None:
            raise UserError("verl engine: save_checkpoint(hdfs_path=...) is not supported; copy local_path yourself")
        path = Path(local_path)
        self.strategy.save_checkpoint(path)
        self._saved = [p for p in self._saved if p != path] + [path]
        if max_ckpt_to_keep:
            stale, self._saved = self._saved[:-max_ckpt_to_keep], self._saved[-max_ckpt_to_keep:]
            if self.strategy.runtime.is_main:
                for old in stale:
                    shutil.rmtree(old, ignore_errors=True)
            dist.barrier()

    def load_checkpoint(
        self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True, **kwargs: Any
    ) -> None:
        """The checkpoint at local_path (of any world size). A local checkpoint is never deleted, as verl keeps its
        own local ones whatever del_local_after_load says."""
        if hdfs_path is not None:
            raise UserError("verl engine: load_checkpoint(hdfs_path=...) is not supported; give local_path")
        self.strategy.load_checkpoint(local_path)

    # ---- micro-batches --------------------------------------------------------------------------------------

    def _micro_ranges(self, data: Any) -> list[range]:
        """verl's split of this rank's rows: `micro_batch_size_per_gpu` rows each, or with `use_dynamic_bsz` (verl's
        default) consecutive rows within `max_token_len_per_gpu` x the Ulysses size tokens, in as many
        micro-batches on every data-parallel rank (verl's same_micro_num_in_dp)."""
        lengths = _lengths(data["input_ids"])
        if not _setting(data, "use_dynamic_bsz", True):
            size = int(_setting(data, "micro_batch_size_per_gpu", 0))
            if size <= 0:
                raise UserError("verl batch: micro_batch_size_per_gpu must be > 0 when use_dynamic_bsz is False")
            return [range(start, min(start + size, len(lengths))) for start in range(0, len(lengths), size)]
        budget = int(_setting(data, "max_token_len_per_gpu", 0)) * int(self.strategy.sharded.layout.ulysses_size)
        if budget <= 0:
            raise UserError("verl batch: max_token_len_per_gpu must be > 0 when use_dynamic_bsz is True")
        count = torch.tensor(len(token_budget_ranges(lengths, budget)))
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.get_data_parallel_group())
        return balanced_ranges(lengths, int(count))


def balanced_ranges(lengths: list[int], count: int) -> list[range]:
    """`count` consecutive, non-empty runs of rows with near-equal token counts (so every data-parallel rank takes
    as many micro-batches)."""
    if count > len(lengths):
        raise UserError(
            f"verl batch: another data-parallel rank needs {count} micro-batches, this rank has {len(lengths)} rows"
        )
    total, bounds, running = sum(lengths), [0], 0
    for row, length in enumerate(lengths):
        running += length
        wanted = len(bounds)  # the next boundary: after the row where the share `wanted / count` is reached
        rows_left, parts_left = len(lengths) - row - 1, count - wanted
        if wanted < count and (running * count >= total * wanted or rows_left == parts_left):
            bounds.append(row + 1)
    return [range(a, b) for a, b in zip(bounds, bounds[1:] + [len(lengths)], strict=True)]


def _setting(data: Any, key: str, default: Any) -> Any:
    """A verl batch's non-tensor setting (tensordict's NonTensorData unwrapped), or `default`."""
    value = data.get(key, default)
    return value if isinstance(value, torch.Tensor) else getattr(value, "data", value)


def _lengths(input_ids: Any) -> list[int]:
    """Each row's token count: a jagged tensor's offsets, apart."""
    if not (isinstance(input_ids, torch.Tensor) and input_ids.is_nested):
        raise UserError("verl batch: input_ids must be a jagged nested tensor (verl's NO_PADDING layout)")
    offsets: torch.Tensor = getattr(input_ids, "offsets")()  # noqa: B009 (torch's stubs lack nested tensors' offsets)
    return [int(n) for n in offsets.diff().tolist()]


class _MicroBatch:
    """One verl micro-batch (a TensorDict row range) and the Strategy batch made from it: right-padded input_ids,
    attention_mask, position_ids."""

    def __init__(self, data: Any, index: int) -> None:
        self.data = data
        ids = data["input_ids"]
        self.offsets = ids.offsets()
        self.lengths = self.offsets.diff()
        width = int(self.lengths.max())
        positions = torch.arange(width, device=ids.device)
        self.mask = positions[None, :] < self.lengths[:, None]
        # log-probs sit at positions 0..L-2 of a sequence of length L; its last position predicts nothing
        self.predicting = positions[None, :] < (self.lengths[:, None] - 1)
        self.batch: dict[str, torch.Tensor] = {
            "input_ids": ids.to_padded_tensor(0, output_size=(len(self.lengths), width)).long(),
            "attention_mask": self.mask.long(),
            MICRO_BATCH_KEY: torch.tensor(index),  # passed through to the loss: which micro-batch it is
        }
        position_ids = data.get("position_ids", None)
        if isinstance(position_ids, torch.Tensor) and position_ids.is_nested and position_ids.dim() == 2:
            self.batch["position_ids"] = position_ids.to_padded_tensor(0, output_size=(len(self.lengths), width))
        temperature = _setting(data, "temperature", None)  # one number, or one per sample (this micro-batch's rows)
        if temperature is not None:
            self.batch["temperature"] = torch.as_tensor(temperature, dtype=torch.float32)

    def as_verl(self, kind: str, result: torch.Tensor) -> torch.Tensor:
        """A Strategy result as verl's jagged [b, j] tensor, with autograd: `values` [b, T] one per token as they
        are; log-probs and entropy [b, T-1] (position t: about token t+1) with 0 at each sequence's last position."""
        if kind != "values":
            result = F.pad(result, (0, 1)) * self.predicting
        return torch.nested.nested_tensor_from_jagged(result[self.mask], self.offsets)


class _LossRun:
    """verl's loss function over a step's micro-batches: the global settings verl's engine gives it (`dp_size`,
    `batch_num_tokens`, `global_batch_size`), each micro-batch's loss and metrics collected as verl's engine does."""

    def __init__(self, loss_function: VerlLoss | None, group: dist.ProcessGroup, dp_size: int) -> None:
        self.loss_function, self.group, self.dp_size = loss_function, group, dp_size
        self.losses: list[float] = []
        self.metrics: dict[str, list[Any]] = {}

    def prepare(self, data: Any, ranges: list[range]) -> list[_MicroBatch]:
        """The micro-batches of `data`, each with verl's global settings."""
        # verl's engine: the loss-mask tokens of the global batch (global_batch_size comes from verl's trainer)
        tokens = data["loss_mask"].values().sum() if "loss_mask" in data.keys() else torch.zeros((), dtype=torch.long)
        tokens = tokens.detach().clone()
        dist.all_reduce(tokens, group=self.group)
        parts = []
        for index, rows in enumerate(ranges):
            micro = data[rows.start : rows.stop]
            micro.set_non_tensor("dp_size", self.dp_size)
            micro.set_non_tensor("batch_num_tokens", int(tokens))
            parts.append(_MicroBatch(micro, index))
        return parts

    def call(self, part: _MicroBatch, model_output: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """verl's loss function on one micro-batch, its loss and metrics recorded."""
        if self.loss_function is None:
            return None
        loss, metrics = self.loss_function(model_output=model_output, data=part.data, dp_group=self.group)
        self.losses.append(float(loss.detach()))
        for key, value in metrics.items():
            self.metrics.setdefault(key, []).append(value)
        return loss

    def loss_fn(self, parts: list[_MicroBatch], output: str, entropy: bool) -> Callable[..., Any]:
        """The Strategy's loss_fn: verl's loss of micro-batch i with weight 1 / (this rank's micro-batches), so that
        the Strategy's sum(loss) / sum(weight) is verl's objective, the mean over data-parallel ranks of each rank's
        summed micro-batch losses (verl's losses carry x dp_size and the global token count already). Its model
        output is the model's `output` (log_probs, or a critic's values); with `entropy` (verl's calculate_entropy:
        an entropy bonus) the entropy too, with autograd."""
        weight = torch.tensor(1.0 / len(parts))

        def verl_loss(received: torch.Tensor, batch: dict[str, torch.Tensor], entropies: Any = None) -> Any:
            part = parts[int(batch[MICRO_BATCH_KEY])]
            outputs = {output: part.as_verl(output, received)}
            if entropies is not None:
                outputs["entropy"] = part.as_verl("entropy", entropies)
            loss = self.call(part, outputs)
            assert loss is not None  # train_batch always has a loss function
            return loss.reshape(()), weight.to(received.device)

        if entropy:  # the Strategy computes the entropy for a loss_fn that takes `entropy`
            return lambda log_probs, batch, entropy: verl_loss(log_probs, batch, entropy)
        return lambda received, batch: verl_loss(received, batch)


def register(model_type: str = "language_model", backend: str = "fsdp2kit", device: Any = ("cuda", "cpu")) -> type:
    """Register the engine in verl's EngineRegistry as verl registers its own (a BaseEngine subclass under
    `model_type`, "language_model" or "value_model", and `backend`, for each device); verl then builds it where its
    engine config's `strategy` is the backend."""
    from verl.workers.engine.base import BaseEngine, EngineRegistry

    engine_class = type("Fsdp2kitVerlEngine", (VerlEngine, BaseEngine), {"__module__": __name__})
    return EngineRegistry.register(model_type=model_type, backend=backend, device=list(device))(engine_class)
