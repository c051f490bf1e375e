"""The trainer's side of a weight sync: each rank sends its own blocks of the weights in the rollout dtype, never
gathering the model, and after the first sync only what changed since the version the receiver holds.

The diff base is one host copy of this rank's blocks in the rollout dtype (what the receiver was last sent); the
current weights are compared with it bit for bit after the cast, so the receiver ends with exactly the bits a full
sync gives. A full sync goes instead on the first call, every `full_every` versions if asked, and whenever the
receiver reports a version other than the last one sent (a lost or damaged message, a receiver restarted).

A background sync (`start`) copies this rank's blocks to the host first, on the calling thread and before the next
step changes the parameters (the collectives it needs run there too); a thread then diffs, encodes and sends them
while the next `train_step` runs."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from fsdp2kit.errors import UserError
from fsdp2kit.models.shards import WeightShard
from fsdp2kit.weight_sync.messages import BITS, GAP_TYPES, Block, WeightMessage

log = logging.getLogger("fsdp2kit.weight_sync")

Send = Callable[[WeightMessage], None]


@dataclass
class SyncStats:
    """What one sync moved on this rank: its messages' tensor bytes, the elements it sent and those it held."""

    version: int
    full: bool
    messages: int = 0
    bytes: int = 0
    sent_elements: int = 0
    elements: int = 0

    @property
    def changed_fraction(self) -> float:
        return self.sent_elements / self.elements if self.elements else 0.0


