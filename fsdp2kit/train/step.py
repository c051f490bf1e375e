"""One optimizer step: forward and backward over a rank's micro-batches with the loss normalised by the global
batch's target tokens, gradient reduction, loss unscaling, clipping and the optimizer update. The training loop
and the tests that need a step both call `train_step`, so the step they check is the step that trains."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.fsdp import FSDPModule
from torch.optim.lr_scheduler import LRScheduler

from fsdp2kit.data.dataset import input_token_count, model_inputs
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.token_logprobs import TokenRequest, token_request
from fsdp2kit.parallel.ulysses import shard_sequence
from fsdp2kit.train.grads import NonFiniteGuard, all_reduce_replicated_grads, clip_grad_norm


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean next-token cross-entropy over every target token of the global batch
    grad_norm: float  # global L2 norm before clipping
    lr: float  # the learning rate this step's update used
    input_tokens: float  # tokens the model read on all data-parallel ranks, padding excluded
    applied: bool  # False: the loss or gradient norm was not finite and the update was skipped


def token_loss_sum(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], aux_loss_weight: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (normalised by the caller), plus
    `aux_loss_weight` times the router's load-balancing loss where the model returns one (a mixture of experts
    with `output_router_logits`). No KV cache: training never reuses one, and a recomputed (checkpointed) layer
    would append to it twice."""
    outputs = model(**model_inputs(batch), use_cache=False)
    loss = F.cross_entropy(
        outputs.logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return with_aux_loss(loss, outputs, aux_loss_weight)


def with_aux_loss(loss: torch.Tensor, outputs: Any, aux_loss_weight: float | torch.Tensor) -> torch.Tensor:
    """`loss` plus `aux_loss_weight` times the router's load-balancing loss, where the model returns one."""
    aux_loss = getattr(outputs, "aux_loss", None)
    if isinstance(aux_loss, torch.Tensor) and (isinstance(aux_loss_weight, torch.Tensor) or aux_loss_weight):
        loss = loss + aux_loss_weight * aux_loss.float()
    return loss


class MicroBatchLoss(Protocol):
    """How a micro-batch's loss is computed: its weight (the loss's normaliser, known before the forward so that
    each micro-batch's backward is scaled right at once) and its weighted sum, with the weight as computed."""

    whole_sequence: bool  # every rank of a sequence-parallel group computes the same, whole loss

    def weight(self, index: int, batch: dict[str, torch.Tensor]) -> torch.Tensor: ...

    def __call__(
        self, model: torch.nn.Module, index: int, batch: dict[str, torch.Tensor], aux_loss_weight: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass
class TokenCrossEntropy:
    """The `train` command's loss: next-token cross-entropy summed over the target tokens (labels already shifted),
    normalised by their count; `chunk_tokens` > 0 computes it in chunks through the LM head."""

    chunk_tokens: int = 0
    whole_sequence: bool = False

    def weight(self, index: int, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"] != IGNORE_INDEX).sum()

    def __call__(
        self, model: torch.nn.Module, index: int, batch: dict[str, torch.Tensor], aux_loss_weight: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.chunk_tokens:
            return token_loss_sum(model, batch, aux_loss_weight), None
        with token_request(model, TokenRequest(batch["labels"], self.chunk_tokens, summed=True)):
            outputs = model(**model_inputs(batch), use_cache=False)
        return with_aux_loss(outputs.logits, outputs, aux_loss_weight), None


@dataclass
class _Accumulation:
    """What a step's forward/backward passes need besides the micro-batches."""

    loss: MicroBatchLoss
    weights: list[torch.Tensor]  # each micro-batch's weight, read before its forward
    loss_factor: torch.Tensor  # world size x loss scale / global weight
    aux_loss_weight: float | torch.Tensor
    sp_group: ProcessGroup | None
    shard_batch: Callable[[dict[str, torch.Tensor], ProcessGroup], dict[str, torch.Tensor]]
    on_micro_batch_done: Callable[[], None] | None
    sync_each_batch: bool = False  # reduce-scatter after every micro-batch: no unsharded gradients held between


def _forward_backward(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], run: _Accumulation
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each micro-batch's forward and backward, gradient sync on the last only; returns the summed loss (whole
    sequences counted once per sequence-parallel group) and how far the weights computed with the loss drifted from
    those read before (0 for a loss_fn whose weight depends on the batch alone)."""
    loss, sp_size = run.loss, run.sp_group.size() if run.sp_group is not None else 1
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.loss_factor.device)
    weight_drift = torch.zeros((), dtype=torch.float64, device=run.loss_factor.device)
    for index, batch in enumerate(micro_batches):
        if isinstance(model, FSDPModule):  # reduce-scatter once per step (unless run.sync_each_batch)
            model.set_requires_gradient_sync(run.sync_each_batch or index == len(micro_batches) - 1)
        if run.sp_group is not None:
            batch = run.shard_batch(batch, run.sp_group)  # this rank's slice of the tokens
        micro_loss, weight = loss(model, index, batch, run.aux_loss_weight)
        (micro_loss * run.loss_factor.to(micro_loss.dtype)).backward()
        loss_sum += micro_loss.detach() / (sp_size if loss.whole_sequence else 1)
        if weight is not None:
            weight_drift += (weight.double() - run.weights[index].double()).abs()
        if run.on_micro_batch_done is not None:
            run.on_micro_batch_done()
    return loss_sum, weight_drift


def train_step(
    model: torch.nn.Module,
    micro_batches: list[dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    guard: NonFiniteGuard,
    max_grad_norm: float,
    aux_loss_coef: float = 0.0,
    sp_group: ProcessGroup | None = None,
    shard_batch: Callable[[dict[str, torch.Tensor], ProcessGroup], dict[str, torch.Tensor]] = shard_sequence,
    on_micro_batch_done: Callable[[], None] | None = None,
    loss: MicroBatchLoss | None = None,
    sync_each_batch: bool = False,
) -> StepResult:
    """Every rank calls it with its own micro-batches (the ranks of a sequence-parallel group with the same ones,
    each training on the slice `shard_batch` cuts for it). `model` is FSDP-sharded or, in a world of one, a plain
    module; the guard's loss scaler scales the loss (fp16) and the guard decides whether the update is applied.
    `loss` (default: token cross-entropy) gives each micro-batch's weight and weighted loss sum; the step minimises
    their global ratio. `on_micro_batch_done` runs after each micro-batch's backward (the memory tracker's marks)."""
    loss = loss if loss is not None else TokenCrossEntropy()
    world_size = dist.get_world_size()
    params = [p for p in model.parameters() if p.requires_grad]
    # The loss is the sum over the global batch divided by its total weight (the target tokens): normalise by the
    # global weight, kept on the device (reading it on the host would wait for the device before the first forward).
    weights = [loss.weight(i, mb) for i, mb in enumerate(micro_batches)]
    counts = torch.stack(
        [
            torch.stack([w.double() for w in weights]).sum(),
            torch.stack([input_token_count(mb) for mb in micro_batches]).sum().double(),
        ]
    )
    dist.all_reduce(counts)
    # Every rank of a sequence-parallel group holds the group's whole micro-batches: count them once.
    counts /= sp_group.size() if sp_group is not None else 1
    target_tokens = counts[0]
    # A mixture of experts adds router_aux_loss_coef x its load-balancing loss averaged over all micro-batches
    # of all ranks, as transformers adds it to each batch's mean loss; in units of summed token losses:
    aux_loss_weight = (
        (aux_loss_coef * target_tokens / (len(micro_batches) * world_size)).float() if aux_loss_coef else 0.0
    )
    # FSDP averages gradients over all ranks; scale so the result is the global token mean (times the fp16 loss
    # scale, 1 otherwise). With sequence parallel each rank of a group holds a part of the group's gradient, and
    # the average over all ranks sums those parts.
    loss_factor = world_size * guard.scaler.scale / target_tokens
    run = _Accumulation(
        loss, weights, loss_factor, aux_loss_weight, sp_group, shard_batch, on_micro_batch_done, sync_each_batch
    )
    loss_sum, weight_drift = _forward_backward(model, micro_batches, run)
    all_reduce_replicated_grads(params, world_size)
    dist.all_reduce(loss_sum)
    guard.scaler.unscale_(params)
    norm = clip_grad_norm(params, max_grad_norm)
    # The step's one host read (on CUDA, one wait for the device): loss, gradient norm, token count together.
    read = torch.stack([loss_sum / target_tokens, norm.to(loss_sum), counts[1], weight_drift])
    loss_value, grad_norm, input_tokens, drift = read.tolist()
    return _update(optimizer, scheduler, guard, StepResult(loss_value, grad_norm, 0.0, input_tokens, False), drift)


def _update(
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    guard: NonFiniteGuard,
    result: StepResult,
    drift: float,
) -> StepResult:
    """The optimizer and schedule step where the loss and gradient norm are finite; the gradients are cleared."""
    if drift:
        optimizer.zero_grad(set_to_none=True)
        raise UserError(
            "loss_fn: the weight it returns changed with the log-probs; it must depend on the batch alone (e.g. "
            "the number of tokens counted), as the step normalises by it before the backward"
        )
    lr = float(optimizer.param_groups[0]["lr"])
    applied = guard.step_is_finite(result.loss, result.grad_norm)
    if applied:
        optimizer.step()
        if scheduler is not None:  # None: the caller steps the schedule itself (Strategy.scheduler_step)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(result.loss, result.grad_norm, lr, result.input_tokens, applied)
