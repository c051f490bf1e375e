"""`training.optimizer: muon`: torch.optim.Muon's update for the matrices of an FSDP2-sharded model that
`training.muon_split` picks, AdamW for every other parameter, as one optimizer (one state dict, one schedule, one
step).

A Newton-Schulz step on a shard is not the step on the matrix. So each matrix's momentum update (elementwise, done on
the shards) is sent to one owner rank of the matrix's shard group in bf16 (what torch's Newton-Schulz starts from);
the owner orthogonalises the whole matrix with torch's own iteration and sends every rank its rows back; each rank
then applies weight decay and the update to its own rows, as torch.optim.Muon applies them to the whole parameter.
The exchanges go in rounds, as dion's Muon (torchtitan's experiments) does them: each rank receives one matrix of its
own per round in one all-to-all and returns the results in another, so no rank ever holds more than one gathered
matrix; here a round mixes shapes and uneven row splits, and the owners are balanced by Newton-Schulz cost, largest
matrix first (as hyper_parallel's HSDP Muon assigns them). Under HSDP every replica's shard group does the same,
each rank a 1/fsdp_size share. A matrix split over two mesh dimensions (tensor parallelism beside FSDP) is gathered
whole on every rank of its mesh, which each orthogonalises and takes its own block of. The momentum buffer is a
DTensor sharded like its parameter: DCP saves it and reshards it to another world size like AdamW's moments."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2kit.config.schema import TrainingConfig
from fsdp2kit.errors import UserError
from fsdp2kit.models.shards import local_index
from fsdp2kit.parallel.moe import moe_experts, router_modules

NamedParameters = list[tuple[str, nn.Parameter]]


def muon_split(model: nn.Module, rule: str = "hidden_matrices") -> tuple[NamedParameters, NamedParameters]:
    """The trainable parameters Muon takes and those AdamW takes, by `rule` (training.muon_split): fsdp2kit's
    `hidden_matrices` or MindSpeed-MM's `mindspeed_mm`, so that a MindSpeed-MM file splits as MindSpeed-MM does."""
    takes = mindspeed_mm_eligible if rule == "mindspeed_mm" else hidden_matrices(model)
    matrices: NamedParameters = []
    rest: NamedParameters = []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (matrices if takes(name, param) else rest).append((name, param))
    return matrices, rest


def hidden_matrices(model: nn.Module) -> Callable[[str, nn.Parameter], bool]:
    """Whether Muon takes a parameter by fsdp2kit's rule: 2-D matrices of the hidden layers, and a mixture of
    experts' stacked 3-D experts as one matrix per expert; AdamW takes embeddings, the LM head, the routers, a fused
    experts module's per-expert biases and every other parameter that is not 2-D (norms, biases), as torch.optim.Muon's
    documentation divides them (a critic's or reward model's `score` is its final layer, as the LM head is a causal
    LM's)."""
    hf_model: Any = model
    excluded = [hf_model.get_input_embeddings(), hf_model.get_output_embeddings()] if hasattr(model, "config") else []
    excluded += [m for m in model.modules() if isinstance(m, nn.Embedding)]
    # A value or reward model's output layer (transformers' Generic...Classification `score`): the final layer too.
    excluded.append(getattr(model, "score", None))
    excluded += [model.get_submodule(name) for name in router_modules(model)]
    left_out = {id(p) for module in excluded if module is not None for p in module.parameters()}
    stacked = {id(p): p.ndim == 3 for _, module in moe_experts(model) for p in module.parameters(recurse=False)}

    def takes(name: str, param: nn.Parameter) -> bool:
        return stacked[id(param)] if id(param) in stacked else param.ndim == 2 and id(param) not in left_out

    return takes


def mindspeed_mm_eligible(name: str, param: nn.Parameter) -> bool:
    """Whether Muon takes a parameter by MindSpeed-MM's rule: its FSDP2 trainer's `_is_muon_eligible`
    (Ascend/MindSpeed-MM, mindspeed_mm/fsdp/optimizer/optimizer.py, read at commit 57069cd5), a 2-D parameter whose
    name does not end in `.bias` and has neither `embedding` nor `output_layer` in it. Its models keep the HF names,
    so their embeddings (`embed_tokens`), LM head and routers take Muon, and 3-D stacked experts AdamW."""
    return param.ndim == 2 and not name.endswith(".bias") and "embedding" not in name and "output_layer" not in name


