"""`fsdp2kit.Strategy`: the back-end that RL frameworks and custom loops drive from Python, as ROLL's workers drive
their `fsdp2_train` / `fsdp2_infer` strategies. The `train` and `infer` commands are its clients: what they prove,
the API gets.

Batches given to the API follow transformers' convention (`input_ids` [B, T], `labels` unshifted, -100 = no target).
Inside, a batch is held shifted, as the commands' data pipeline makes it: the model reads positions 0..T-2 and
position t's target is token t+1, so the logits (or log-probs) of position t are those of `log_probs[:, t]`."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from fsdp2kit.checkpoint.manager import CheckpointManager, read_trainer_state
from fsdp2kit.config.load import grant_remote_code, load_config, validate
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.config.yaml_io import apply_overrides
from fsdp2kit.data.dataset import load_tokenizer, model_inputs
from fsdp2kit.distributed import Runtime, init_distributed, returning_freed_memory, reuse_freed_memory
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.models.export import export_hf, hf_shards, hf_tensors
from fsdp2kit.models.heads import ValueHead
from fsdp2kit.models.sharded import ShardedModel, build_sharded_model
from fsdp2kit.models.shards import SyncedWeights, WeightShard
from fsdp2kit.parallel.fsdp import discard_unreduced_grads
from fsdp2kit.parallel.mesh import data_parallel_group
from fsdp2kit.parallel.sequence_layout import gathered_order
from fsdp2kit.parallel.token_logprobs import TokenRequest, chunk_tokens, kept_logits_budget, token_request
from fsdp2kit.train.evaluate import EvalResult, eval_loss
from fsdp2kit.train.grads import LossScaler, NonFiniteGuard
from fsdp2kit.train.host_states import HostStates, state_tensors
from fsdp2kit.train.optim import build_optimizer, build_scheduler
from fsdp2kit.train.packing import (
    PackedRows,
    WithEmptyMicroBatches,
    empty_micro_batch,
    pack_rows,
    split_rows,
)
from fsdp2kit.train.resume import (
    apply_settings,
    changed_optimizer_keys,
    check_same_optimizer,
    check_trainer_state,
    optimizer_settings,
)
from fsdp2kit.train.step import (
    MicroBatchLoss,
    MicroBatchTerms,
    StepResult,
    TokenCrossEntropy,
    agree_on_micro_batch_count,
    micro_batch_extremes,
    train_step,
    with_aux_loss,
)
from fsdp2kit.train.token_checks import check_token_batch
from fsdp2kit.weight_sync import WeightSender

Batch = dict[str, torch.Tensor]
# What offload_states / load_states move (ROLL's OffloadStateType names): the parameters' shards, the optimizer state.
STATE_KINDS = ("model_params", "optimizer_states")
# What the commands ask of a model's head, in their refusal of a value or reward model (and in `check`'s).
TRAIN_COMMAND = "the train command (next-token cross-entropy)"
INFER_COMMAND = "the infer command (next-token log-probs)"
# loss_fn(log_probs, batch[, entropy]) -> (loss_sum, weight[, metrics]); a value model's gets values or scores.
LossFn = Callable[..., tuple[Any, ...]]
# input_ids' dtypes the API takes (int32 as rollout engines and tokenizers' numpy arrays give them).
TOKEN_DTYPES = (torch.int64, torch.int32)

# forward_step always works in chunks (of 256 tokens unless training.loss_chunk_tokens says otherwise): its point
# is log-probs and entropies without the [B, T, vocab] float32 tensor and its temporaries.
FORWARD_CHUNK_TOKENS = 256


class Strategy:
    """One sharded model on this rank, with its optimizer, schedule and loss scaler when it trains."""

    def __init__(
        self, cfg: JobConfig, runtime: Runtime, total_steps: int | None = None, training: bool | None = None
    ) -> None:
        """`training` defaults to what strategy_args.strategy_name says (fsdp2_train or fsdp2_infer)."""
        self.cfg, self.runtime = cfg, runtime
        tc = cfg.training
        self.training = cfg.strategy_args.strategy_name == "fsdp2_train" if training is None else training
        torch.manual_seed(tc.seed)
        self.sharded: ShardedModel = build_sharded_model(
            cfg.model,
            cfg.strategy_args.strategy_config,
            cfg.data,
            runtime,
            training=self.training,
            seed=tc.seed,
            compile_layers=tc.compile,
        )
        self.model = self.sharded.model
        self._data_parallel_group = data_parallel_group(self.sharded.layout)
        self.head = self.sharded.variant.head  # log-probs, a critic's values or a reward model's scores
        self.head.install(self.model, runtime.device, cfg.model.name_or_path)
        reshard(self.model)  # the install's probe forward: the optimizer must hold the sharded parameters
        self.tokenizer = load_tokenizer(self.sharded.source.tokenizer_path, cfg.model.trust_remote_code)
        hf_config = self.sharded.source.hf_config
        self.vocab_size = _vocab_size(hf_config)
        self.max_positions = getattr(hf_config.get_text_config(), "max_position_embeddings", None)
        self.open_weight_streams = 0  # full_weights iterators started and neither finished nor closed on this rank
        self.chunk_tokens = chunk_tokens(tc.loss_chunk_tokens, self.vocab_size, self.sharded.layout.tp_size)
        self.kept_logits_bytes = kept_logits_budget(tc.loss_chunk_tokens, self.vocab_size)
        self.aux_loss_coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
        self._model_keys = set(inspect.signature(self.model.forward).parameters) - {"labels"}
        self.optimizer = build_optimizer(self.model, tc) if self.training else None
        plan = self.sharded.plan
        # fp32 master weights; computing or reducing gradients in fp16 needs loss scaling.
        self.scaler = LossScaler("fp16" in (plan.param_dtype, plan.reduce_dtype), tc.fp16_initial_scale)
        self.guard = NonFiniteGuard(tc.max_nonfinite_steps, self.scaler)
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        self.steps_done = 0
        self.parked: dict[str, HostStates] = {}  # offload_states' host buffers, per state kind, kept for reuse
        if self.training and total_steps is not None:
            self.set_schedule(total_steps)

    @classmethod
    def from_config(
        cls,
        config: str | Path | dict[str, Any],
        role: str | None = None,
        overrides: Sequence[str] = (),
        trust_remote_code: bool = False,
        written: dict[str, Any] | None = None,
    ) -> Strategy:
        """A config as `fsdp2kit train` takes it (a file of any dialect, or a dict in the native schema) and `--set`
        strings. Joins the process group torchrun (or the caller) set up, else runs as a world of one. The schedule
        runs over training.max_steps. `trust_remote_code` (`--trust-remote-code`) lets transformers run a model
        folder's own code; the config's model.trust_remote_code never does. `written`: a file's contents a framework
        holds in memory (of any dialect; `config` then names it in messages)."""
        if not isinstance(config, str | Path | dict):
            raise UserError(
                "Strategy.from_config: config must be a path to a config file or a dict in the native schema, "
                f"not {type(config).__name__}"
            )
        if isinstance(config, dict):
            cfg = validate(apply_overrides(dict(config), list(overrides)), "config")
            grant_remote_code(cfg, trust_remote_code)
        else:
            cfg = load_config(config, list(overrides), role, None, trust_remote_code, written)
        runtime = init_distributed(cfg.device_mapping)
        # The build seeds torch's RNG (training.seed: fresh weights, dropout); the caller's RNG is the caller's.
        with torch.random.fork_rng(devices=[runtime.device] if runtime.device.type == "cuda" else []):
            strategy = cls(cfg, runtime)
        if strategy.training:
            if cfg.training.max_steps <= 0 and cfg.training.lr_scheduler_type != "constant":
                raise UserError(
                    "training.max_steps: the Strategy API needs it to lay out the learning-rate schedule "
                    "(or set training.lr_scheduler_type: constant)"
                )
            strategy.set_schedule(max(1, cfg.training.max_steps))
        return strategy

    # ---- training ---------------------------------------------------------------------------------------------

    def set_schedule(self, total_steps: int) -> None:
        """Warmup and decay over `total_steps` optimizer steps."""
        self.scheduler = build_scheduler(self._trainer_optimizer(), self.cfg.training, total_steps)

    def train_step(
        self,
        micro_batches: Sequence[Batch],
        loss_fn: LossFn | None = None,
        step_scheduler: bool = True,
        max_tokens: int | None = None,
    ) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (as many on every rank; gradient sync on the last only),
        minimising sum(loss_sum) / sum(weight) over all micro-batches of all data-parallel ranks. `loss_fn(log_probs,
        batch) -> (loss_sum, weight[, metrics])` is called once per micro-batch with log_probs [B, T-1] float32
        (log p(input_ids[:, t+1] | ..t), at the batch's `temperature` if it has one) with autograd and the batch as
        given; a `loss_fn` with a parameter named `entropy` also gets the entropy [B, T-1] with autograd; `metrics`
        (a dict of scalars) come back averaged over the global batch's micro-batches. Default: token-mean
        cross-entropy over `labels` (every next token where there are none). Without `step_scheduler` the learning
        rate stays until `scheduler_step` (several optimizer steps per RL step). With `max_tokens` each micro-batch's
        rows are cut into runs of at most that many real tokens (`_budgeted`); with model.remove_padding each
        micro-batch is packed (train/packing.py) and loss_fn gets the same [B, T-1] layout, 0 at padding."""
        model_batches: list[Batch] = []
        refused: UserError | None = None
        try:  # this rank's own checks, all before the step's first collective
            model_batches, loss = self._step_inputs(micro_batches, loss_fn, max_tokens)
        except UserError as error:
            refused = error  # raised on every rank by `_agree`: none waits in the step's collectives
        empty = self._agree(len(model_batches), "train_step", refused)
        if max_tokens is not None and empty:  # else unequal counts are refused by the step
            real = len(model_batches)
            model_batches += [empty_micro_batch(model_batches[0]) for _ in range(empty)]
            loss = WithEmptyMicroBatches(loss, real)
        return _reported(self.step(model_batches, loss, step_scheduler=step_scheduler))

    def _step_inputs(
        self, micro_batches: Sequence[Batch], loss_fn: LossFn | None, max_tokens: int | None
    ) -> tuple[list[Batch], MicroBatchLoss]:
        """train_step's micro-batches as the model reads them and their loss, or this rank's UserError on them (no
        collective)."""
        if not micro_batches:
            raise UserError("train_step: give at least one micro-batch (a dict with input_ids [B, T])")
        self._require_loaded(STATE_KINDS, "train_step")
        self._require_step_ready()
        batches = [self.device_batch(mb, f"micro-batch {i}") for i, mb in enumerate(micro_batches)]
        batches = self._budgeted(batches, max_tokens, "train_step")
        if isinstance(self.head, ValueHead):  # a value or reward model: loss_fn gets its values or scores
            return self._head_loss(self.head, batches, loss_fn)
        return self._log_prob_loss(batches, loss_fn)

    def _agree(self, count: int, what: str, refused: UserError | None = None) -> int:
        """One all_reduce before a call's first collective, on every rank: that every rank is in this call (with
        full_weights read on rank 0 alone, the ranks met in mismatched collectives and hung), that none `refused`
        its batch (raised on every rank, see `agree_on_refusal`), and how many empty micro-batches this rank adds
        to its `count` so that every rank runs as many."""
        _, most = micro_batch_extremes(count, self.runtime.device, what, refused)
        return most - count

    def _budgeted(self, batches: list[Batch], max_tokens: int | None, what: str) -> list[Batch]:
        """The micro-batches cut to a token budget (`_agree` evens the ranks' counts)."""
        if max_tokens is None:
            return batches
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise UserError(f"{what}: max_tokens must be a whole number >= 1 (real tokens per micro-batch)")
        return [part for batch in batches for part in split_rows(batch, max_tokens)]

    def _packed(self, batch: Batch, inputs: Batch, what: str, targets: torch.Tensor | None = None) -> PackedRows | None:
        """The batch (its model `inputs`, and a causal LM's shifted `targets`) packed into one stream of its real
        tokens under model.remove_padding, else None."""
        if not self.cfg.model.remove_padding:
            return None
        temperature = batch.get("temperature")
        if self.sharded.sp_group is not None and temperature is not None and temperature.dim():
            raise UserError(
                f"{what}: model.remove_padding under Ulysses takes one temperature for the batch, not one per sample"
            )
        return pack_rows(batch, inputs, what, targets)

    def _head_packed(self, head: ValueHead, batch: Batch, inputs: Batch, what: str) -> PackedRows | None:
        """A value or reward model's batch packed under model.remove_padding, where its outputs are all computed.
        Packed, or split over a sequence-parallel group, an output at padding is not the padded computation's."""
        packed = self._packed(batch, inputs, what)
        if packed is not None:
            head.check_padding_unread(
                batch,
                packed.real,
                f"{what}: model.remove_padding computes only the tokens attention_mask marks real",
                "turn model.remove_padding off",
            )
        elif self.sharded.sp_group is not None and batch.get("attention_mask") is not None:
            head.check_padding_unread(
                batch,
                batch["attention_mask"].bool(),
                f"{what}: under sequence parallel an output at padding depends on how the sequence is split",
                "run without model.ulysses_size and model.context_parallel_size",
            )
        return packed

    def _log_prob_loss(self, batches: list[Batch], loss_fn: LossFn | None) -> tuple[list[Batch], MicroBatchLoss]:
        """A causal LM's micro-batches as the model reads them (packed under model.remove_padding) and their loss:
        loss_fn's over log-probs, or the default cross-entropy."""
        shifted = [self._shifted(mb, loss_fn is None) for mb in batches]
        packing = [
            self._packed(mb, s, f"micro-batch {i}", s["labels"][:, :-1])
            for i, (mb, s) in enumerate(zip(batches, shifted, strict=True))
        ]
        model_batches = [p.stream if p is not None else s for p, s in zip(packing, shifted, strict=True)]
        loss: MicroBatchLoss
        if loss_fn is None:
            if any(mb.get("temperature") is not None for mb in batches):
                raise UserError(
                    "train_step: a batch's temperature applies to the log-probs a loss_fn receives; the default "
                    "cross-entropy takes none (give a loss_fn, or drop 'temperature')"
                )
            loss = TokenCrossEntropy(self.chunk_tokens)
        else:
            entropy = "entropy" in inspect.signature(loss_fn).parameters
            loss = LogProbLoss(
                loss_fn,
                batches,
                self.sharded.sp_group,
                self.chunk_tokens,
                entropy=entropy,
                packing=packing,
                kept_bytes=self.kept_logits_bytes,
            )
        return model_batches, loss

    def _head_loss(
        self, head: ValueHead, batches: list[Batch], loss_fn: LossFn | None
    ) -> tuple[list[Batch], MicroBatchLoss]:
        """A value or reward model's micro-batches (every position) and its loss_fn(values or scores, batch)."""
        if loss_fn is None:
            raise UserError(
                f"train_step: a model of {head.output} has no default loss; give loss_fn({head.output}, batch)"
            )
        model_batches = [head.model_batch(mb, self._model_keys) for mb in batches]
        pairs = enumerate(zip(batches, model_batches, strict=True))
        packing = [self._head_packed(head, mb, m, f"micro-batch {i}") for i, (mb, m) in pairs]
        model_batches = [p.stream if p is not None else m for p, m in zip(packing, model_batches, strict=True)]
        group, chunk = self.sharded.sp_group, self.chunk_tokens
        return model_batches, HeadOutputLoss(loss_fn, batches, group, chunk, packing=packing, head=head)

    def step(
        self,
        micro_batches: list[Batch],
        loss: MicroBatchLoss | None = None,
        on_micro_batch_done: Callable[[], None] | None = None,
        step_scheduler: bool = True,
    ) -> StepResult:
        """One optimizer step over shifted micro-batches on this rank's device (the `train` command's batches)."""
        optimizer = self._require_step_ready()
        if loss is None:
            self.head.require_log_probs(TRAIN_COMMAND)
        reuse_freed_memory(self.runtime.device)
        try:
            result = train_step(
                self.model,
                micro_batches,
                optimizer,
                self.scheduler if step_scheduler else None,
                self.guard,
                self.cfg.training.max_grad_norm,
                self.aux_loss_coef,
                self.sharded.sp_group,
                self.sharded.variant.shard_batch,
                on_micro_batch_done=on_micro_batch_done,
                loss=loss if loss is not None else TokenCrossEntropy(self.chunk_tokens),
                sync_each_batch=self.cfg.strategy_args.strategy_config.sync_each_batch,
                tp_size=self.sharded.layout.tp_size,
            )
        except UserError:  # raised part-way (on every rank: a loss_fn's result, all-reduced weights)
            optimizer.zero_grad(set_to_none=True)  # the gradients of the micro-batches before: no step took them
            discard_unreduced_grads(self.model)
            reshard(self.model)  # a forward without its backward leaves the root's parameters gathered
            raise
        self.steps_done += 1
        return result

    def _require_step_ready(self) -> torch.optim.Optimizer:
        """The optimizer, where this rank can take a step: no full_weights() iterator half-read, a schedule set."""
        optimizer = self._trainer_optimizer()
        if self.open_weight_streams:
            raise UserError(
                "train_step: a full_weights() iterator on this rank is half-read; every rank must read it to the end "
                "(or close() it) before a step: the other ranks wait in its gathers, and its rest would be the "
                "stepped weights"
            )
        if self.scheduler is None:
            raise UserError("train_step: the learning-rate schedule is not set (Strategy.set_schedule)")
        return optimizer

    def scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one step (after `train_step(..., step_scheduler=False)`); returns
        the learning rate the next optimizer step uses."""
        if self.scheduler is None:
            raise UserError("scheduler_step: the learning-rate schedule is not set (Strategy.set_schedule)")
        self.scheduler.step()
        return float(self.scheduler.get_last_lr()[0])

    # ---- data parallel ----------------------------------------------------------------------------------------

    def data_parallel_size(self) -> int:
        """How many ranks train different micro-batches (the ranks of a Ulysses group share theirs)."""
        return self.sharded.layout.data_parallel_size

    def data_parallel_rank(self) -> int:
        """This rank's index among them: which share of a global batch it takes."""
        return self.sharded.layout.data_parallel_rank(self.runtime.rank)

    def data_parallel_group(self) -> dist.ProcessGroup:
        """The process group of this rank's data-parallel peers (the world without Ulysses), for a caller's own
        reductions over the global batch."""
        group = self._data_parallel_group if self._data_parallel_group is not None else dist.group.WORLD
        if group is None:
            raise UserError("data_parallel_group: the process group has ended (Strategy used after shutdown)")
        return group

    # ---- forward only -----------------------------------------------------------------------------------------

    @torch.no_grad()
    def forward_step(
        self,
        batch: Batch,
        entropy: bool = False,
        temperature: float | torch.Tensor | None = None,
        max_tokens: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """log_probs [B, T-1] of input_ids[:, 1:] (and their entropy [B, T-1] when asked), in chunks of tokens, at
        `temperature` (one number or one per sample; or the batch's own `temperature`): of logits / temperature.
        With `max_tokens`, forwards of at most that many real tokens (as many on every data-parallel rank); with
        model.remove_padding, of the packed real tokens, 0 where token t or t+1 is padding. At padding positions
        otherwise: what the padded computation gives, which under Ulysses or context parallel equals one rank's where
        the batch has left padding; in a batch with right padding alone it depends on the layout."""
        forwards: list[Callable[[], dict[str, torch.Tensor]]] = []
        parts: list[Batch] = []
        refused: UserError | None = None
        try:  # this rank's own checks, all before the first collective
            parts, forwards = self._forward_inputs(batch, entropy, temperature, max_tokens)
        except UserError as error:
            refused = error  # raised on every rank by `_agree`: none waits in the forward's all-gathers
        empty = self._agree(len(forwards), "forward_step", refused)
        results = [forward() for forward in forwards]
        for _ in range(empty if max_tokens is not None else 0):  # as many forwards as other ranks (resharded after)
            with self._inference():
                self.model(**model_inputs(self._sequence_slice(empty_micro_batch(parts[0]))), use_cache=False)
        return {key: torch.cat([result[key] for result in results]) for key in results[0]}

    def _forward_inputs(
        self, batch: Batch, entropy: bool, temperature: float | torch.Tensor | None, max_tokens: int | None
    ) -> tuple[list[Batch], list[Callable[[], dict[str, torch.Tensor]]]]:
        """forward_step's parts of the batch on the device, and their forwards, checked and ready to run (no
        collective yet)."""
        if temperature is not None:
            if batch.get("temperature") is not None:
                raise UserError("forward_step: give the temperature once, as the argument or as the batch's key")
            batch = {**batch, "temperature": torch.as_tensor(temperature)}
        self._require_loaded(("model_params",), "forward_step")
        parts = self._budgeted([self.device_batch(batch, "batch")], max_tokens, "forward_step")
        head = self.head
        if isinstance(head, ValueHead):  # a value or reward model: its values or scores
            return parts, [self._head_forward(head, part, entropy) for part in parts]
        return parts, [self._token_outputs(part, entropy) for part in parts]

    def _token_outputs(self, api_batch: Batch, entropy: bool) -> Callable[[], dict[str, torch.Tensor]]:
        """forward_step's log-probs (and entropies) of one batch, packed under model.remove_padding: checked now,
        computed when called."""
        shifted = self._shifted(api_batch, default_targets=False)
        packed = self._packed(api_batch, shifted, "forward_step", shifted["labels"][:, :-1])
        temperature = api_batch.get("temperature")

        def forward() -> dict[str, torch.Tensor]:
            with self._inference():
                if packed is None:  # the last position predicts nothing
                    log_probs, entropies = self.token_logprobs(shifted, entropy, temperature)
                    log_probs = log_probs[:, :-1]
                    entropies = entropies[:, :-1] if entropies is not None else None
                else:
                    log_probs, entropies = self.token_logprobs(
                        packed.stream, entropy, packed.token_temperature(temperature)
                    )
                    log_probs = packed.unpack(log_probs)
                    entropies = packed.unpack(entropies) if entropies is not None else None
            return {"log_probs": log_probs} | ({"entropy": entropies} if entropies is not None else {})

        return forward

    def _sequence_slice(self, batch: Batch) -> Batch:
        """This rank's slice of a shifted batch under sequence parallel; the batch itself otherwise."""
        group = self.sharded.sp_group
        return self.sharded.variant.shard_batch(batch, group) if group is not None else batch

    def _head_forward(self, head: ValueHead, api_batch: Batch, entropy: bool) -> Callable[[], dict[str, torch.Tensor]]:
        """`values` [B, T] or `scores` [B] of the batch as given, in eval mode: checked now, computed when called."""
        if entropy:
            head.require_log_probs("forward_step(entropy=True)")
        model_batch = head.model_batch(api_batch, self._model_keys)
        packed = self._head_packed(head, api_batch, model_batch, "forward_step")
        model_batch = packed.stream if packed is not None else model_batch
        group = self.sharded.sp_group

        def forward() -> dict[str, torch.Tensor]:
            with self._inference():
                local = self._sequence_slice(model_batch)
                outputs, _ = head_outputs(self.model, head, local, api_batch, group, packed)
            return {head.output: outputs}

        return forward

    @torch.no_grad()
    def evaluate(self, micro_batches: Iterable[Batch]) -> EvalResult:
        """The token-mean cross-entropy of shifted micro-batches (the `train` command's, labels already shifted)
        over all data-parallel ranks, in eval mode, without gradients; every rank must give as many micro-batches
        (`train/evaluate.py:EvalBatches`)."""
        layout, device = self.sharded.layout, self.runtime.device
        sharing = layout.sequence_size * layout.tp_size  # ranks with the same micro-batches and the same log-probs
        with self._inference():
            on_device = ({k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in micro_batches)
            return eval_loss(lambda b: self.token_logprobs(b)[0], on_device, device, sharing)

    @contextmanager
    def _inference(self) -> Iterator[None]:
        """Eval mode within the block; afterwards the mode as it was and the model resharded."""
        was_training = self.model.training
        self.model.eval()
        try:
            yield
        finally:
            self.model.train(was_training)
            reshard(self.model)

    def token_logprobs(
        self, shifted: Batch, entropy: bool = False, temperature: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of the shifted batch's `labels` (0 where IGNORE_INDEX) for its whole sequences, at `temperature`
        (float32, [] or [B]): under sequence parallel each rank computes its slice and the slices are gathered
        (with autograd)."""
        self.head.require_log_probs("token_logprobs")
        reuse_freed_memory(self.runtime.device)
        group = self.sharded.sp_group
        local = self.sharded.variant.shard_batch(shifted, group) if group is not None else shifted
        chunk = self.chunk_tokens or FORWARD_CHUNK_TOKENS
        with token_request(
            self.model, TokenRequest(local["labels"], chunk, entropy, temperature=temperature)
        ) as request:
            outputs = self.model(**model_inputs(local), use_cache=False)
        log_probs, entropies = outputs.logits, request.entropies
        if group is not None:
            length = shifted["labels"].shape[1]
            log_probs = gather_sequence(log_probs, group)[:, :length]
            entropies = gather_sequence(entropies, group)[:, :length] if entropies is not None else None
        return log_probs, entropies

    # ---- weights, states, files -------------------------------------------------------------------------------

    def full_weights(
        self, dtype: torch.dtype | None = None, bucket_bytes: int = 512 << 20, part: str = "model"
    ) -> Iterator[Any]:
        """(hf_name, tensor) over the whole model in the names transformers and vLLM load (LoRA: merged), on every
        rank, gathered a bucket of at most `bucket_bytes` at a time (one tensor larger than that is its own
        bucket); the caller picks who sends. Every rank must iterate it to the end: each tensor is a collective. The
        tensors are copies at every world size (a world of one would otherwise yield the live parameters, which the
        next step changes in place under a rollout engine holding them). A step while it is half-read is refused
        (`step`), and so is reading on after one: its tensors would mix weights from before and after.
        `part`: one of `weight_parts` ("adapter": a LoRA run's adapters alone, in peft's file names)."""
        tensors = self._synced(part, "full_weights").tensors(dtype)
        return self._weight_stream("full_weights", self._weight_buckets(tensors, bucket_bytes))

    def sharded_weights(self, dtype: torch.dtype | None = None, part: str = "model") -> Iterator[WeightShard]:
        """This rank's block of every tensor `full_weights` gives (the same names; LoRA merged), with where it sits
        in the whole tensor (`WeightShard`): a receiver assembles the model from every rank's blocks and no rank
        gathers it. A tensor stored otherwise than the model holds it (fused experts) or a merged LoRA weight is
        gathered and sent whole by one rank, in turn. The blocks are copies; the rules of `full_weights` hold (every
        rank reads it to the end, no step while it is half-read)."""
        return self._weight_stream("sharded_weights", self._synced(part, "sharded_weights").shards(dtype))

    def weight_sender(
        self,
        dtype: torch.dtype | None = None,
        part: str = "model",
        delta: bool = True,
        full_every: int | None = None,
        bucket_bytes: int = 64 << 20,
    ) -> WeightSender:
        """A weight sync to one rollout engine (docs/weight_sync.md), on every rank: `sync` / `start` send this
        rank's blocks of `part` in `dtype` (the rollout's), each sync at version `steps_done`; after the first, only
        what changed since the version the receiver reports (`delta`), whole every `full_every` versions if asked."""
        synced = self._synced(part, "weight_sender")
        return WeightSender(
            lambda: self._weight_stream("weight_sender", synced.shards(dtype), agreed=True),
            part,
            lambda: self.steps_done,
            delta,
            full_every,
            bucket_bytes,
            synced.config,
            agree=lambda: agree_on_micro_batch_count(0, self.runtime.device, "weight_sender"),
        )

    @property
    def weight_parts(self) -> list[str]:
        """The parts of the weights a rollout engine can load: "model" (the whole model), then the model variant's
        own, the smallest last (a LoRA run: "adapter")."""
        return list(self._synced_parts())

    def weights_config(self, part: str) -> dict[str, Any] | None:
        """What a loader of `part` reads beside its tensors (a LoRA adapter's adapter_config.json), or None."""
        return self._synced(part, "weights_config").config

    def _synced_parts(self) -> dict[str, SyncedWeights]:
        whole = SyncedWeights("model", partial(hf_tensors, self.model), partial(hf_shards, self.model))
        offered = self.sharded.variant.synced_weights(self.model, self.cfg.model.name_or_path)
        return {weights.part: weights for weights in [whole, *offered]}

    def _synced(self, part: str, what: str) -> SyncedWeights:
        parts = self._synced_parts()
        if part not in parts:
            raise UserError(f"{what}: part={part!r} is not a part of this model's weights; valid: {', '.join(parts)}")
        return parts[part]

    def _weight_stream(self, what: str, items: Iterator[Any], agreed: bool = False) -> Iterator[Any]:
        """`items` (a collective stream of weights) for the caller, refused where a step comes while it is read;
        `agreed`: the caller's first collective checked already that every rank is in the same call."""
        started = self.steps_done
        self.open_weight_streams += 1
        try:
            if not agreed:
                agree_on_micro_batch_count(0, self.runtime.device, what)  # not one rank alone: see full_weights' docs
            for item in items:
                if self.steps_done != started:
                    raise UserError(
                        f"{what}: the model stepped (step {started} -> {self.steps_done}) while this iterator "
                        "was half-read; its rest would mix weights from before and after: start a new one"
                    )
                yield item
        finally:
            self.open_weight_streams -= 1

    def _weight_buckets(
        self, tensors: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """full_weights' copies, gathered a bucket at a time."""
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        live = {_storage(t) for t in (*self.model.parameters(), *self.model.buffers())}
        for name, weight in tensors:
            if bucket and size + weight.nbytes > bucket_bytes:
                yield from bucket
                bucket, size = [], 0
            tensor = weight.clone() if _storage(weight) in live else weight  # after the bucket before is gone
            bucket.append((name, tensor))
            size += tensor.nbytes
        yield from bucket

    def offload_states(self, include: Iterable[str] | None = None, non_blocking: bool = False) -> None:
        """Parameters and optimizer state to host memory (the accelerator's memory is freed for a rollout engine),
        or only those `include` names (STATE_KINDS); gradients are never held between steps. With `non_blocking`
        the copies may still run when it returns. On a CPU run the states are in host memory already: nothing
        moves."""
        self._move_states(torch.device("cpu"), _state_kinds(include), non_blocking)

    def load_states(self, include: Iterable[str] | None = None, non_blocking: bool = False) -> None:
        """Back to this rank's device after `offload_states` (all states, or those `include` names)."""
        self._move_states(self.runtime.device, _state_kinds(include), non_blocking)

    def save_checkpoint(self, path: str | Path) -> None:
        """A DCP checkpoint of model, optimizer, schedule and RNG at `path`, committed atomically (a collective)."""
        final = Path(path)
        manager = self._checkpoints(final.parent, async_save=False)
        manager.save(
            self.steps_done, self.model, self._trainer_optimizer(), self.trainer_state(), blocking=True, final=final
        )

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Model, optimizer, schedule, loss scale and RNG from a checkpoint of any world size; returns its trainer
        state (its `step`)."""
        folder = Path(path)
        return self.load_from(self._checkpoints(folder.parent, async_save=False), folder)

    def load_from(self, manager: CheckpointManager, path: Path) -> dict[str, Any]:
        """A checkpoint's state, continued with this run's optimizer settings (learning rate, betas, eps, weight
        decay: the moments and the schedule's step come from the checkpoint), each change said in one line."""
        optimizer = self._trainer_optimizer()
        check_same_optimizer(path, read_trainer_state(path).get("config", {}), self.cfg.training)
        settings = optimizer_settings(optimizer)
        with returning_freed_memory(self.runtime.device):
            state = manager.load(path, self.model, optimizer)
        check_trainer_state(state, path)
        self.restore(state)
        if self.scheduler is not None:
            apply_settings(optimizer, self.scheduler, settings)
        changes = changed_optimizer_keys(state.get("config", {}), self.cfg.saved_dict())
        if changes and self.runtime.is_main:
            print(f"resuming with this run's optimizer settings: {', '.join(changes)}", flush=True)
        return state

    def export_hf(self, path: str | Path) -> None:
        """The model as an HF safetensors folder (LoRA: merged), written by rank 0 (a collective)."""
        source = self.sharded.source
        with returning_freed_memory(self.runtime.device):
            export_hf(self.model, Path(path), source.tokenizer_path, self.cfg.model.dtype, self.runtime.is_main)

    def trainer_state(self, consumed_samples: int = 0) -> dict[str, Any]:
        """What a checkpoint holds besides tensors: the step, schedule, loss scale and config."""
        return {
            "step": self.steps_done,
            "consumed_samples": consumed_samples,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else {},
            "loss_scaler": self.scaler.state_dict(),
            "config": self.cfg.saved_dict(),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """The schedule, loss scale and step count of a loaded trainer state."""
        self.steps_done = int(state["step"])
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])
        if "loss_scaler" in state:
            self.scaler.load_state_dict(state["loss_scaler"])

    def checkpoint_manager(self, output_dir: Path, keep: int | None = None) -> CheckpointManager:
        """The `train` command's checkpoints under output_dir, async as strategy_config.async_save_ckpt says."""
        return self._checkpoints(output_dir, self.cfg.strategy_args.strategy_config.async_save_ckpt, keep)

    # ---- internals --------------------------------------------------------------------------------------------

    def _trainer_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise UserError(
                "strategy_args.strategy_name is fsdp2_infer: this strategy has no optimizer (forward_step only); "
                "build it with strategy_name: fsdp2_train to train"
            )
        return self.optimizer

    def _checkpoints(self, output_dir: Path, async_save: bool, keep: int | None = None) -> CheckpointManager:
        source = self.sharded.source
        return CheckpointManager(
            output_dir,
            self.runtime.rank,
            async_save,
            keep,
            cast(Any, self.model).config,  # the model's own (a value head's settings included), as export_hf writes
            source.tokenizer_path,
            self.sharded.variant.checkpoint_config(self.model, self.cfg.model.name_or_path),
        )

    def _move_states(self, device: torch.device, kinds: set[str], non_blocking: bool) -> None:
        if self.runtime.device.type == "cpu":
            return  # host memory is the device's memory: nothing to free
        for kind in sorted(kinds):  # train/host_states.py: reused pinned buffers, queued copies, bitwise
            parked = self.parked.setdefault(kind, HostStates(self.runtime.device))
            if device.type == "cpu":
                parked.offload(state_tensors(self.model, self.optimizer, kind))
            else:
                parked.load()
        if not non_blocking:  # one synchronisation for the whole move
            torch.cuda.synchronize(self.runtime.device)
        if device.type == "cpu":
            torch.cuda.empty_cache()

    def _require_loaded(self, kinds: Sequence[str], what: str) -> None:
        """An offloaded state's tensors have no device memory until load_states: a kernel would read garbage."""
        parked = [kind for kind in kinds if kind in self.parked and self.parked[kind].offloaded]
        if parked:
            raise UserError(
                f"{what}: {', '.join(parked)} are in host memory (offload_states); call load_states() first"
            )

    def device_batch(self, batch: Batch, what: str) -> Batch:
        """The batch on this rank's device, checked: input_ids [B, T] int64 or int32 (widened to int64), B >= 1 (a
        micro-batch of no rows has nothing to compute, and attention cannot reshape it) and T >= 2,
        every [B, T]-shaped companion of the same shape, a `temperature` as `temperature_of` takes it."""
        if not isinstance(batch, dict) or "input_ids" not in batch:
            raise UserError(f"{what}: a dict of tensors with 'input_ids' [B, T] (int64) is needed")
        ids = batch["input_ids"]
        shaped = isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[0] >= 1 and ids.shape[1] >= 2
        if not shaped or ids.dtype not in TOKEN_DTYPES:
            got = f"{tuple(ids.shape)} {ids.dtype}" if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise UserError(
                f"{what}: input_ids must be an int64 or int32 tensor [B, T] with B >= 1 rows and T >= 2, not {got}"
            )
        for key in ("attention_mask", "labels"):
            value = batch.get(key)
            if value is not None and (not isinstance(value, torch.Tensor) or value.shape != ids.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise UserError(f"{what}: {key} must have input_ids' shape {tuple(ids.shape)}, not {shape}")
        check_token_batch(batch, what, self.vocab_size, self.max_positions)  # before the move: see its docstring
        device = self.runtime.device
        moved = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        for key in ("input_ids", "labels"):  # gathers and embeddings index with int64
            if key in moved:
                moved[key] = moved[key].long()
        temperature = temperature_of(batch, what)
        if temperature is not None:
            moved["temperature"] = temperature.to(device, non_blocking=True)
        return moved

    def _shifted(self, batch: Batch, default_targets: bool) -> Batch:
        """The model's inputs, every position 0..T-1 (a MoE router loss counts each row's last token, as
        transformers' does), and each position's target: the next token, or with `default_targets` the next label
        (the next token where attention_mask allows, if there are no labels); the last position has none."""
        inputs = {k: v for k, v in batch.items() if k in self._model_keys and isinstance(v, torch.Tensor)}
        ids = batch["input_ids"]
        targets = ids[:, 1:]
        if default_targets and "labels" in batch:
            targets = batch["labels"][:, 1:]
        elif default_targets and "attention_mask" in batch:
            targets = targets.masked_fill(batch["attention_mask"][:, 1:] == 0, IGNORE_INDEX)
        return inputs | {"labels": F.pad(targets, (0, 1), value=IGNORE_INDEX)}


@dataclass
class LogProbLoss:
    """A user's `loss_fn(log_probs, batch[, entropy]) -> (loss_sum, weight[, metrics])` over whole sequences,
    called once per micro-batch. Its weight comes with the loss: the step backpropagates the summed losses and
    divides the gradients by the global weight afterwards, so the weight is a constant to the gradient and must
    carry none. A mixture of experts adds router_aux_loss_coef x its router loss averaged over the micro-batches
    weighted by their weights (for one micro-batch: transformers' own sum)."""

    fn: LossFn
    batches: list[Batch]  # as the user gave them, on the device
    sp_group: dist.ProcessGroup | None
    chunk_tokens: int
    whole_sequence: bool = True
    entropy: bool = False  # loss_fn takes `entropy` (with autograd)
    packing: list[PackedRows | None] | None = None  # per micro-batch, its stream under model.remove_padding
    kept_bytes: int = 0  # the head's logits kept from forward to backward, at most (`kept_logits_budget`)

    def weight(self, index: int, batch: Batch) -> None:
        return None  # it comes with the loss

    def __call__(self, model: torch.nn.Module, index: int, batch: Batch, aux_loss_weight: Any) -> MicroBatchTerms:
        received, keywords, outputs = self.outputs(model, index, batch)
        terms = _checked_terms(self.fn(received, self.batches[index], **keywords))
        if aux_loss_weight:  # the router loss's weight per unit of the loss's weight
            terms.loss_sum = with_aux_loss(terms.loss_sum, outputs, aux_loss_weight * terms.weight, self.sp_group)
        return terms

    def outputs(self, model: torch.nn.Module, index: int, batch: Batch) -> tuple[torch.Tensor, Batch, Any]:
        """What loss_fn receives for micro-batch `index` from this rank's slice `batch`: log-probs [B, T-1] of its
        whole sequences at its temperature, keyword outputs (`entropy` [B, T-1] when it takes it), and the model's
        own outputs."""
        api_batch = self.batches[index]
        packed = self.packing[index] if self.packing is not None else None
        chunk = self.chunk_tokens or FORWARD_CHUNK_TOKENS
        temperature = api_batch.get("temperature")
        temperature = packed.token_temperature(temperature) if packed is not None else temperature
        request = TokenRequest(
            batch["labels"], chunk, self.entropy, temperature=temperature, kept_bytes=self.kept_bytes
        )
        with token_request(model, request):
            outputs = model(**model_inputs(batch), use_cache=False)
        length = packed.length if packed is not None else api_batch["input_ids"].shape[1] - 1
        received = [outputs.logits] + ([request.entropies] if self.entropy else [])
        if self.sp_group is not None:
            received = [gather_sequence(t, self.sp_group) for t in received]
        received = [t[:, :length] if packed is None else packed.unpack(t[:, :length]) for t in received]
        return received[0], {"entropy": received[1]} if self.entropy else {}, outputs


def _checked_terms(result: Any) -> MicroBatchTerms:
    """loss_fn's (loss_sum, weight[, metrics]) as the step takes it, or one sentence on what is wrong."""
    if not (
        isinstance(result, tuple)
        and len(result) in (2, 3)
        and all(isinstance(t, torch.Tensor) and t.numel() == 1 for t in result[:2])
        and (len(result) == 2 or isinstance(result[2], dict))
    ):
        raise UserError(
            "loss_fn must return (loss_sum, weight) or (loss_sum, weight, metrics): two one-element tensors and a "
            "dict of scalars; it returned " + _describe(result)
        )
    loss_sum, weight = result[0].reshape(()).float(), result[1].reshape(())
    if not loss_sum.requires_grad:
        raise UserError(
            "loss_fn: the loss_sum it returns carries no gradient (detached, or not computed from the outputs it "
            "receives): the step would change nothing; build it from those outputs"
        )
    if weight.requires_grad:
        raise UserError(
            "loss_fn: the weight it returns carries a gradient; it is the loss's normaliser, a constant to the "
            "gradient (a token count, a sum of weights): detach it"
        )
    metrics = result[2] if len(result) == 3 else {}
    for name, value in metrics.items():
        if not (isinstance(value, torch.Tensor | float | int) and torch.as_tensor(value).numel() == 1):
            raise UserError(f"loss_fn: metric '{name}' must be one number (a float or one-element tensor)")
    device = loss_sum.device
    return MicroBatchTerms(
        loss_sum, weight, {str(k): torch.as_tensor(v, device=device).detach() for k, v in metrics.items()}
    )


def temperature_of(batch: Batch, what: str) -> torch.Tensor | None:
    """A batch's sampling `temperature` (one number, or one per sample [B]) as a float32 tensor where the caller
    gave it (checked there: a host tensor costs no wait for the device), or None."""
    value = batch.get("temperature")
    if value is None:
        return None
    rows = batch["input_ids"].shape[0]
    temperature = torch.as_tensor(value, dtype=torch.float32)
    if temperature.dim() > 1 or (temperature.dim() == 1 and temperature.shape[0] != rows):
        raise UserError(
            f"{what}: temperature must be one number or one per sample ([{rows}]), not shape {tuple(temperature.shape)}"
        )
    if not bool(((temperature > 0) & temperature.isfinite()).all()):
        raise UserError(f"{what}: temperature must be finite and > 0 (the logits are divided by it)")
    return temperature


def _state_kinds(include: Iterable[str] | None) -> set[str]:
    """The STATE_KINDS an offload_states / load_states `include` names (all of them for None), checked."""
    if include is None:
        return set(STATE_KINDS)
    kinds = {str(getattr(kind, "value", kind)) for kind in include}  # ROLL passes OffloadStateType members
    unknown = sorted(kinds - set(STATE_KINDS))
    if unknown:
        raise UserError(
            f"offload_states/load_states include: {', '.join(unknown)} is not one of {', '.join(STATE_KINDS)}"
        )
    return kinds


@dataclass
class HeadOutputLoss(LogProbLoss):
    """A value or reward model's `loss_fn(values or scores, batch) -> (loss_sum, weight)`: its head's outputs for
    the batch as given (values [B, T], scores [B], float32, with autograd) in place of log-probs, under the same
    contract."""

    head: ValueHead = field(kw_only=True)

    def outputs(self, model: torch.nn.Module, index: int, batch: Batch) -> tuple[torch.Tensor, Batch, Any]:
        packed = self.packing[index] if self.packing is not None else None
        received, outputs = head_outputs(model, self.head, batch, self.batches[index], self.sp_group, packed)
        return received, {}, outputs


def head_outputs(
    model: torch.nn.Module,
    head: ValueHead,
    local: Batch,
    api_batch: Batch,
    sp_group: dist.ProcessGroup | None,
    packed: PackedRows | None = None,
) -> tuple[torch.Tensor, Any]:
    """A value or reward model's outputs for `api_batch` from its forward over `local` (this rank's slice under
    sequence parallel, whose per-token outputs are gathered with autograd; of the `packed` stream under
    model.remove_padding, put back at the padded positions), and the model's own outputs."""
    per_token, outputs = head.local_outputs(model, local)
    if sp_group is not None:
        per_token = gather_sequence(per_token, sp_group)
    if packed is not None:
        per_token = packed.unpack_tokens(per_token[:, : packed.length])
    return head.whole(per_token, api_batch), outputs


def _reported(result: StepResult) -> dict[str, Any]:
    """What train_step returns of a step."""
    return {
        "loss": result.loss,
        "grad_norm": result.grad_norm,
        "lr": result.lr,
        "tokens": int(result.input_tokens),
        "applied": result.applied,
        "metrics": result.metrics,
    }


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP module's parameters back to their shards. A forward without backward leaves the root's unsharded
    (FSDP keeps them for the backward that follows a training forward): plain stand-ins registered in place of the
    sharded parameters, which an optimizer built then would hold, and memory a rollout engine could use."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _storage(tensor: torch.Tensor) -> int:
    """Where a tensor's values live (a sharded parameter's: its local shard's)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()


def _describe(value: object) -> str:
    if isinstance(value, tuple):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def gather_sequence(local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """The sequence group's shares [B, t] joined along the sequence, in the sequence's order (rank order, but
    under context parallel, whose shares are chunks from the front and the back: `token_order`), with autograd:
    each rank's gradient is its own share of the incoming one (every rank computes the same loss on the whole)."""
    gathered = _GatherSequence.apply(local, group)
    order = gathered_order(group)
    return gathered if order is None else gathered[:, torch.argsort(order.to(gathered.device))]


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(group.size())]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.length = group.rank(), local.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[:, ctx.rank * ctx.length : (ctx.rank + 1) * ctx.length].contiguous(), None


def _vocab_size(hf_config: Any) -> int:
    text = getattr(hf_config, "text_config", None) or hf_config
    return int(getattr(text, "vocab_size", 0) or getattr(hf_config, "vocab_size", 0) or 0)
