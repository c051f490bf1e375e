"""ROLL's strategy interface over `fsdp2kit.Strategy`. ROLL's workers (`roll/pipeline/base_worker.py:ActorWorker`,
CriticWorker) drive a strategy with the calls of `roll/distributed/strategy/strategy.py` (InferenceStrategy,
TrainStrategy) as `roll/distributed/strategy/fsdp2_strategy.py:FSDP2TrainStrategy` answers them, on ROLL's
`DataProto` (a TensorDict `batch`, numpy `non_tensor_batch`, `meta_info`, `chunk`). `RollStrategy` answers them with
a Strategy. Where ROLL hands its forward and loss functions the logits, fsdp2kit never holds the [B, T, vocab]
tensor: they get `TokenOutputs`, which this strategy's `op_compute_log_probs` / `op_compute_entropy` read (the ops
ROLL's workers call on the logits). Nothing here imports ROLL."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fsdp2kit.config.dialects.roll import OUR_STRATEGIES
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.strategy import Strategy

# ROLL's forward_func / loss_func: (data, output) -> (loss, metrics).
RollFunc = Callable[[Any, Any], tuple[torch.Tensor, dict[str, Any]]]
# ROLL's OffloadStateType that its FSDP2 strategy does not move (it moves model_params and optimizer_states only).
IGNORED_STATES = ("other_params",)
# What ROLL's rollout workers call with a weight part's config after its tensors (vLLM's and SGLang's add_lora).
CONFIG_LOADERS = {"adapter": "add_lora"}


def worker_arguments(worker: Any) -> tuple[str, str, tuple[str, ...], dict[str, Any]]:
    """What `Strategy.from_config` gets for a ROLL worker (the source's name, its role, the overrides, ROLL's config as
    a dict), in one place so that tests_roll can hold the schedule it gives to the one ROLL's strategy builds."""
    pipeline, role = worker.pipeline_config, worker.worker_config.name
    source = f"ROLL's pipeline_config ({type(pipeline).__name__})"
    # ROLL's pipeline sets training_args.max_steps over all ranks (set_max_steps); its FSDP2 strategy divides it by the
    # data-parallel size for its schedule, as this does
    steps = worker.worker_config.training_args.max_steps
    overrides = () if steps is None else (f"training.max_steps={steps // worker.rank_info.dp_size}",)
    return source, role, overrides, asdict(pipeline)


@dataclass
class TokenOutputs:
    """What ROLL's forward and loss functions receive in place of the logits: per position t the log-prob of token
    t+1 and the entropy there ([B, T-1], with autograd in train_step)."""

    log_probs: torch.Tensor
    entropy: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.log_probs.device


