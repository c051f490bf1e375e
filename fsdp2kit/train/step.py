"""One optimizer step: forward and backward over a rank's micro-batches with the loss normalised by the global
batch's target tokens, gradient reduction, loss unscaling, clipping and the optimizer update. The training loop
and the tests that need a step both call `train_step`, so the step they check is the step that trains."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
from fsdp2kit.parallel.float8 import refresh_float8_scales
from fsdp2kit.parallel.fsdp import before_micro_batch, stays_gathered
from fsdp2kit.parallel.moe import once_per_group
from fsdp2kit.parallel.sequence_layout import shard_sequence
from fsdp2kit.parallel.token_logprobs import TokenRequest, token_request
from fsdp2kit.train.grads import NonFiniteGuard, all_reduce_replicated_grads, clip_grad_norm, scale_grads_


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean next-token cross-entropy over every target token of the global batch
    grad_norm: float  # global L2 norm before clipping
    lr: float  # the learning rate this step's update used
    input_tokens: float  # tokens the model read on all data-parallel ranks, padding excluded
    applied: bool  # False: the loss or gradient norm was not finite and the update was skipped
    metrics: dict[str, float] = field(default_factory=dict)  # a loss's metrics, averaged over the global batch


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


def with_aux_loss(
    loss: torch.Tensor, outputs: Any, aux_loss_weight: float | torch.Tensor, whole_sequence: ProcessGroup | None = None
) -> torch.Tensor:
    """`loss` plus `aux_loss_weight` times the router's load-balancing loss, where the model returns one; for a loss
    every rank of the sequence group `whole_sequence` computes alike (counted once per group), as such a loss."""
    aux_loss = getattr(outputs, "aux_loss", None)
    if isinstance(aux_loss, torch.Tensor) and (isinstance(aux_loss_weight, torch.Tensor) or aux_loss_weight):
        loss = loss + aux_loss_weight * once_per_group(aux_loss.float(), whole_sequence)
    return loss


@dataclass
class MicroBatchTerms:
    """What a micro-batch's loss gives the step."""

    loss_sum: torch.Tensor  # the micro-batch's summed loss, with autograd
    weight: torch.Tensor | None = None  # its weight, where the loss computes it (MicroBatchLoss.weight gave None)
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)  # scalars, averaged over the global batch
    counted: bool = True  # False: an empty micro-batch that evens the ranks' counts, left out of the metrics' mean


class MicroBatchLoss(Protocol):
    """How a micro-batch's loss is computed. Its weight (the loss's normaliser) comes either before the forward,
    from the batch alone (`weight`: each micro-batch's backward is then scaled right at once), or with the loss
    (`weight` gives None): the step then backpropagates the unnormalised sums and divides the gradients by the global
    weight once all are in, which is exact as gradients are linear in the loss. `aux_loss_weight` is the router
    loss's weight in units of summed losses, or, for a loss whose weight comes with it, per unit of that weight."""

    whole_sequence: bool  # every rank of a sequence-parallel group computes the same, whole loss

    def weight(self, index: int, batch: dict[str, torch.Tensor]) -> torch.Tensor | None: ...

    def __call__(
        self, model: torch.nn.Module, index: int, batch: dict[str, torch.Tensor], aux_loss_weight: Any
    ) -> MicroBatchTerms: ...


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
    ) -> MicroBatchTerms:
        if not self.chunk_tokens:
            return MicroBatchTerms(token_loss_sum(model, batch, aux_loss_weight))
        with token_request(model, TokenRequest(batch["labels"], self.chunk_tokens, summed=True)):
            outputs = model(**model_inputs(batch), use_cache=False)
        return MicroBatchTerms(with_aux_loss(outputs.logits, outputs, aux_loss_weight))


@dataclass
class _Accumulation:
    """What a step's forward/backward passes need besides the micro-batches."""

    loss: MicroBatchLoss
    loss_factor: torch.Tensor  # world size x loss scale (/ global weight, where it is known before the forward)
    aux_loss_weight: float | torch.Tensor
    sp_group: ProcessGroup | None
    shard_batch: Callable[[dict[str, torch.Tensor], ProcessGroup], dict[str, torch.Tensor]]
    on_micro_batch_done: Callable[[], None] | None
    sync_each_batch: bool = False  # reduce-scatter after every micro-batch: no unsharded gradients held between
    tp_size: int = 1  # the ranks of a tensor-parallel group compute the same loss of the same micro-batches


