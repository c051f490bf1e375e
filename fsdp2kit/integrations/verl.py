"""fsdp2kit as a verl 0.9 engine: `strategy: fsdp2kit` in verl's own configuration. verl's TrainingWorker
(`verl/workers/engine_workers.py`) builds its engine with `EngineRegistry.new(model_type, backend, model_config=,
engine_config=, optimizer_config=, checkpoint_config=)` and drives it with the calls of
`verl/workers/engine/base.py:BaseEngine`, as `verl/workers/engine/fsdp/transformer_impl.py:FSDPEngine` answers them.
This module is fsdp2kit's side of verl's extension points: `Fsdp2kitEngineConfig` (an EngineConfig with the fields
verl's workers read), the actor and critic configs that hold it, and `Fsdp2kitEngine`, put into verl's
EngineRegistry when this module is imported (converting a config whose `_target_` names one of these classes imports
it). The engine answers verl's calls with a `Strategy`; verl's batches are cut into micro-batches and put back
together by verl's own functions (`prepare_micro_batches`, `postprocess_batch_func`), so only layouts are translated
here; verl's config fields are translated in `verl_keys.py`. The Hydra group files verl's trainer picks up are in
`verl_config/` beside this module (docs/api.md)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from verl.utils import tensordict_utils as tu
from verl.workers.config import ActorConfig, CriticConfig, EngineConfig
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.spec import BlockPlacement, ShardSpec
from verl.workers.engine.utils import _hf_entry_identity, hf_delta_export, postprocess_batch_func, prepare_micro_batches

from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.errors import UserError
from fsdp2kit.integrations.verl_keys import ACTOR_REFUSED, job_config, refuse
from fsdp2kit.models.shards import WeightShard
from fsdp2kit.parallel.mesh import mesh_layout
from fsdp2kit.strategy import Strategy

# verl's loss function: loss_function(model_output=, data=, dp_group=) -> (loss, metrics).
VerlLoss = Callable[..., tuple[torch.Tensor, dict[str, Any]]]
# The key of a Strategy batch that tells the adapter's loss which verl micro-batch it has.
MICRO_BATCH_KEY = "verl_micro_batch"
# The backend name verl's engine configs give as `strategy`.
BACKEND = "fsdp2kit"


@dataclass
class Fsdp2kitEngineConfig(EngineConfig):
    """verl's engine config for fsdp2kit (`trainer/config/engine/fsdp2kit.yaml`): verl's own engine fields, and
    those of FSDPEngineConfig that verl's workers and fsdp2kit read; `overrides` are fsdp2kit `--set` strings for
    what verl's configs do not say (e.g. "training.loss_chunk_tokens=512")."""

    _mutable_fields = EngineConfig._mutable_fields | {"ulysses_sequence_parallel_size"}

    strategy: str = BACKEND
    ulysses_sequence_parallel_size: int = 1
    model_dtype: str = "fp32"
    mixed_precision: dict[str, Any] | None = None
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != BACKEND:
            raise UserError(f"verl engine config: strategy: {self.strategy} (Fsdp2kitEngineConfig is {BACKEND})")