class RollStrategy:
    """ROLL's fsdp2_train / fsdp2_infer strategy calls answered by a `Strategy`: micro-batches of
    `meta_info['micro_batch_size']` rows (forward) or `per_device_train_batch_size` rows with an optimizer step every
    `gradient_accumulation_steps` (train), ROLL's loss scaling (`apply_loss_scale`), metrics as ROLL collects them."""

    def __init__(self, worker: Any = None) -> None:
        """As ROLL's factory builds a strategy: `strategy_cls(worker)`; `initialize` builds the Strategy from the
        worker's own configuration (its pipeline_config, the role it runs). `from_config` builds one without a
        worker."""
        self.worker = worker
        self.offload_nccl = False  # ROLL's workers read it; gloo/NCCL groups stay up
        self._receivers: dict[str, Any] = {}

    def _attach(self, strategy: Strategy, name: str, apply_loss_scale: bool, entropy_loss: bool) -> None:
        """`entropy_loss`: train_step's loss_func takes the entropy (op_compute_entropy, with autograd), as ROLL's
        actor does where entropy_loss_coef > 0; it costs a chunked pass over the vocabulary, so it is asked for."""
        self.strategy, self.name, self.apply_loss_scale = strategy, name, apply_loss_scale
        self.entropy_loss = entropy_loss
        self.model, self.tokenizer = strategy.model, strategy.tokenizer

    @classmethod
    def from_config(
        cls,
        config: str | Path | dict[str, Any],
        role: str | None = None,
        overrides: tuple[str, ...] = (),
        apply_loss_scale: bool = True,
        entropy_loss: bool = False,
    ) -> RollStrategy:
        """A Strategy from a ROLL pipeline YAML's `role` (actor_train, critic, reference...) or a native config;
        `apply_loss_scale` as ROLL's worker config says (its default: True); `entropy_loss` as in _attach."""
        roll = cls()
        strategy = Strategy.from_config(config, role=role, overrides=overrides)
        roll._attach(strategy, role or "actor_train", apply_loss_scale, entropy_loss)
        return roll

    def initialize(self, *args: Any, **kwargs: Any) -> None:
        """ROLL's worker calls it with its model provider: the Strategy is built from the worker's pipeline_config
        (ROLL's dataclasses as ROLL read the YAML, through fsdp2kit's ROLL dialect) for the worker's role. A
        strategy from from_config is built already."""
        if self.worker is None:
            return
        source, role, overrides, written = worker_arguments(self.worker)
        strategy = Strategy.from_config(source, role, overrides, written=written)
        entropy = role == "actor_train" and float(getattr(self.worker.pipeline_config, "entropy_loss_coef", 0) or 0) > 0
        self._attach(strategy, role, bool(self.worker.worker_config.apply_loss_scale), entropy)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.strategy.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self.strategy.scheduler

    def unwrap_model(self) -> torch.nn.Module:
        return self.strategy.model

    def get_data_input(self, batch: Any) -> Any:
        """ROLL's FSDP2 strategy broadcasts the batch within a Ulysses group; fsdp2kit's workers each get it."""
        return batch

    # ---- forward and train ----------------------------------------------------------------------------------

    def forward_step(self, batch: Any, forward_func: RollFunc) -> dict[str, Any]:
        """No grad: `forward_func(micro_batch, outputs)` per micro-batch of meta_info['micro_batch_size'] rows (a
        language model's TokenOutputs, a critic's values as its logits [B, T, 1]); what the function returns second
        is collated as ROLL collates it (tensors concatenated along the rows)."""
        micro_size = int(batch.meta_info["micro_batch_size"])
        self._global_counts(batch)
        output = self._output()
        results = []
        for data in batch.chunk(chunks=max(len(batch) // micro_size, 1)):
            result = self.strategy.forward_step(_strategy_batch(data), entropy=output == "log_probs")
            _, reduced = forward_func(data, _roll_output(output, result[output], result.get("entropy")))
            results.append(reduced)
        return _collated(results)

    def _output(self) -> str:
        """What the model gives ROLL's functions: log-probs (a causal LM) or a critic's values."""
        output = str(self.strategy.head.output)
        if output not in ("log_probs", "values"):
            raise UserError(f"ROLL strategy: a model of {output} (a reward model) is not supported; its critic is")
        return output

    def train_step(self, batch: Any, loss_func: RollFunc, no_sync: bool = False) -> dict[str, Any]:
        """ROLL's step: micro-batches of per_device_train_batch_size rows, an optimizer step (clipping, schedule)
        every gradient_accumulation_steps of them and after the last; `loss_func(micro_batch, TokenOutputs)` ->
        (loss, metrics). The loss minimised is ROLL's: the sum over micro-batches x ranks x (micro-batches per call x
        data-parallel size, with apply_loss_scale) / (gradient_accumulation_steps x data-parallel size)."""
        if no_sync:
            raise UserError("ROLL strategy: train_step(no_sync=True) is not supported (fsdp2kit syncs at each step)")
        training = self.strategy.cfg.training
        micro_size, accumulation = training.per_device_train_batch_size, training.gradient_accumulation_steps
        steps = len(batch) // micro_size
        if steps < 1 or len(batch) % micro_size:
            raise UserError(
                f"ROLL strategy: train_step got {len(batch)} rows, not a multiple of "
                f"per_device_train_batch_size {micro_size}"
            )
        self._global_counts(batch)
        micro_batches = batch.chunk(chunks=steps)
        dp = self.strategy.data_parallel_size()
        scale = steps * dp if self.apply_loss_scale else 1  # ROLL's loss_scale
        metrics: dict[str, Any] = {}
        for start in range(0, steps, accumulation):
            group = micro_batches[start : start + accumulation]
            # weight w per micro-batch: sum(loss) / sum(w) over all ranks = scale x sum(loss) / (accumulation x dp)
            weight = accumulation / (len(group) * scale)
            result = self.strategy.train_step(
                [_strategy_batch(data, index) for index, data in enumerate(group)],
                _RollLoss(loss_func, group, weight, metrics, self._output()).strategy_loss_fn(self.entropy_loss),
            )
            metrics[f"{self.name}/grad_norm"] = result["grad_norm"]
        return metrics

    def op_compute_log_probs(
        self, logits: TokenOutputs, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """ROLL's op: log-probs [B, T-1] of input_ids[:, 1:], 0 where attention_mask[:, 1:] (the response mask) is."""
        return logits.log_probs * attention_mask[:, 1:].to(logits.log_probs.dtype)

    def op_compute_entropy(self, logits: TokenOutputs, attention_mask: torch.Tensor) -> torch.Tensor:
        """ROLL's op: the entropy [B, T-1] of each position's next-token distribution, 0 outside the mask."""
        if logits.entropy is None:
            raise UserError(
                "ROLL strategy: train_step's loss_func asked for the entropy; build the strategy with entropy_loss=True"
            )
        return logits.entropy * attention_mask[:, 1:].to(logits.entropy.dtype)

    def _global_counts(self, batch: Any) -> None:
        """ROLL's meta_info['batch_num_tokens'] and ['global_valid_samples'] for the keys in
        meta_info['loss_mask_keys'], over the data-parallel ranks. ROLL sums over every rank and divides by its
        context-parallel size; the data-parallel group holds one rank of each Ulysses group, and the functions see
        whole sequences (the Strategy gathers them), so these are the global counts as they are."""
        keys = batch.meta_info.get("loss_mask_keys")
        if not isinstance(keys, list):
            raise UserError("ROLL batch: meta_info['loss_mask_keys'] must be a list of str ([] when none is needed)")
        group = self.strategy.data_parallel_group()
        rows = torch.tensor(len(batch))
        tokens, valid = {}, {"default": rows}
        for key in (k for k in keys if k in batch.batch.keys()):
            mask = _loss_mask(key, batch.batch[key])
            tokens[key], valid[key] = mask.sum().cpu(), mask.any(dim=-1).sum().cpu()
        counts = torch.stack([*tokens.values(), *valid.values()]).long()
        dist.all_reduce(counts, group=group)
        summed = counts.tolist()
        token_sums = dict(zip(tokens, summed[: len(tokens)], strict=True))
        valid_sums = dict(zip(valid, summed[len(tokens) :], strict=True))
        batch.meta_info["batch_num_tokens"] = {k: max(n, 1) for k, n in token_sums.items()}
        batch.meta_info["global_valid_samples"] = {k: max(n, 1) if k != "default" else n for k, n in valid_sums.items()}

    # ---- states, weights, checkpoints -----------------------------------------------------------------------

    def offload_states(self, include: Iterable[Any] | None = None, non_blocking: bool = False) -> None:
        """ROLL's OffloadStateType names (model_params, optimizer_states; other_params, which ROLL's FSDP2 strategy
        does not move either, is skipped); None: all."""
        kinds = _kinds(include)
        if kinds is None or kinds:
            self.strategy.offload_states(kinds, non_blocking)

    def load_states(self, include: Iterable[Any] | None = None, non_blocking: bool = False) -> None:
        kinds = _kinds(include)
        if kinds is None or kinds:
            self.strategy.load_states(kinds, non_blocking)

    def setup_model_update(self, infer_cluster: Any, model_update_name: str) -> None:
        """Where `model_update(model_update_name)` sends the weights: an object with
        `update_parameter_in_bucket(named_weights, is_lora=False)` (a rollout engine's side of ROLL's updater)."""
        if model_update_name in self._receivers:
            raise UserError(f"ROLL strategy: model update {model_update_name!r} is set up already")
        self._receivers[model_update_name] = infer_cluster

    def model_update(self, model_update_name: str, bucket_mb: int = 512) -> dict[str, Any]:
        """The weights in HF names, bucket by bucket of at most `bucket_mb` MiB (ROLL's
        model_update_buffer_size_mb), from rank 0 (ROLL's separated mode); every rank gathers (a collective). As ROLL's
        FSDP2 strategy does, the smallest part a rollout can load goes: a LoRA run's adapters alone (peft's file
        names, `is_lora=True`), then their config to the receiver's `add_lora`; otherwise the whole model."""
        receiver = self._receivers[model_update_name]
        part = self.strategy.weight_parts[-1]
        for bucket in _buckets(self.strategy.full_weights(bucket_bytes=bucket_mb << 20, part=part), bucket_mb << 20):
            if self.strategy.runtime.is_main:
                receiver.update_parameter_in_bucket(bucket, is_lora=part == "adapter")
        config = self.strategy.weights_config(part)
        loader = getattr(receiver, CONFIG_LOADERS.get(part, ""), None)  # ROLL's rollout workers' call for it
        if config is not None and loader is not None and self.strategy.runtime.is_main:
            loader(peft_config=config)
        return {}

    def save_checkpoint(
        self,
        save_dir: str,
        global_step: int,
        ckpt_id: str,
        tag: str = "checkpoint",
        local_state_path: str | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """fsdp2kit's checkpoint (model, optimizer, schedule, RNG; atomic; one folder of every rank's shards). ROLL's
        workers name a folder per rank (`output_dir/actor_train-{rank}/checkpoint-N`): the checkpoint is written
        once, in rank 0's. `local_state_path` (what ROLL's uploader sends; the critic's holds save_dir) must hold
        save_dir. Returns ROLL's metrics dict (empty: no timings)."""
        if local_state_path is not None and not Path(save_dir).is_relative_to(local_state_path):
            raise UserError(
                f"ROLL strategy: save_checkpoint(local_state_path={local_state_path!r}) must hold save_dir {save_dir!r}"
            )
        self.strategy.save_checkpoint(self._rank_zeros(save_dir))
        return {}

    def load_checkpoint(self, load_dir: str, tag: str = "checkpoint", **kwargs: Any) -> None:
        """The checkpoint in rank 0's `load_dir` (where save_checkpoint wrote it), on every rank."""
        self.strategy.load_checkpoint(self._rank_zeros(load_dir))

    def _rank_zeros(self, folder: str) -> str:
        """Rank 0's folder, for every rank: a checkpoint is one folder, where ROLL names one per rank."""
        folders = [folder]
        dist.broadcast_object_list(folders, src=0)
        return str(folders[0])


def fsdp2kit_for_fsdp2(create_strategy: Callable[..., Any]) -> Callable[..., Any]:
    """ROLL's strategy factory (`roll.distributed.strategy.factory.create_strategy`, which ROLL's workers call as
    `create_strategy(worker=self)`) with fsdp2kit answering ROLL's FSDP2 strategy names (fsdp2_train, fsdp2_infer:
    the YAML stays ROLL's, ROLL's own config checks apply); every other name goes to ROLL's factory. ROLL has no
    strategy registry, and its config refuses strategy names it does not list: docs/api.md shows the lines a ROLL
    user writes to put this in place."""

    def create(worker: Any, sync_wrapper: bool = False) -> Any:
        if worker.worker_config.strategy_args.strategy_name in OUR_STRATEGIES:
            return RollStrategy(worker)
        return create_strategy(worker=worker, sync_wrapper=sync_wrapper)

    return create


class _RollLoss:
    """ROLL's loss_func as the Strategy's loss_fn: micro-batch i of `group` (its index passed with the batch) with
    the weight that turns the Strategy's ratio into ROLL's scaled sum; ROLL's metrics appended per micro-batch."""

    def __init__(
        self, loss_func: RollFunc, group: list[Any], weight: float, metrics: dict[str, Any], output: str
    ) -> None:
        self.loss_func, self.group, self.weight, self.metrics = loss_func, group, weight, metrics
        self.output = output

    def strategy_loss_fn(self, entropy: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """The loss_fn the Strategy calls: one taking `entropy` (computed with autograd) only where it is wanted."""
        if entropy:
            return lambda log_probs, batch, entropy: self(log_probs, batch, entropy)
        return lambda received, batch: self(received, batch)

    def __call__(
        self, received: torch.Tensor, batch: dict[str, torch.Tensor], entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        weight = torch.tensor(self.weight, device=received.device)
        data = self.group[int(batch[MICRO_BATCH_KEY])]
        loss, reduced = self.loss_func(data, _roll_output(self.output, received, entropy))
        for key, value in reduced.items():
            self.metrics.setdefault(key, []).append(value)
        return loss.reshape(()), weight


def _roll_output(output: str, received: torch.Tensor, entropy: torch.Tensor | None) -> Any:
    """What ROLL's functions get for the logits: TokenOutputs of a language model; a critic's values [B, T] as the
    token classifier's logits [B, T, 1], which ROLL's critic reads (`output_tensor[:, :-1].squeeze(-1)`)."""
    return TokenOutputs(received, entropy) if output == "log_probs" else received.unsqueeze(-1)


# The key of a Strategy batch that tells the adapter's loss which ROLL micro-batch it has.
MICRO_BATCH_KEY = "roll_micro_batch"


def _strategy_batch(data: Any, index: int = 0) -> dict[str, torch.Tensor]:
    """A ROLL micro-batch as the Strategy takes it: input_ids, attention_mask, position_ids (ROLL's forward args)."""
    if data.meta_info.get("forward_args") or "multi_modal_inputs" in data.non_tensor_batch:
        raise UserError("ROLL batch: forward_args and multi_modal_inputs are not supported by fsdp2kit's strategy")
    tensors = data.batch
    position_ids = tensors["position_ids"]
    if position_ids.dim() != 2:
        raise UserError("ROLL batch: position_ids must be [B, T] (3-D mrope positions are not supported)")
    return {
        "input_ids": tensors["input_ids"].long(),
        "attention_mask": tensors["attention_mask"],
        "position_ids": position_ids,
        MICRO_BATCH_KEY: torch.tensor(index),
    }


def _loss_mask(key: str, value: torch.Tensor) -> torch.Tensor:
    """ROLL's reading of a loss-mask key: labels count where not IGNORE_INDEX, response_mask from position 1."""
    if key in ("labels", "labels_for_loss"):
        return value != IGNORE_INDEX
    if key == "response_mask":
        return value[:, 1:] > 0
    return value > 0


def _kinds(include: Iterable[Any] | None) -> list[str] | None:
    if include is None:
        return None
    names = [str(getattr(kind, "value", kind)) for kind in include]
    return [name for name in names if name not in IGNORED_STATES]


def _collated(results: list[dict[str, Any]]) -> dict[str, Any]:
    """ROLL's collate_fn_to_dict_list: tensors concatenated along the rows, anything else listed."""
    keys = list(dict.fromkeys(key for result in results for key in result))
    collated: dict[str, Any] = {}
    for key in keys:
        values = [result[key] for result in results if key in result]
        collated[key] = torch.cat(values) if isinstance(values[0], torch.Tensor) else values
    return collated


def _buckets(weights: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """What ROLL's updater sends per call: consecutive (name, tensor) pairs of at most `bucket_bytes`."""
    bucket: list[tuple[str, Any]] = []
    size = 0
    for name, tensor in weights:
        if bucket and size + tensor.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += tensor.nbytes
    if bucket:
        yield bucket
