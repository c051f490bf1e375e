"""The device mesh: 1-D `[fsdp]`, or HSDP `[ddp, fsdp]` (replicate across ddp, shard within fsdp); and the
sequence groups laid over that mesh without changing it: FSDP still shards over all ranks (or each fsdp group),
while the ulysses_size x context_parallel_size consecutive ranks of a sequence group share their samples, ordered
`[dp, cp, sp]`: the Ulysses (sp) groups are consecutive ranks, the context-parallel (cp) groups stride across
them. With tensor parallelism a `tp` dimension comes innermost: `[fsdp, tp]` or `[ddp, fsdp, tp]`, tp
consecutive ranks splitting each layer and sharing every input, FSDP sharding over the other dimensions; the
sequence groups then stride over the tp groups (`[dp, cp, sp, tp]`). Under
expert parallelism the experts have a mesh of their own, laid out as ROLL lays it out: `[efsdp, ep]`, or
`[eddp, efsdp, ep]` where efsdp x ep ranks are fewer than the world (`ep` innermost: consecutive ranks)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.errors import UserError


@dataclass(frozen=True)
class MeshLayout:
    shape: tuple[int, ...]
    dim_names: tuple[str, ...]
    ulysses_size: int = 1
    context_parallel_size: int = 1
    ep_size: int = 1
    efsdp_size: int = 1
    tp_size: int = 1

    @property
    def expert_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The experts' mesh (shape, dimension names) under expert parallelism."""
        eddp = self.world_size // (self.efsdp_size * self.ep_size)
        if eddp == 1:
            return (self.efsdp_size, self.ep_size), ("efsdp", "ep")
        return (eddp, self.efsdp_size, self.ep_size), ("eddp", "efsdp", "ep")

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def dense_dims(self) -> tuple[str, ...]:
        """The dimensions FSDP shards over: all but `tp`."""
        return tuple(name for name in self.dim_names if name != "tp")

    @property
    def sequence_size(self) -> int:
        """How many ranks share their samples, each holding a part of every sequence: Ulysses x context parallel."""
        return self.ulysses_size * self.context_parallel_size

    @property
    def data_parallel_size(self) -> int:
        """How many different micro-batches the ranks train on at once: the ranks of a sequence group and of a
        tensor-parallel group share theirs."""
        return self.world_size // (self.sequence_size * self.tp_size)

    def data_parallel_rank(self, rank: int) -> int:
        return rank // (self.sequence_size * self.tp_size)

    def answers_for_its_data(self, rank: int) -> bool:
        """Whether `rank` is the first of the ranks that share its micro-batches (a sequence group's, a tensor-parallel
        group's), which hold the same results of them: the one that reports them."""
        return rank % (self.sequence_size * self.tp_size) == 0

    def _rank(self, data: int, sequence: int, tp: int) -> int:
        """The rank at (data-parallel rank, position in its sequence group, tensor-parallel rank)."""
        return (data * self.sequence_size + sequence) * self.tp_size + tp

    def _groups(self, positions: list[list[int]]) -> list[list[int]]:
        """For each data-parallel rank and tensor-parallel rank, the groups of these sequence positions."""
        return [
            [self._rank(d, s, t) for s in group]
            for d in range(self.data_parallel_size)
            for t in range(self.tp_size)
            for group in positions
        ]

    def sequence_groups(self) -> list[list[int]]:
        """The ranks that share samples and cut their sequences: sequence_size ranks, a tp group apart."""
        return self._groups([list(range(self.sequence_size))])

    def sequence_parallel_groups(self) -> list[list[int]]:
        """The Ulysses groups: ulysses_size consecutive positions of a sequence group."""
        k = self.ulysses_size
        return self._groups([list(range(start, start + k)) for start in range(0, self.sequence_size, k)])

    def context_parallel_groups(self) -> list[list[int]]:
        """The context-parallel groups: within a sequence group, the ranks of one Ulysses rank (stride ulysses_size)."""
        k, size = self.ulysses_size, self.sequence_size
        return self._groups([list(range(j, size, k)) for j in range(k)])

    def tensor_parallel_groups(self) -> list[list[int]]:
        """The tp groups: tp_size consecutive ranks."""
        t = self.tp_size
        return [list(range(start, start + t)) for start in range(0, self.world_size, t)]

    def parallel_dims(self) -> dict[str, int | None]:
        """The sizes in Accelerate's and torchtitan's names: dp_replicate x dp_shard x cp x sp x tp = world, FSDP
        sharding over dp_shard x cp x sp ranks and replicating across dp_replicate. Where a sequence group reaches
        across FSDP's shard groups (HSDP with shard groups smaller than it), the mesh has no such reading: the two
        data-parallel sizes are None."""
        dense = dict(zip(self.dim_names, self.shape, strict=True))
        replicate, shard = dense.get("ddp", 1), dense.get("fsdp", 1)
        inside = shard % self.sequence_size == 0
        return {
            "dp_replicate": replicate if inside else None,
            "dp_shard": shard // self.sequence_size if inside else None,
            "cp": self.context_parallel_size,
            "sp": self.ulysses_size,
            "tp": self.tp_size,
        }

    def data_parallel_groups(self) -> list[list[int]]:
        """The ranks that train different micro-batches together: one of each sequence and tensor-parallel group."""
        return [
            [self._rank(d, s, t) for d in range(self.data_parallel_size)]
            for s in range(self.sequence_size)
            for t in range(self.tp_size)
        ]


