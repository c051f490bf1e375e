"""The evaluation loss: token-mean next-token cross-entropy over the whole evaluation set, the same number at any
world size. Each data-parallel rank takes every D-th sample of the set (the ranks of a sequence-parallel group the
same ones) in micro-batches of `per_device_eval_batch_size`; every rank runs as many forwards as the rank with most
(each forward is a round of FSDP all-gathers), the missing samples filled with a real one whose tokens are not
counted. Per-token losses are summed in float64 with their count and both all-reduced, so neither the split over
ranks nor the summation order moves the mean by more than float64 rounding."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fsdp2kit.labels import IGNORE_INDEX

Batch = dict[str, torch.Tensor]


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean next-token cross-entropy over every target token of the evaluation set
    tokens: int  # those target tokens


@dataclass
class EvalBatches:
    """This rank's micro-batches of an evaluation set of `count` samples; `collate(indices)` builds one."""

    collate: Callable[[list[int]], Batch]
    count: int
    batch_size: int
    data_parallel_size: int
    data_parallel_rank: int

    @property
    def forwards(self) -> int:
        """Micro-batches per rank: those of the rank with most samples."""
        per_rank = math.ceil(self.count / self.data_parallel_size)
        return math.ceil(per_rank / self.batch_size)

    def micro_batches(self) -> Iterator[Batch]:
        mine = list(range(self.data_parallel_rank, self.count, self.data_parallel_size))
        for first in range(0, self.forwards * self.batch_size, self.batch_size):
            real = mine[first : first + self.batch_size]
            batch = self.collate(real + [0] * (self.batch_size - len(real)))  # every forward of one shape
            if len(real) < self.batch_size:
                batch["labels"][len(real) :] = IGNORE_INDEX  # filler rows: run, not counted
            yield batch


def eval_loss(
    log_probs: Callable[[Batch], torch.Tensor],
    micro_batches: Iterable[Batch],
    device: torch.device,
    sharing: int = 1,
) -> EvalResult:
    """`log_probs(batch)` gives each whole sequence's target log-probs [B, T] (0 where the label is IGNORE_INDEX,
    the same on each of the `sharing` ranks of a sequence-parallel or tensor-parallel group, which are then counted
    once)."""
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for batch in micro_batches:
        targets = batch["labels"] != IGNORE_INDEX
        values = log_probs(batch).double()
        totals[0] -= torch.where(targets, values, torch.zeros_like(values)).sum()
        totals[1] += targets.sum()
    dist.all_reduce(totals)
    loss_sum, tokens = (totals / sharing).tolist()
    return EvalResult(loss_sum / tokens if tokens else math.nan, round(tokens))
