"""Between backward and the optimizer step: averaging the gradients FSDP does not manage, fp16 loss scaling, the
global norm and its clipping over sharded (DTensor) and replicated gradients, and skipping non-finite steps."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp2kit.config.schema import TrainingConfig
from fsdp2kit.errors import TrainingDiverged, UserError


def _split_sharded(params: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(sharded, plain) parameters that have a gradient: one foreach op cannot mix DTensors and plain tensors."""
    with_grad = [p for p in params if p.grad is not None]
    return [p for p in with_grad if isinstance(p.grad, DTensor)], [
        p for p in with_grad if not isinstance(p.grad, DTensor)
    ]


def _grads(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.grad for p in params if p.grad is not None]


def all_reduce_replicated_grads(params: Sequence[torch.Tensor], world_size: int) -> None:
    """Parameters of ignored modules are outside FSDP: average their gradients as DDP would."""
    for grad in _grads(_split_sharded(params)[1]):
        dist.all_reduce(grad)
        grad.div_(world_size)


def scale_grads_(params: Sequence[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by `factor` (a tensor on their device: no host read), shards in place."""
    local = [g.to_local() if isinstance(g, DTensor) else g for g in _grads(list(params))]
    if local:
        torch._foreach_mul_(local, factor.to(local[0].dtype))


def clip_grad_norm(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm over sharded and replicated gradients (the same value on every rank); clip if max_norm > 0.
    The norm stays on the gradients' device (no host sync here: the step fetches it with the loss, once). A
    non-finite norm scales the gradients to zero or NaN, harmlessly: that step's update is skipped."""
    sharded, plain = _split_sharded(params)
    groups = [*_by_mesh(sharded), plain]
    squares = [_squared_norm(_grads(group)) for group in groups if group]
    if not squares:
        return torch.zeros(())
    total = torch.stack(squares).sum().sqrt()
    if max_norm > 0:
        for group in groups:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _by_mesh(sharded: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Sharded parameters grouped by their gradients' device mesh and placements: DTensor ops refuse operands on
    different meshes (a model whose parts are sharded over different meshes, as experts under expert parallelism
    are), and a norm is summed over the mesh dimensions its group is sharded on."""
    groups: dict[object, list[torch.Tensor]] = {}
    for param in sharded:
        grad = cast(DTensor, param.grad)
        groups.setdefault((grad.device_mesh, grad.placements), []).append(param)
    return list(groups.values())


# On the CPU, a norm is taken over rows of this many values, then over the rows' norms in float64.
_NORM_ROW = 256


def _squared_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of gradients that are all plain or all DTensors on one mesh with the same placements, the
    same on every rank. On the CPU, torch's norm kernel accumulates a whole tensor in fp32 and loses up to 1e-2 of a
    large one's norm (1e-5 on a tiny model's head), so a norm would change with the shards' sizes, hence with the
    world size: rows of `_NORM_ROW` values, summed in float64, keep it to fp32's rounding."""
    if grads[0].device.type != "cpu":
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):  # the norm of this rank's shards, partial until all-reduced
            norm = norm.full_tensor()
        return norm.float() ** 2
    total = torch.zeros((), dtype=torch.float64)
    for grad in grads:
        local = (grad.to_local() if isinstance(grad, DTensor) else grad).reshape(-1)
        whole = local.numel() // _NORM_ROW * _NORM_ROW
        rows = torch.linalg.vector_norm(local[:whole].view(-1, _NORM_ROW), dim=1).double()
        total += rows.square().sum() + torch.linalg.vector_norm(local[whole:]).double().square()
    if isinstance(grads[0], DTensor):  # summed over the shards, once over the replicas
        mesh = grads[0].device_mesh
        for dim, placement in enumerate(grads[0].placements):
            if not placement.is_replicate():  # Shard, or FSDP's _StridedShard over another sharding (not a Shard)
                dist.all_reduce(total, group=mesh.get_group(dim))
    return total.float()


class LossScaler:
    """Dynamic loss scaling, on when gradients are computed or reduced in fp16, whose 5 exponent bits flush small
    gradients to zero (bf16 and fp32 have fp32's range: scale 1, nothing to do). The loss is multiplied by `scale`
    before backward and the gradients divided by it before clipping. An overflow shows as a non-finite global
    gradient norm, which every rank computes over all shards, so the ranks agree on it with no extra collective.
    (torch's ShardedGradScaler all-reduces a per-rank flag instead, and cannot unscale a mix of DTensor and plain
    gradients, which ignored modules give.) An overflow halves the scale; `GROWTH_INTERVAL` clean steps double it."""

    GROWTH_INTERVAL = 2000

    def __init__(self, enabled: bool, initial_scale: float):
        self.enabled = enabled
        self.initial_scale = initial_scale
        self.resumed = False
        self.scale = initial_scale if enabled else 1.0
        self.clean_steps = 0

    def unscale_(self, params: Sequence[torch.Tensor]) -> None:
        if self.enabled:
            for group in _split_sharded(params):
                if group:
                    torch._foreach_mul_(_grads(group), 1.0 / self.scale)

    def update(self, overflowed: bool) -> None:
        if not self.enabled:
            return
        if overflowed:
            self.scale /= 2
            self.clean_steps = 0
        else:
            self.clean_steps += 1
            if self.clean_steps == self.GROWTH_INTERVAL:
                self.scale *= 2
                self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.initial_scale, self.resumed = self.scale, True  # this run's scale starts from the checkpoint's

    def started(self) -> str:
        """Where this run's loss scale came from, as the user would look for it."""
        if self.resumed:
            return f"the loss scale {_number(self.initial_scale)} the checkpoint resumed with"
        return f"training.fp16_initial_scale = {_number(self.initial_scale)}"


def _number(value: float) -> str:
    """A loss scale as a user writes it: a power of two in full."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


class NonFiniteGuard:
    """A step whose loss or gradient norm is not finite is skipped; `limit` skipped steps in a row end the run.
    Under fp16 loss scaling, overflowing gradients with a finite loss are the scaler's business (the scale halves and
    the next step tries again) and do not count, unless the scale has fallen below 1: then even the true gradients
    overflow fp16 (DeepSpeed stops there too: min_loss_scale)."""

    def __init__(self, limit: int, scaler: LossScaler):
        self.limit = limit
        self.scaler = scaler
        self.skipped_in_a_row = 0
        self.applied = 0
        self.overflowed = 0  # steps skipped for the loss scaler: a finite loss whose scaled gradients overflowed

    def step_is_finite(self, loss: float, grad_norm: float) -> bool:
        """Whether to apply this step's update; also tells the loss scaler whether the gradients overflowed."""
        overflowed = not math.isfinite(grad_norm)
        self.scaler.update(overflowed)
        if math.isfinite(loss) and not overflowed:
            self.skipped_in_a_row = 0
            self.applied += 1
            return True
        if not (math.isfinite(loss) and self.scaler.enabled):
            self.skipped_in_a_row += 1
        else:
            self.overflowed += 1
        return False

    def stop_if_diverged(self, step: int) -> None:
        if self.skipped_in_a_row >= self.limit:
            raise TrainingDiverged(
                "training diverged: the loss or gradient norm was non-finite for "
                f"{self.skipped_in_a_row} steps in a row (steps {step - self.skipped_in_a_row + 1}-{step}, "
                f"training.max_nonfinite_steps = {self.limit}); lower training.learning_rate or compute in bf16/fp32"
            )
        if self.scaler.scale < 1:
            raise TrainingDiverged(
                "training diverged: fp16 gradients overflow even unscaled "
                f"(the loss scale fell below 1 at step {step}); lower training.learning_rate or compute in bf16"
            )

    def stop_if_nothing_trained(self, steps: int) -> None:
        """A run shorter than `limit` steps whose every step was skipped must not end as done with its weights
        unchanged (or NaN) and exported: it stops like a diverged one. Where every step's loss was finite and only
        the scaled gradients overflowed, the scaler was still halving a loss scale given too large: that key is named
        (the weights are finite, they never trained)."""
        if steps and not self.applied and self.overflowed == steps:
            default = TrainingConfig.model_fields["fp16_initial_scale"].default
            raise UserError(
                f"{self.scaler.started()}: every one of this run's {steps} steps overflowed fp16 at its loss scale "
                f"(halved after each, to {_number(self.scaler.scale)}), so nothing trained and nothing was saved or "
                f"exported; lower training.fp16_initial_scale (default {_number(default)}, halved until the "
                "gradients fit)"
            )
        if steps and not self.applied:
            raise TrainingDiverged(
                f"training diverged: every one of this run's {steps} steps had a non-finite loss or gradient norm "
                "(are the model's weights finite?); nothing was saved or exported"
            )