@dataclass
class Fsdp2kitActorConfig(ActorConfig):
    """verl's actor (and reference) config with fsdp2kit as its engine (`actor/fsdp2kit_actor.yaml`)."""

    strategy: str = BACKEND
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1
    use_remove_padding: bool = False
    use_rollout_log_probs: bool = False
    fsdp2kit: Fsdp2kitEngineConfig = field(default_factory=Fsdp2kitEngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        refuse(self, ACTOR_REFUSED, "actor")
        self.engine = self.fsdp2kit
        if self.ulysses_sequence_parallel_size > 1:  # verl's actor-level key, as FSDPActorConfig reads it
            self.fsdp2kit.ulysses_sequence_parallel_size = self.ulysses_sequence_parallel_size


@dataclass
class Fsdp2kitCriticConfig(CriticConfig):
    """verl's critic config with fsdp2kit as its engine (`critic/fsdp2kit_critic.yaml`)."""

    strategy: str = BACKEND
    grad_clip: float = 1.0
    ulysses_sequence_parallel_size: int = 1
    fsdp2kit: Fsdp2kitEngineConfig = field(default_factory=Fsdp2kitEngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine = self.fsdp2kit
        if self.ulysses_sequence_parallel_size > 1:
            self.fsdp2kit.ulysses_sequence_parallel_size = self.ulysses_sequence_parallel_size


class VerlEngine:
    """verl's engine calls answered by a `Strategy` (built in `initialize`, as verl's engines build their model
    there). The data-parallel layout is known before: verl's TrainingWorker asks for it in its constructor."""

    def __init__(
        self,
        model_config: Any,
        engine_config: Any,
        optimizer_config: Any,
        checkpoint_config: Any,
        **kwargs: Any,
    ) -> None:
        self.model_config, self.engine_config = model_config, engine_config
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.mode: str | None = None
        self._strategy: Strategy | None = None
        self._saved: list[Path] = []  # this engine's checkpoints, oldest first (verl's max_ckpt_to_keep)
        self.layout = mesh_layout(
            dist.get_world_size() if dist.is_initialized() else 1,
            StrategyConfig(),
            int(engine_config.ulysses_sequence_parallel_size),
        )

    def initialize(self) -> None:
        """Build the model, optimizer and schedule (again on a later call, verl's `reset`); states go to host
        memory where verl's offload flags say."""
        config = job_config(self.model_config, self.engine_config, self.optimizer_config)
        overrides = tuple(getattr(self.engine_config, "overrides", None) or ())
        self._strategy = Strategy.from_config(config, overrides=overrides)
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
        """One optimizer step over this rank's batch, cut into micro-batches by verl's prepare_micro_batches; the
        schedule waits for `lr_scheduler_step`. Returns what verl's engine returns: per micro-batch `loss` and
        `metrics` (verl's append_to_dict of each), `metrics['grad_norm']`."""
        run = _LossRun(loss_function, self)
        parts = run.prepare(data)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        loss_fn = run.loss_fn(parts, self.strategy.head.output, entropy)
        result = self.strategy.train_step([part.batch for part in parts], loss_fn, step_scheduler=False)
        output = postprocess_batch_func(output_lst=run.outputs, indices=run.indices, data=data)
        output["metrics"]["grad_norm"] = float(result["grad_norm"])
        return output

    def infer_batch(self, data: Any, loss_function: VerlLoss | None = None) -> dict[str, Any]:
        """Log-probs (and entropy where `calculate_entropy`) of every token as verl's engine gives them: a jagged
        tensor like `input_ids`, position t holding log p(token t+1), 0 at each sequence's last position; a critic's
        `values`, one per token; per micro-batch the loss function's loss and metrics, or without one the 1.0
        verl's engine reports."""
        run = _LossRun(loss_function, self)
        parts = run.prepare(data)
        entropy = bool(tu.get_non_tensor_data(data, "calculate_entropy", False))
        kinds = [self.strategy.head.output, *(["entropy"] if entropy else [])]
        for part in parts:
            result = self.strategy.forward_step(part.batch, entropy=entropy)
            run.call(part, {key: part.as_verl(key, result[key]) for key in kinds}, keep_output=True)
        return postprocess_batch_func(output_lst=run.outputs, indices=run.indices, data=data)

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
        """(HF name, full tensor) for the rollout engine, in the parameters' own dtype (model_dtype), as verl's FSDP
        engine sends its state dict. Always the whole model (LoRA merged), which the None PEFT config tells verl,
        whatever `base_sync_done` says; gathering is bucketed (`layered_summon`'s purpose) by full_weights."""
        return self.strategy.full_weights(), None

    def get_per_tensor_param_shard(
        self, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor, ShardSpec]], dict | None]:
        """(HF name, this rank's block flattened, in bf16, verl's `ShardSpec`) per tensor of
        `get_per_tensor_param`, in the same order on every rank and gathered by no one (`Strategy.sharded_weights`:
        every rank reads it to the end). The spec is verl's explicit override: `place` the block's `BlockPlacement`
        in the full tensor, `contributes` False where another rank sends the same block (HSDP replicas; a tensor
        fsdp2kit gathers, fused experts or a merged LoRA weight, arrives whole on every rank and one sends it), and
        `gather_group` the world, whose every rank holds a block (FSDP shards over all ranks, Ulysses' included; a
        whole tensor's sender is not always rank 0); None at one rank, verl's "unsharded"."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        group = dist.group.WORLD if world > 1 else None
        return (_verl_shard(shard, group) for shard in self.strategy.sharded_weights(torch.bfloat16)), None

    def get_per_tensor_param_delta_shard(self, **kwargs: Any) -> tuple[Iterator[tuple[Any, ...]], dict | None]:
        """verl's delta entries `(slots, dtype, counts, positions, values, gather_group)`, computed by verl's own
        `hf_delta_export` from `get_per_tensor_param_shard` against the snapshots that `prime_delta_snapshots`
        (verl's BaseEngine's) took after the seed sync, each entry built by verl's `_hf_entry_identity` (fsdp2kit's
        names are the HF names and its blocks sit in HF coordinates), as verl's FSDP engine does; the snapshots
        become this export's blocks."""
        snapshots = getattr(self, "_delta_shard_snap", None)  # where verl's prime_delta_snapshots keeps them
        if not snapshots:
            raise UserError("verl engine: get_per_tensor_param_delta_shard before prime_delta_snapshots (the seed)")
        shards, _ = self.get_per_tensor_param_shard()
        return hf_delta_export(shards, snapshots, _hf_entry_identity), None

    def get_data_parallel_rank(self) -> int:
        return self.layout.data_parallel_rank(dist.get_rank() if dist.is_initialized() else 0)

    def get_data_parallel_size(self) -> int:
        return self.layout.data_parallel_size

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.strategy.data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        """The first rank of each sequence group reports (every rank of it holds the same outputs)."""
        return self.layout.answers_for_its_data(dist.get_rank() if dist.is_initialized() else 0)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Parameters and/or optimizer state to "cpu" or to this rank's accelerator; gradients are never held
        between fsdp2kit's steps, so `grad` moves nothing (verl requires it to come with `model`)."""
        if grad and not model:
            raise UserError("verl engine: to(grad=True) needs model=True (gradients move with the parameters)")
        include = [kind for kind, moved in (("model_params", model), ("optimizer_states", optimizer)) if moved]
        if self.strategy.optimizer is None:  # a forward-only engine (the reference) has no optimizer state
            include = [kind for kind in include if kind != "optimizer_states"]
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