@dataclass
class _Sums:
    """A rank's sums over its micro-batches (whole sequences counted once per sequence-parallel group)."""

    loss: torch.Tensor  # float64
    weight: torch.Tensor  # float64: the weights that came with the loss (0 where known before)
    unusable: torch.Tensor  # float64: how many of those were negative or not finite (read with the step's values)
    metrics: dict[str, torch.Tensor]  # float64, by name
    consistent: bool  # every micro-batch gave the same metric names
    counted: float = 0.0  # the micro-batches the metrics' mean is over (per sequence-parallel group)


def _forward_backward(
    model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]], run: _Accumulation
) -> _Sums:
    """Each micro-batch's forward and backward, gradient sync on the last only."""
    loss, sp_size = run.loss, run.sp_group.size() if run.sp_group is not None else 1
    share = (sp_size if loss.whole_sequence else 1) * run.tp_size
    device = run.loss_factor.device
    sums = _Sums(
        torch.zeros((), dtype=torch.float64, device=device),
        torch.zeros((), dtype=torch.float64, device=device),
        torch.zeros((), dtype=torch.float64, device=device),
        {},
        True,
    )
    sharded = isinstance(model, FSDPModule)
    gathered = sharded and stays_gathered(model)
    for index, batch in enumerate(micro_batches):
        if sharded:  # reduce once per step (unless run.sync_each_batch)
            before_micro_batch(model, index == len(micro_batches) - 1, run.sync_each_batch, gathered)
        if run.sp_group is not None:
            batch = run.shard_batch(batch, run.sp_group)  # this rank's slice of the tokens
        terms = loss(model, index, batch, run.aux_loss_weight)
        (terms.loss_sum * run.loss_factor.to(terms.loss_sum.dtype)).backward()
        sums.loss += terms.loss_sum.detach() / share
        if terms.weight is not None:
            weight = terms.weight.detach().double()
            sums.weight += weight / share
            sums.unusable += ((weight < 0) | ~weight.isfinite()).double() / share  # on the device: no host read
        if terms.counted:
            _add_metrics(sums, terms.metrics, share)
        if run.on_micro_batch_done is not None:
            run.on_micro_batch_done()
    return sums


def _add_metrics(sums: _Sums, metrics: dict[str, torch.Tensor], share: int) -> None:
    """A micro-batch's metrics into the rank's sums (its names must be those of the micro-batches before)."""
    if sums.counted and sorted(metrics) != sorted(sums.metrics):
        sums.consistent = False
    for name, value in metrics.items():
        sums.metrics[name] = sums.metrics.get(name, 0.0) + value.detach().double().reshape(()) / share
    sums.counted += 1 / share


# The collective calls whose first collective is `micro_batch_extremes` (forward_step's with max_tokens): a rank in
# one while another is in another (full_weights read on rank 0 only, train_step on the rest) meets it there, and every
# rank says so.
COLLECTIVE_CALLS = ("train_step", "full_weights", "forward_step", "sharded_weights", "weight_sender")


def micro_batch_extremes(
    count: int, device: torch.device, call: str = "train_step", refused: UserError | None = None
) -> tuple[int, int]:
    """The fewest and the most micro-batches any rank has, in one all_reduce that also checks that every rank is in
    the same `call` and that no rank `refused` its batch (`agree_on_refusal`): ranks in different calls, or a batch
    one rank refuses, are one error on every rank, not a hang in mismatched collectives. On the host (a CPU tensor:
    no wait for the device) where the process group has a CPU backend (ours: gloo beside NCCL), else on `device` (a
    caller's NCCL-only group)."""
    on_host = any(name in str(dist.get_backend()) for name in ("gloo", "fake"))
    kind = COLLECTIVE_CALLS.index(call)
    extremes = [count, -count, kind, -kind, refused is not None]
    agreed = torch.tensor(extremes, dtype=torch.int64, device="cpu" if on_host else device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
    most, negated_fewest, last_kind, negated_first_kind, any_refused = agreed.tolist()
    if last_kind != -negated_first_kind:
        calls = (COLLECTIVE_CALLS[-negated_first_kind], COLLECTIVE_CALLS[last_kind])
        stream = next((name for name in calls if name in ("full_weights", "sharded_weights")), None)
        why = (
            f"{stream}() is a collective: every rank must read it to the end"
            if stream is not None
            else "a weight sync is a collective: every rank must make it"
            if "weight_sender" in calls
            else "every rank must make the same call"
        )
        raise UserError(f"{call}: some ranks are in {calls[0]}() and others in {calls[1]}(); {why}")
    if any_refused:
        raise agree_on_refusal(refused)
    return -negated_fewest, most


def agree_on_refusal(refused: UserError | None) -> UserError:
    """The refusal of the lowest rank that refused its batch, as every rank raises it (a collective every rank
    reaches once one has refused): the other ranks return too, rather than wait in the step's collectives."""
    if refused is not None and dist.get_world_size() == 1:
        return refused
    reasons: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, None if refused is None else str(refused))
    rank, reason = next((r, reason) for r, reason in enumerate(reasons) if reason is not None)
    return UserError(f"{reason} (rank {rank}'s batch; no rank took this step)")