def mesh_layout(
    world_size: int,
    strategy: StrategyConfig,
    ulysses_size: int = 1,
    context_parallel_size: int = 1,
    tp_size: int = 1,
) -> MeshLayout:
    """ROLL's rule: fsdp_size auto, <= 1 or >= world -> pure FSDP; otherwise HSDP (world/fsdp_size, fsdp_size).
    FSDP1/Accelerate names: NO_SHARD replicates everywhere; HYBRID_SHARD shards within a node by default.
    `ulysses_size` (which must divide the world size) groups consecutive ranks for sequence parallel;
    `context_parallel_size` (which must divide world / ulysses_size) groups that many Ulysses groups; `tp_size`
    (which must divide the world) splits each layer over consecutive ranks, and the rest apply to world / tp_size."""
    if world_size % tp_size:
        raise UserError(
            f"model.tensor_parallel_size = {tp_size} does not divide the world size {world_size}; valid: "
            f"{', '.join(map(str, divisors(world_size)))}; {_launch_with(tp_size)}"
        )
    if tp_size > 1 and strategy.ep_size > 1:
        raise UserError(
            f"model.tensor_parallel_size = {tp_size} with strategy_config.ep_size = {strategy.ep_size}: tensor "
            "parallelism splits attention and leaves the experts to FSDP; set ep_size: 1 (or tensor_parallel_size: 1)"
        )
    if tp_size > 1 and strategy.float8.enabled:
        raise UserError(
            f"strategy_config.float8.enabled with model.tensor_parallel_size = {tp_size}: float8 matmuls of split "
            "layers are not supported; set float8.enabled: false (or tensor_parallel_size: 1)"
        )
    if tp_size == 1:
        return _sequence_layout(world_size, strategy, ulysses_size, context_parallel_size)
    try:
        dense = _sequence_layout(world_size // tp_size, strategy, ulysses_size, context_parallel_size)
    except UserError as error:  # its world size is the ranks of one tp rank's: say so
        raise UserError(
            f"{error} (the world size here: {world_size} ranks / model.tensor_parallel_size {tp_size})"
        ) from None
    return replace(dense, shape=(*dense.shape, tp_size), dim_names=(*dense.dim_names, "tp"), tp_size=tp_size)


def _sequence_layout(
    world_size: int, strategy: StrategyConfig, ulysses_size: int, context_parallel_size: int
) -> MeshLayout:
    """The layout of the ranks that hold different parts of the data: FSDP's (or HSDP's) mesh, the sequence groups
    over it, and the experts' mesh."""
    if world_size % ulysses_size:
        raise UserError(
            f"model.ulysses_size = {ulysses_size} does not divide the world size {world_size}; valid: "
            f"{', '.join(map(str, divisors(world_size)))}; {_launch_with(ulysses_size * context_parallel_size)}"
        )
    if (world_size // ulysses_size) % context_parallel_size:
        raise UserError(
            f"model.context_parallel_size = {context_parallel_size} does not divide world size {world_size} / "
            f"model.ulysses_size {ulysses_size}; valid: {', '.join(map(str, divisors(world_size // ulysses_size)))}"
            f"; {_launch_with(ulysses_size * context_parallel_size)}"
        )
    layout = replace(
        _fsdp_layout(world_size, strategy), ulysses_size=ulysses_size, context_parallel_size=context_parallel_size
    )
    ep_size, efsdp_size = _expert_sizes(world_size, strategy)
    return replace(layout, ep_size=ep_size, efsdp_size=efsdp_size)


def _launch_with(sequence_size: int) -> str:
    """The way out for a layout that needs more ranks than were started: a number of ranks that holds it."""
    return f"launch with --nproc {sequence_size} (or a multiple of it) for this layout"


def _expert_sizes(world_size: int, strategy: StrategyConfig) -> tuple[int, int]:
    """ROLL's rule: efsdp_size x ep_size ranks hold every expert once, and must divide the world."""
    ep, efsdp = strategy.ep_size, strategy.efsdp_size
    if ep == 1:
        return 1, 1
    if world_size % (ep * efsdp):
        valid = [d for d in divisors(world_size // efsdp) if d > 1] or [1]
        raise UserError(
            f"strategy_config.ep_size = {ep} x efsdp_size = {efsdp} does not divide the world size {world_size}; "
            f"valid ep_size with efsdp_size {efsdp}: {', '.join(map(str, valid))}"
        )
    return ep, efsdp


def _fsdp_layout(world_size: int, strategy: StrategyConfig) -> MeshLayout:
    size = strategy.fsdp_size
    if strategy.sharding_strategy == "NO_SHARD":
        if isinstance(size, int) and 1 < size < world_size:
            raise UserError(
                f"strategy_config.sharding_strategy NO_SHARD replicates on every rank; drop fsdp_size={size}"
            )
        return MeshLayout((world_size, 1), ("ddp", "fsdp"))
    if strategy.fsdp_size_exact and isinstance(size, int):
        if size > world_size or world_size % size:
            raise UserError(
                f"strategy_config.fsdp_size = {size} does not divide the world size {world_size}; "
                f"valid: 'auto' or one of {divisors(world_size)}"
            )
        if size == 1:
            return MeshLayout((world_size, 1), ("ddp", "fsdp"))
    if strategy.sharding_strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and size in ("auto", None):
        size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if not isinstance(size, int) or size <= 1 or size >= world_size:  # 'auto' or None
        return MeshLayout((world_size,), ("fsdp",))
    if world_size % size:
        raise UserError(
            f"strategy_config.fsdp_size = {size} does not divide the world size {world_size}; "
            f"valid: 'auto' or one of {divisors(world_size)}"
        )
    return MeshLayout((world_size // size, size), ("ddp", "fsdp"))


def divisors(n: int) -> list[int]:
    """The sizes a group of n ranks splits evenly into (what error messages offer as valid)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def build_mesh(device_type: str, layout: MeshLayout) -> DeviceMesh:
    return init_device_mesh(device_type, layout.shape, mesh_dim_names=layout.dim_names)


def build_expert_mesh(device_type: str, layout: MeshLayout) -> DeviceMesh | None:
    """The experts' own mesh (None without expert parallelism); every rank builds it, as torch requires."""
    if layout.ep_size == 1:
        return None
    shape, names = layout.expert_shape
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


@dataclass(frozen=True)
class SequenceSubgroups:
    """The parts of a sequence group: its Ulysses group (None: ulysses_size 1) and its context-parallel group (None:
    context_parallel_size 1)."""

    ulysses: ProcessGroup | None
    context: ProcessGroup | None


# By id(sequence group), the subgroups `sequence_parallel_group` made beside it (a group lives as long as the process).
_SUBGROUPS: dict[int, SequenceSubgroups] = {}


def sequence_subgroups(group: ProcessGroup) -> SequenceSubgroups:
    """The Ulysses and context-parallel parts of a sequence group; a group made elsewhere is a Ulysses group."""
    return _SUBGROUPS.get(id(group), SequenceSubgroups(group, None))


def sequence_parallel_group(layout: MeshLayout) -> ProcessGroup | None:
    """This rank's sequence group (None without Ulysses or context parallel), its subgroups recorded beside it
    (`sequence_subgroups`). Every rank creates every group, as torch requires."""
    if layout.sequence_size == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(layout.sequence_groups())
    k, c = layout.ulysses_size, layout.context_parallel_size
    if c > 1:
        ulysses = dist.new_subgroups_by_enumeration(layout.sequence_parallel_groups())[0] if k > 1 else None
        context = dist.new_subgroups_by_enumeration(layout.context_parallel_groups())[0] if k > 1 else group
        _SUBGROUPS[id(group)] = SequenceSubgroups(ulysses, context)
    return group


def data_parallel_group(layout: MeshLayout) -> ProcessGroup | None:
    """This rank's data-parallel group (None: the whole world, without sequence or tensor parallel). Every rank
    creates every group, as torch requires."""
    if layout.sequence_size == 1 and layout.tp_size == 1:
        return None
    group, _ = dist.new_subgroups_by_enumeration(layout.data_parallel_groups())
    return group