def _verl_shard(shard: WeightShard, group: dist.ProcessGroup | None) -> tuple[str, torch.Tensor, ShardSpec]:
    """A `WeightShard` as verl's shard export gives it: the block `full[o0 : o0 + l0, ...]` as verl's
    `BlockPlacement` (which `translate_flat_indices` maps to flat positions of the full tensor), the block flat."""
    place = BlockPlacement(tuple(shard.local.shape), tuple(shard.offset), tuple(shard.full_shape))
    spec = ShardSpec(full_shape=tuple(shard.full_shape), place=place, gather_group=group, contributes=shard.contributes)
    return shard.name, shard.local.reshape(-1), spec


class _MicroBatch:
    """One verl micro-batch (a TensorDict cut by verl) and the Strategy batch made from it: right-padded
    input_ids, attention_mask, position_ids, temperature."""

    def __init__(self, data: Any, index: int) -> None:
        self.data = data
        ids = data["input_ids"]
        if not (isinstance(ids, torch.Tensor) and ids.is_nested):
            raise UserError("verl batch: input_ids must be a jagged nested tensor (verl's NO_PADDING layout)")
        self.offsets: torch.Tensor = getattr(ids, "offsets")()  # noqa: B009 (torch's stubs lack nested tensors')
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
        temperature = tu.get(data, "temperature", None)  # one number, or one per sample (this micro-batch's rows)
        if temperature is not None:
            self.batch["temperature"] = torch.as_tensor(temperature, dtype=torch.float32)

    def as_verl(self, kind: str, result: torch.Tensor) -> torch.Tensor:
        """A Strategy result as verl's jagged [b, j] tensor, with autograd: `values` [b, T] one per token as they
        are; log-probs and entropy [b, T-1] (position t: about token t+1) with 0 at each sequence's last position."""
        if kind != "values":
            result = F.pad(result, (0, 1)) * self.predicting
        return torch.nested.nested_tensor_from_jagged(result[self.mask], self.offsets)


class _LossRun:
    """verl's loss function over a step's micro-batches: the batch-wide settings verl's engine gives it
    (`sp_size`, `dp_size`, `batch_num_tokens`), verl's micro-batch cut, and each micro-batch's output in the form
    verl's engine collects (`postprocess_batch_func`'s input)."""

    def __init__(self, loss_function: VerlLoss | None, engine: VerlEngine) -> None:
        self.loss_function = loss_function
        self.group = engine.get_data_parallel_group()
        self.engine = engine
        self.outputs: list[dict[str, Any]] = []
        self.indices: Any = None

    def prepare(self, data: Any) -> list[_MicroBatch]:
        """The micro-batches of `data` as verl's FSDP engine cuts them, each with verl's batch-wide settings."""
        tu.assign_non_tensor(data, sp_size=self.engine.layout.sequence_size)
        tokens = data["loss_mask"].sum() if "loss_mask" in data.keys() else torch.zeros((), dtype=torch.long)
        tokens = tokens.detach().clone()
        dist.all_reduce(tokens, group=self.group)
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.engine.get_data_parallel_size())
        micro_batches, self.indices = prepare_micro_batches(data=data, dp_group=self.group, same_micro_num_in_dp=True)
        return [_MicroBatch(micro, index) for index, micro in enumerate(micro_batches)]

    def call(self, part: _MicroBatch, model_output: dict[str, torch.Tensor], keep_output: bool) -> torch.Tensor:
        """verl's loss function on one micro-batch (1.0 without one, as verl's engine reports), its output
        recorded."""
        if self.loss_function is None:
            loss, metrics = torch.tensor(1.0), dict[str, Any]()
        else:
            loss, metrics = self.loss_function(model_output=model_output, data=part.data, dp_group=self.group)
        output = {"loss": float(loss.detach()), "metrics": metrics}
        if keep_output:
            output["model_output"] = {key: value.detach() for key, value in model_output.items()}
        self.outputs.append(output)
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
            loss = self.call(part, outputs, keep_output=False)
            return loss.reshape(()), weight.to(received.device)

        if entropy:  # the Strategy computes the entropy for a loss_fn that takes `entropy`
            return lambda log_probs, batch, entropy: verl_loss(log_probs, batch, entropy)
        return lambda received, batch: verl_loss(received, batch)


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "npu", "cpu"])
class Fsdp2kitEngine(VerlEngine, BaseEngine):
    """fsdp2kit in verl's EngineRegistry: verl builds it for an engine config whose `strategy` is fsdp2kit."""


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cuda", "npu", "cpu"])
class Fsdp2kitValueEngine(VerlEngine, BaseEngine):
    """The critic (verl's value_model): the same engine, its head a one-label token classifier."""