@dataclass(frozen=True)
class ShardGroup:
    """The ranks a matrix is sharded over by rows (FSDP2's Shard(0) on one mesh dimension) and this rank's place among
    them; `group` None: the whole matrix is on this rank."""

    group: ProcessGroup | None
    size: int
    coordinate: int

    def rows(self, total: int) -> list[int]:
        """Each coordinate's rows of a `total`-row matrix, as torch.chunk cuts them (FSDP2's and DTensor's Shard(0))."""
        chunk = math.ceil(total / self.size)
        return [max(0, min(chunk, total - k * chunk)) for k in range(self.size)]


WHOLE = ShardGroup(None, 1, 0)


def shard_group(name: str, param: torch.Tensor) -> ShardGroup:
    """Where `param`'s rows are: FSDP's one Shard(0) mesh dimension (replicated over the others: HSDP), or here."""
    if not isinstance(param, DTensor):
        return WHOLE
    placements = param.placements
    sharded = [dim for dim, placement in enumerate(placements) if not isinstance(placement, Replicate)]
    if not sharded:
        return WHOLE
    first = placements[sharded[0]]
    if len(sharded) > 1 or type(first) is not Shard or first.dim != 0:
        raise UserError(
            f"training.optimizer: muon orthogonalises matrices sharded by rows over one mesh dimension (FSDP, HSDP); "
            f"{name} is placed {list(placements)}: use training.optimizer: adamw"
        )
    mesh = param.device_mesh
    return ShardGroup(mesh.get_group(sharded[0]), mesh.size(sharded[0]), mesh.get_local_rank(sharded[0]))


def split_twice(param: torch.Tensor) -> bool:
    """A matrix split over more than one mesh dimension: tensor parallelism's split, sharded again by FSDP (stacked
    experts, split by expert over theirs, are held whole by their ranks: `require_whole_experts`)."""
    return (
        isinstance(param, DTensor)
        and param.ndim == 2
        and sum(not isinstance(p, Replicate) for p in param.placements) > 1
    )


def require_whole_experts(name: str, param: torch.Tensor) -> None:
    """FSDP2 and expert parallelism shard stacked experts by expert only (Shard(0), or FSDP's strided shard under
    EP), so each rank holds whole expert matrices: it orthogonalises them itself, nothing to gather, the work divided
    as the experts are. Any other placement is refused."""
    if isinstance(param, DTensor) and any(
        not isinstance(p, Replicate) and getattr(p, "dim", None) != 0 for p in param.placements
    ):
        raise UserError(
            f"training.optimizer: muon orthogonalises stacked experts held whole by their ranks (sharded by expert); "
            f"{name} is placed {list(param.placements)}: use training.optimizer: adamw"
        )


def held_experts(param: torch.Tensor) -> range:
    """The experts (indices into the stacked tensor's first dimension) whose matrices this rank holds."""
    if not isinstance(param, DTensor):
        return range(param.shape[0])
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return range(offset[0], offset[0] + shape[0])


def newton_schulz_cost(shape: torch.Size) -> int:
    """Multiply-adds of a Newton-Schulz iteration on an A x B matrix, up to a constant: min(A, B)^2 x max(A, B)."""
    small, large = sorted(shape[-2:])
    return small * small * large


def assign_owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """Each matrix's owner among `ranks`: the costliest first, each to the least loaded rank (the lowest of ties)."""
    load = [0] * ranks
    owners = [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-newton_schulz_cost(shapes[i]), i)):
        owner = min(range(ranks), key=lambda rank: (load[rank], rank))
        owners[index] = owner
        load[owner] += newton_schulz_cost(shapes[index])
    return owners


@dataclass(frozen=True)
class Exchange:
    """The matrices of one shard group in rounds: round k holds each coordinate's k-th owned matrix (an index into
    the optimizer's matrices), None where that coordinate owns fewer."""

    shards: ShardGroup
    rounds: list[list[int | None]]