class WeightSender:
    """One rank's weight sync to one receiver. Every rank of the trainer makes the same calls in the same order
    (`sync`, `start`): a sync is a collective where tensors must be gathered (`shards`' docs)."""

    def __init__(
        self,
        shards: Callable[[], Iterator[WeightShard]],
        part: str,
        current_version: Callable[[], int],
        delta: bool = True,
        full_every: int | None = None,
        bucket_bytes: int = 64 << 20,
        config: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
        agree: Callable[[], None] | None = None,
    ) -> None:
        """`agree`: a collective that fails on every rank where the ranks are not all in a sync (the Strategy's
        check of the call), run before anything else a sync does."""
        if full_every is not None and full_every < 1:
            raise UserError(f"weight sync: full_every={full_every}; give a number of versions >= 1, or None")
        self.shards, self.part, self.current_version = shards, part, current_version
        self.delta, self.full_every = delta, full_every
        self.bucket_bytes, self.config, self.group, self.agree = bucket_bytes, config, group, agree
        self.base: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}  # what the receiver holds, this rank's blocks
        self.sent_version: int | None = None  # the last version this rank sent whole
        self.last_version: int | None = None  # the last version this rank began to send
        self.full_version: int | None = None
        self.syncs = 0
        self.running: _Background | None = None

    @property
    def base_bytes(self) -> int:
        """The host memory the diff base holds on this rank (one rollout-dtype copy of its blocks)."""
        return sum(tensor.nbytes for tensor in self.base.values())

    def sync(self, receiver_version: int | None, send: Send) -> SyncStats:
        """Send the current version now, given the one the receiver holds (None: none); each message goes to
        `send`. A collective where tensors are gathered."""
        self.wait()
        version = self.current_version()
        full = self._begin(version, receiver_version)
        return self._send(self._blocks(self.shards(), full), version, full, send)

    def start(self, receiver_version: int | None, send: Send) -> _Background:
        """`sync` from a thread, from copies of this rank's blocks taken now: the caller may step the model as soon
        as this returns. `wait()` (or the next sync) joins it and raises what it raised."""
        self.wait()
        version = self.current_version()
        full = self._begin(version, receiver_version)
        snapshot = [_on_host_shard(shard) for shard in self.shards() if shard.contributes]
        blocks = self._blocks(snapshot, full)
        self.running = _Background(lambda: self._send(blocks, version, full, send))
        return self.running

    def wait(self) -> SyncStats | None:
        """Join a background sync, if one runs; its stats, or what it raised."""
        running, self.running = self.running, None
        return running.result() if running is not None else None

    def _begin(self, version: int, receiver_version: int | None) -> bool:
        """Whether this sync is full, decided alike on every rank in one all-reduce: rank 0's view of the receiver
        counts, and where any rank sees that the last version did not arrive whole (the receiver is elsewhere, or
        this rank's sends failed part way), every rank sends this one whole and rank 0 says so in one line."""
        if self.agree is not None:
            self.agree()
        first = not dist.is_initialized() or dist.get_rank(self.group) == 0
        told = -1 if receiver_version is None else receiver_version
        sent = -1 if self.sent_version is None else self.sent_version
        scheduled = self.full_every is not None and self.full_version is not None
        scheduled = scheduled and version - cast(int, self.full_version) >= cast(int, self.full_every)
        whole = not self.delta or self.last_version is None or scheduled
        agreed = torch.tensor([told if first else -2, sent, -sent, whole], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
        receiver, most_sent, fewest_sent, whole = agreed.tolist()
        held = None if receiver < 0 else receiver
        arrived = 0 <= receiver == most_sent == -fewest_sent  # the receiver holds what every rank last sent whole
        healing = self.delta and self.last_version is not None and not arrived
        if healing and first:
            log.warning(
                "weight sync: version %s did not reach the receiver whole (it holds version %s): sending version %s "
                "whole",
                self.last_version,
                held,
                version,
            )
        self.last_version = version
        self.syncs += 1
        return healing or bool(whole)

    def _blocks(self, shards: Iterable[WeightShard], full: bool) -> Iterator[tuple[int, Block | None]]:
        """(elements, block to send) for this rank's blocks: whole on a full sync, else what changed (None: nothing
        did); the base moves to the new values as it goes."""
        for shard in shards:
            if not shard.contributes:
                continue
            current = _on_host(shard.local).reshape(-1)
            key = (shard.name, shard.offset)
            base = None if full else self.base.get(key)
            self.base[key] = current
            block = Block(shard.name, shard.full_shape, shard.offset, tuple(shard.local.shape), current)
            yield current.numel(), (block if base is None else _changes(block, base))

    def _send(self, blocks: Iterable[tuple[int, Block | None]], version: int, full: bool, send: Send) -> SyncStats:
        """Bucket the blocks into messages and send them. A sync that fails part way (a transport error) has moved
        part of the base: the next one goes whole."""
        try:
            return self._messages(blocks, version, full, send)
        except BaseException:
            self.sent_version = None
            raise

    def _messages(self, blocks: Iterable[tuple[int, Block | None]], version: int, full: bool, send: Send) -> SyncStats:
        stats = SyncStats(version, full)
        if full:
            self.base.clear()  # a full sync refills it; none of it is kept from before
        rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        senders = dist.get_world_size(self.group) if dist.is_initialized() else 1
        message = self._message(version, full, rank, senders, 0)
        for elements, block in blocks:
            stats.elements += elements
            if block is None:
                continue
            if message.blocks and message.nbytes + block.nbytes > self.bucket_bytes:
                self._deliver(message, stats, send)
                message = self._message(version, full, rank, senders, message.index + 1)
            message.blocks.append(block)
            stats.sent_elements += block.values.numel()
        message.count = message.index + 1
        self._deliver(message, stats, send)
        self.sent_version = version
        self.full_version = version if full else self.full_version
        return stats

    def _message(self, version: int, full: bool, rank: int, senders: int, index: int) -> WeightMessage:
        base_version = None if full else self.sent_version
        config = self.config if full and index == 0 else None  # each rank's first: whichever comes first
        return WeightMessage(self.syncs, version, base_version, self.part, rank, senders, index, None, [], config)

    @staticmethod
    def _deliver(message: WeightMessage, stats: SyncStats, send: Send) -> None:
        stats.messages += 1
        stats.bytes += message.nbytes
        send(message.seal())


class _Background:
    """A sync running on its own thread; `result()` joins it."""

    def __init__(self, work: Callable[[], SyncStats]) -> None:
        self.stats: SyncStats | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(work,), name="fsdp2kit-weight-sync", daemon=True)
        self.thread.start()

    def _run(self, work: Callable[[], SyncStats]) -> None:
        try:
            self.stats = work()
        except BaseException as exc:  # raised again on the caller's thread by result()
            self.error = exc

    def result(self) -> SyncStats | None:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.stats


def _changes(block: Block, base: torch.Tensor) -> Block | None:
    """The elements of `block` whose bits differ from `base`: as the gaps between their positions and their values,
    or the whole block where that is no smaller; None where nothing changed."""
    current = block.values
    bits = BITS[current.element_size()]
    positions = (current.view(bits) != base.view(bits)).nonzero().reshape(-1)
    if positions.numel() == 0:
        return None
    gaps = torch.diff(positions, prepend=positions[:1])
    largest = int(gaps.max())
    gap_type = next(t for t in GAP_TYPES if largest <= torch.iinfo(t).max)
    if positions.numel() * (current.element_size() + gap_type.itemsize) >= current.nbytes:
        return block
    start = int(positions[0])
    return Block(block.name, block.full_shape, block.offset, block.shape, current[positions], gaps.to(gap_type), start)


def _on_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor the sender owns (shards are copies already; a device one is copied over)."""
    return tensor if tensor.device.type == "cpu" else tensor.to("cpu")


def _on_host_shard(shard: WeightShard) -> WeightShard:
    """The shard with its block in host memory (a background sync's copy, taken before the next step)."""
    return WeightShard(shard.name, _on_host(shard.local), shard.full_shape, shard.offset, shard.contributes)