def agree_on_micro_batch_count(count: int, device: torch.device, call: str = "train_step") -> None:
    """Every rank must run as many micro-batches (each is a round of collectives), in the same `call`: checked before
    the first, so that unequal counts, or ranks in different calls, are one error on every rank, not a hang."""
    fewest, most = micro_batch_extremes(count, device, call)
    if most != fewest:
        raise UserError(
            f"train_step: the ranks were given different numbers of micro-batches (this rank {count}, between "
            f"{fewest} and {most} over the ranks); every rank must pass as many (pad a rank's share with micro-batches "
            "of weight 0)"
        )


def _metric_fingerprint(sums: _Sums) -> float:
    """A number that equals on two ranks when their metric names do (-1: this rank's micro-batches disagree)."""
    if not sums.consistent:
        return -1.0
    return float(zlib.crc32("\0".join(sorted(sums.metrics)).encode()) % (1 << 20) + 1) if sums.metrics else 0.0


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
    tp_size: int = 1,
) -> StepResult:
    """Every rank calls it with as many micro-batches of its own (the ranks of a sequence-parallel group with the
    same ones, each training on the slice `shard_batch` cuts for it). `model` is FSDP-sharded or, in a world of one,
    a plain module; the guard's loss scaler scales the loss (fp16) and the guard decides whether the update is
    applied. `loss` (default: token cross-entropy) gives each micro-batch's weight and weighted loss sum; the step
    minimises their global ratio. `on_micro_batch_done` runs after each micro-batch's backward (the memory tracker's
    marks). The `tp_size` ranks of a tensor-parallel group hold the same micro-batches and compute the same loss: it
    counts once, and FSDP averages the gradients over the world / tp_size ranks that shard each split tensor."""
    loss = loss if loss is not None else TokenCrossEntropy()
    ranks = dist.get_world_size()
    averaged_over, sharing = ranks // tp_size, (sp_group.size() if sp_group is not None else 1) * tp_size
    agree_on_micro_batch_count(len(micro_batches), micro_batches[0]["input_ids"].device)
    tokens = torch.stack([input_token_count(mb) for mb in micro_batches]).sum().double()
    known = [loss.weight(i, mb) for i, mb in enumerate(micro_batches)]
    run = _Accumulation(
        loss,
        torch.tensor(averaged_over * guard.scaler.scale, dtype=torch.float64, device=tokens.device),
        aux_loss_coef,
        sp_group,
        shard_batch,
        on_micro_batch_done,
        sync_each_batch,
        tp_size,
    )
    known_weight = _normalise_before(run, known, sharing)
    sums = _forward_backward(model, micro_batches, run)
    params = _stepped_parameters(model, optimizer)
    all_reduce_replicated_grads(params, ranks)
    fingerprint = _metric_fingerprint(sums)
    fingerprints = tokens.new_tensor([fingerprint, fingerprint**2])
    totals = torch.stack([sums.loss, sums.weight, tokens / sharing, *fingerprints, sums.unusable])
    dist.all_reduce(totals)
    global_weight = totals[1] if known_weight is None else known_weight
    if known_weight is None:  # the weights came with the losses: the gradients are sums, divided by it now
        scale_grads_(params, 1.0 / global_weight)
    guard.scaler.unscale_(params)
    norm = clip_grad_norm(params, max_grad_norm)
    # The step's one host read of device values (on CUDA, one wait for the device), all together.
    read = torch.stack([totals[0] / global_weight, norm.to(totals), totals[2], global_weight, *totals[3:]])
    loss_value, grad_norm, input_tokens, weight, names_sum, names_square_sum, unusable = read.tolist()
    _refuse_unusable(optimizer, weight, ranks * names_square_sum != names_sum**2 or names_sum < 0, unusable)
    metrics = _averaged_metrics(sums.metrics, sums.counted) if names_sum else {}
    result = StepResult(loss_value, grad_norm, 0.0, input_tokens, False, metrics)
    result = _update(optimizer, scheduler, guard, result)
    refresh_float8_scales(model)
    return result