def exchanges(names: list[str], matrices: list[nn.Parameter]) -> list[Exchange]:
    """The rounds of each shard group, the same on every rank (built from the same parameter order)."""
    by_group: dict[ShardGroup, list[int]] = {}
    for index, (name, param) in enumerate(zip(names, matrices, strict=True)):
        if param.ndim == 3 or split_twice(param):
            continue  # stacked experts: each rank orthogonalises the experts it holds; twice split: gathered whole
        by_group.setdefault(shard_group(name, param), []).append(index)
    plans = []
    for shards, indices in by_group.items():
        owners = assign_owners([matrices[i].shape for i in indices], shards.size)
        owned = [[i for i, owner in zip(indices, owners, strict=True) if owner == rank] for rank in range(shards.size)]
        count = max(len(mine) for mine in owned)
        rounds = [[mine[k] if k < len(mine) else None for mine in owned] for k in range(count)]
        plans.append(Exchange(shards, rounds))
    return plans


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _all_to_all(
    send: torch.Tensor, send_sizes: list[int], receive_sizes: list[int], shards: ShardGroup
) -> torch.Tensor:
    if shards.group is None:
        return send
    received = send.new_empty(sum(receive_sizes))
    dist.all_to_all_single(received, send, receive_sizes, send_sizes, group=shards.group)
    return received


