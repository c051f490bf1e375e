"""What an API caller's token batch must hold for the model it feeds: token ids inside the embedding table, whole
token labels, and no more positions than the model has. Otherwise an id past the table is an IndexError deep in the
forward (a device-side assert on CUDA) and positions past the table are silently garbage."""

from __future__ import annotations

import torch

from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX

WHOLE_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def check_token_batch(batch: dict[str, torch.Tensor], what: str, vocab_size: int, max_positions: int | None) -> None:
    """One sentence for an API batch the model cannot read: more positions than `max_positions`, labels that are not
    whole numbers, or (for tensors still in host memory) an id outside 0..vocab_size-1 (a label may also be
    IGNORE_INDEX). The value checks run only on host tensors, before they move: they cost a reduction on the CPU
    and no wait; a tensor the caller already put on an accelerator is not read back (that would stall the device
    queue on every step) and an out-of-range id there is the kernel's own assert."""
    ids, labels = batch["input_ids"], batch.get("labels")
    if isinstance(max_positions, int) and ids.shape[1] > max_positions:
        raise UserError(
            f"{what}: input_ids has {ids.shape[1]} positions, more than the model's max_position_embeddings "
            f"({max_positions}); give at most {max_positions} (or raise model.config.max_position_embeddings if the "
            "model was trained for longer)"
        )
    if labels is not None and labels.dtype not in WHOLE_DTYPES:
        raise UserError(
            f"{what}: labels must be whole token ids (int64 or int32, {IGNORE_INDEX} where not trained), "
            f"not {labels.dtype}"
        )
    if vocab_size <= 0:
        return
    if ids.device.type == "cpu" and ids.numel():
        _check_ids(ids, what, "input_ids", vocab_size, (ids >= 0) & (ids < vocab_size))
    if labels is not None and labels.device.type == "cpu" and labels.numel():
        inside = (labels == IGNORE_INDEX) | ((labels >= 0) & (labels < vocab_size))
        _check_ids(labels, what, "labels", vocab_size, inside)


def _check_ids(values: torch.Tensor, what: str, key: str, vocab_size: int, inside: torch.Tensor) -> None:
    if bool(inside.all()):
        return
    bad = int(values[~inside][0])
    also = f" or {IGNORE_INDEX}" if key == "labels" else ""
    raise UserError(f"{what}: {key} holds {bad}, outside the model's vocabulary (token ids 0..{vocab_size - 1}{also})")