def _normalise_before(run: _Accumulation, known: list[torch.Tensor | None], sharing: int) -> torch.Tensor | None:
    """Where every micro-batch's weight is known before its forward: the global weight (on the device: no host read
    before the forward), which each backward is then normalised by. None where the weights come with the losses."""
    if any(w is None for w in known):
        return None
    global_weight = torch.stack([w.double() for w in known if w is not None]).sum()
    dist.all_reduce(global_weight)
    global_weight /= sharing  # every rank of a sequence (or tp) group holds the group's whole micro-batches
    # FSDP averages gradients over all ranks; scale so the result is the global mean (times the fp16 loss scale,
    # 1 otherwise). With sequence parallel each rank of a group holds a part of the group's gradient, and the
    # average over all ranks sums those parts.
    run.loss_factor = run.loss_factor / global_weight
    # A mixture of experts adds router_aux_loss_coef x its load-balancing loss averaged over all micro-batches of all
    # ranks, as transformers adds it to each batch's mean loss; in units of summed token losses:
    coef, world_size = float(run.aux_loss_weight), dist.get_world_size() // run.tp_size
    run.aux_loss_weight = (coef * global_weight / (len(known) * world_size)).float() if coef else 0.0
    return global_weight


def _refuse_unusable(
    optimizer: torch.optim.Optimizer, weight: float, metric_names_differ: bool, unusable: float
) -> None:
    """A step whose weights sum to 0 has nothing to minimise; metrics must be named alike on every micro-batch of every
    rank (the ranks' fingerprints agree exactly when n x sum(f^2) == sum(f)^2, Cauchy-Schwarz); a loss_fn's weight
    is never negative or NaN (the step would climb the loss, or be skipped as diverged). All are decided from
    all-reduced values: every rank raises. The gradients are cleared."""
    if weight == 0 or metric_names_differ or unusable:
        optimizer.zero_grad(set_to_none=True)
    if unusable:
        raise UserError(
            f"loss_fn: {round(unusable)} of the weights it returned (over the ranks' micro-batches) are negative or "
            "not finite; a weight is the loss's normaliser (a token count, a sum of weights >= 0): no step was taken"
        )
    if weight == 0:
        raise UserError(
            "train_step: the weights of every micro-batch on every rank sum to 0 (no target token, or loss_fn's "
            "weights): the step has nothing to minimise; give at least one micro-batch a weight > 0"
        )
    if metric_names_differ:
        raise UserError("loss_fn: the metrics it returns must have the same names for every micro-batch on every rank")


def _stepped_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """What the norm, clipping and scaling cover: the optimizer's parameters and every trainable one the module
    registers now (after backward: the sharded ones), once each. A list taken before the forward could hold the
    unsharded stand-ins a forward without backward leaves registered, whose gradients go to the sharded ones."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return list({id(p): p for p in [*(p for g in optimizer.param_groups for p in g["params"]), *trainable]}.values())


def _averaged_metrics(sums: dict[str, torch.Tensor], counted: float) -> dict[str, float]:
    """Each metric's mean over the counted micro-batches of all data-parallel ranks (a second host read, only with
    metrics)."""
    names = sorted(sums)
    values = torch.stack([*(sums[name] for name in names), sums[names[0]].new_tensor(counted)])
    dist.all_reduce(values)
    return dict(zip(names, (values[:-1] / values[-1]).tolist(), strict=True))


def _update(
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    guard: NonFiniteGuard,
    result: StepResult,
) -> StepResult:
    """The optimizer and schedule step where the loss and gradient norm are finite; the gradients are cleared."""
    lr = float(optimizer.param_groups[0]["lr"])
    applied = guard.step_is_finite(result.loss, result.grad_norm)
    if applied:
        optimizer.step()
        if scheduler is not None:  # None: the caller steps the schedule itself (Strategy.scheduler_step)
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return replace(result, lr=lr, applied=applied)