def orthogonalise(update: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
    """torch.optim.Muon's own Newton-Schulz iteration on a whole matrix (bf16 in, bf16 out)."""
    from torch.optim import _muon

    return _muon._zeropower_via_newtonschulz(update, group["ns_coefficients"], group["ns_steps"], group["eps"])


def adjusted_lr(lr: float, group: dict[str, Any], shape: torch.Size) -> float:
    """torch.optim.Muon's learning rate for an A x B matrix, with MindSpeed-MM's matched RMS (torch's is 0.2)."""
    rows, cols = shape[-2:]
    if group["adjust_lr_fn"] == "match_rms_adamw":
        return lr * (group["matched_adamw_rms"] * math.sqrt(max(rows, cols)))
    return lr * math.sqrt(max(1, rows / cols))


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on the groups marked `muon`, torch's AdamW (`adamw`, sharing this optimizer's group dicts and state) on
    the others. `orthogonalised` lists the matrices this rank ran Newton-Schulz on in its last step (a stacked
    expert's as `name[expert]`)."""

    def __init__(self, matrices: NamedParameters, adamw: torch.optim.AdamW | None, cfg: TrainingConfig) -> None:
        from torch.optim import _muon

        muon_group = {
            "params": [param for _, param in matrices],
            "lr": cfg.learning_rate,
            "weight_decay": cfg.weight_decay,
            "momentum": cfg.muon_momentum,
            "nesterov": cfg.muon_nesterov,
            "ns_coefficients": (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C),
            "eps": _muon.EPS,
            "ns_steps": cfg.muon_ns_steps,
            "adjust_lr_fn": cfg.muon_lr_adjustment,
            "matched_adamw_rms": cfg.muon_matched_adamw_rms,
            "muon": True,
        }
        adamw_groups = adamw.param_groups if adamw is not None else []
        for group in adamw_groups:
            group["muon"] = False
        super().__init__([muon_group, *adamw_groups] if matrices else adamw_groups, {})
        self.adamw = adamw
        self._link_adamw()
        self.names = [name for name, _ in matrices]
        self.matrices = [param for _, param in matrices]
        self.exchanges = exchanges(self.names, self.matrices)
        self.stacked = [index for index, param in enumerate(self.matrices) if param.ndim == 3]
        self.split_twice = [index for index, param in enumerate(self.matrices) if split_twice(param)]
        for index in self.stacked:
            require_whole_experts(self.names[index], self.matrices[index])
        self.orthogonalised: list[str] = []

    def _link_adamw(self) -> None:
        """AdamW steps this optimizer's own AdamW group dicts and state (load_state_dict replaces both)."""
        if self.adamw is not None:
            self.adamw.param_groups = [group for group in self.param_groups if not group["muon"]]
            self.adamw.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link_adamw()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups = {id(param): group for group in self.param_groups if group["muon"] for param in group["params"]}
        updates = self._momentum_updates(groups)
        self.orthogonalised = []
        for exchange in self.exchanges:
            for owners in exchange.rounds:
                self._round(exchange.shards, owners, updates, groups)
        for index in self.stacked:
            if index in updates:
                self._experts(index, updates[index], groups[id(self.matrices[index])])
        for index in self.split_twice:
            if index in updates:
                self._gathered(index, updates[index], groups[id(self.matrices[index])])
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def _momentum_updates(self, groups: dict[int, dict[str, Any]]) -> dict[int, torch.Tensor]:
        """Each matrix's (Nesterov) momentum update on this rank's rows in bf16, by index; the buffers advanced."""
        updates = {}
        for index, param in enumerate(self.matrices):
            if param.grad is None:  # FSDP gives a gradient on every rank of a group, or on none
                continue
            group, state = groups[id(param)], self.state[param]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(param.grad, memory_format=torch.preserve_format)
            grad, buffer = _local(param.grad), _local(state["momentum_buffer"])
            buffer.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buffer, group["momentum"]) if group["nesterov"] else buffer
            updates[index] = update.to(torch.bfloat16, copy=True)
        return updates

    def _round(
        self,
        shards: ShardGroup,
        owners: list[int | None],
        updates: dict[int, torch.Tensor],
        groups: dict[int, dict[str, Any]],
    ) -> None:
        """Each rank's rows of each owner's matrix to the owner, the owner's orthogonalised matrix back by rows, each
        rank's rows updated."""
        mine = owners[shards.coordinate]
        sends = [updates[i].reshape(-1) if i in updates else None for i in owners]
        send_sizes = [send.numel() if send is not None else 0 for send in sends]
        whole_rows = shards.rows(self.matrices[mine].shape[0]) if mine in updates else [0] * shards.size
        columns = self.matrices[mine].shape[1] if mine is not None else 0
        empty = torch.empty(0, dtype=torch.bfloat16, device=_local(self.matrices[0]).device)
        gathered = _all_to_all(
            torch.cat([send for send in sends if send is not None] or [empty]),
            send_sizes,
            [rows * columns for rows in whole_rows],
            shards,
        )
        result = empty
        if mine is not None and mine in updates:
            whole = gathered.view(self.matrices[mine].shape)
            result = orthogonalise(whole, groups[id(self.matrices[mine])]).contiguous().reshape(-1)
            self.orthogonalised.append(self.names[mine])
        back = _all_to_all(result, [rows * columns for rows in whole_rows], send_sizes, shards)
        for index, piece in zip(owners, back.split(send_sizes), strict=True):
            if index is not None and index in updates:
                param = self.matrices[index]
                self._apply(_local(param), piece.view_as(updates[index]), groups[id(param)], param.shape)

    def _experts(self, index: int, update: torch.Tensor, group: dict[str, Any]) -> None:
        """Each expert this rank holds of a stacked experts tensor orthogonalised and updated as its own matrix."""
        param = self.matrices[index]
        weights = _local(param)
        for local, expert in enumerate(held_experts(param)):
            self._apply(weights[local], orthogonalise(update[local], group), group, param.shape)
            self.orthogonalised.append(f"{self.names[index]}[{expert}]")

    def _gathered(self, index: int, update: torch.Tensor, group: dict[str, Any]) -> None:
        """A matrix split over two mesh dimensions: its update gathered whole on every rank, orthogonalised, and this
        rank's block of it applied."""
        param = cast(DTensor, self.matrices[index])
        whole = DTensor.from_local(
            update, param.device_mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
        ).full_tensor()
        result = orthogonalise(whole, group)
        self._apply(_local(param), result[local_index(param)], group, param.shape)
        self.orthogonalised.append(self.names[index])

    @staticmethod
    def _apply(rows: torch.Tensor, update: torch.Tensor, group: dict[str, Any], shape: torch.Size) -> None:
        """torch.optim.Muon's decoupled weight decay and update, on this rank's rows of a matrix of `shape`."""
        rows.mul_(1 - group["lr"] * group["weight_decay"])
        rows.add_(update, alpha=-adjusted_lr(group["lr"], group, shape))


def gathered_matrix_bytes(optimizer: MuonWithAdamW) -> int:
    """What the largest matrix this rank orthogonalises holds while it does: the whole matrix in bf16 as it arrives
    (a stacked expert's is already here), and Newton-Schulz's iterate, its Gram matrix, their product and the next
    iterate (A x B, min(A, B) squared)."""
    mine = [owners[exchange.shards.coordinate] for exchange in optimizer.exchanges for owners in exchange.rounds]
    mine += [index for index in optimizer.stacked if _local(optimizer.matrices[index]).shape[0]]
    return max((newton_schulz_bytes(optimizer.matrices[i].shape) for i in mine if i is not None), default=0)


def newton_schulz_bytes(shape: torch.Size) -> int:
    """A matrix of an A x B `shape` (the last two dimensions) in bf16 and Newton-Schulz's working set on it."""
    small, large = sorted(shape[-2:])
    return 2 * (3 * small * large + 2 * small * small)


def require_torch_muon() -> None:
    if not hasattr(torch.optim, "Muon"):
        raise UserError(
            f"training.optimizer: muon needs torch.optim.Muon (torch >= 2.9); this is torch {torch.__version__}: "
            "upgrade torch, or use training.optimizer: adamw"
        )
