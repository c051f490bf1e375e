"""Remove-padding and token-budget micro-batches for the back-end API (verl's `use_remove_padding` and
`use_dynamic_bsz`). An RL batch is padded on both sides (left-padded prompts, right-padded responses); packed, only
its real tokens are computed: one stream per micro-batch, each row a document whose positions restart at 0, kept
apart as packed training documents are (transformers' packed-sequence convention: FlexAttention's block mask or
varlen flash where the build picked them, parallel/document_attention.py, else a dense document mask). The outputs
go back to the padded layout. A budget cuts a batch's rows into micro-batches of at most so many real tokens; ranks
with fewer add empty micro-batches, so every data-parallel rank runs as many rounds of collectives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from fsdp2kit.data.dataset import model_inputs
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.train.step import MicroBatchLoss, MicroBatchTerms

Batch = dict[str, torch.Tensor]
# The model inputs a packed stream carries (what the batch had besides them would be lost in the stream: refused).
PACKED_INPUTS = ("input_ids", "attention_mask", "position_ids", "labels")


@dataclass(frozen=True)
class PackedRows:
    """A padded micro-batch's real tokens as one stream [1, N] of documents (one per row, positions from 0, each
    document's targets its own next tokens), and the way back to the padded layout."""

    stream: Batch  # input_ids, position_ids, labels [1, N]
    real: torch.Tensor  # [B, T] bool: the padded batch's tokens the stream holds, in order

    @property
    def length(self) -> int:
        return int(self.stream["input_ids"].shape[1])

    def unpack_tokens(self, outputs: torch.Tensor) -> torch.Tensor:
        """The stream's per-token outputs [1, N] at the padded batch's positions [B, T], 0 at padding; with
        autograd."""
        return outputs.new_zeros(self.real.shape).masked_scatter(self.real, outputs.reshape(-1))

    def unpack(self, outputs: torch.Tensor) -> torch.Tensor:
        """The stream's next-token outputs [1, N] at the padded batch's shifted positions [B, T-1] (position t: the
        prediction of token t+1), 0 where token t or t+1 is padding; with autograd."""
        placed = self.unpack_tokens(outputs)[:, :-1]
        return placed.masked_fill(~(self.real[:, :-1] & self.real[:, 1:]), 0.0)  # a document's last token

    def token_temperature(self, temperature: torch.Tensor | None) -> torch.Tensor | None:
        """The batch's temperature for the stream: one number as it is, one per sample [B] as one per token [1, N]."""
        if temperature is None or temperature.dim() == 0:
            return temperature
        return temperature[:, None].expand(self.real.shape)[self.real][None]


def pack_rows(batch: Batch, inputs: Batch, what: str, targets: torch.Tensor | None = None) -> PackedRows:
    """The stream of `batch` (input_ids [B, T] with an attention_mask that is one run of 1s per row), for the model
    `inputs` made of it. Its labels are `targets` [B, T-1] (a causal LM's next tokens) where the next token is real,
    else 0 at every token (a value head's: they only mark the positions). A target at a padding position (a left
    pad's prediction of the first real token) has no document and is left out."""
    extra = sorted(set(inputs) - set(PACKED_INPUTS))
    if extra:
        raise UserError(
            f"{what}: model.remove_padding packs input_ids, attention_mask and position_ids; the batch also gives the "
            f"model {', '.join(extra)} (turn remove_padding off for such batches)"
        )
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    starts = real & ~F.pad(real[:, :-1], (1, 0), value=False)
    positions = real.cumsum(1) - 1
    given = batch.get("position_ids")
    wrong_positions = given is not None and (given.shape != ids.shape or bool((given != positions)[real].any()))
    if wrong_positions or bool((starts.sum(1) > 1).any()) or not bool(real.any()):
        raise UserError(
            f"{what}: model.remove_padding packs each row's real tokens as one document, so attention_mask must be "
            "one run of 1s per row (left and right padding only), with a real token somewhere, and position_ids "
            "(if given) must count each row's real tokens from 0 (cumsum(attention_mask) - 1)"
        )
    if targets is None:
        labels = torch.zeros_like(ids)
    else:
        labels = F.pad(targets.masked_fill(~real[:, 1:], IGNORE_INDEX), (0, 1), value=IGNORE_INDEX)
    stream = {"input_ids": ids[real][None], "position_ids": positions[real][None], "labels": labels[real][None]}
    return PackedRows(stream, real)


def split_rows(batch: Batch, max_tokens: int) -> list[Batch]:
    """`batch` cut into runs of consecutive rows holding at most `max_tokens` real tokens each (attention_mask's 1s;
    every token without one); a longer row is a micro-batch of its own. Every tensor whose first dimension is the
    batch's rows is cut with them; anything else goes to each part as it is."""
    ids = batch["input_ids"]
    rows = ids.shape[0]
    mask = batch.get("attention_mask")
    lengths = mask.sum(1).tolist() if mask is not None else [ids.shape[1]] * rows
    return [_rows(batch, part, rows) for part in token_budget_ranges(lengths, max_tokens)]


def token_budget_ranges(lengths: list[int], budget: int) -> list[range]:
    """Consecutive rows whose token counts sum to at most `budget` (a longer row is alone)."""
    ranges, start, tokens = [], 0, 0
    for row, length in enumerate(lengths):
        if row > start and tokens + length > budget:
            ranges.append(range(start, row))
            start, tokens = row, 0
        tokens += length
    return ranges + [range(start, len(lengths))]


def _rows(batch: Batch, part: range, rows: int) -> Batch:
    """The rows `part` of every tensor whose first dimension is the batch's `rows`; anything else as it is."""
    cut = slice(part.start, part.stop)
    return {
        k: v[cut] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v for k, v in batch.items()
    }


def empty_micro_batch(like: Batch) -> Batch:
    """One token of `like`'s first row, no target: a forward and backward that reach every parameter and add nothing."""
    ids = like["input_ids"][:1, :1]
    return {"input_ids": ids, "labels": torch.full_like(ids, IGNORE_INDEX)}


@dataclass
class WithEmptyMicroBatches:
    """`loss` over the first `real` micro-batches; those after are `empty_micro_batch`es, whose loss is 0 x the
    model's output (every FSDP module takes part in the backward's collectives) with no weight and no metrics."""

    loss: MicroBatchLoss
    real: int
    whole_sequence: bool = field(init=False)

    def __post_init__(self) -> None:
        self.whole_sequence = self.loss.whole_sequence

    def weight(self, index: int, batch: Batch) -> torch.Tensor | None:
        return self.loss.weight(index, batch)  # an empty micro-batch has no target: 0 where it is counted before

    def __call__(self, model: torch.nn.Module, index: int, batch: Batch, aux_loss_weight: Any) -> MicroBatchTerms:
        if index < self.real:
            return self.loss(model, index, batch, aux_loss_weight)
        outputs = model(**model_inputs(batch), use_cache=False)
        return MicroBatchTerms(outputs.logits.float().sum() * 0, counted=False)
