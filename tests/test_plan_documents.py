"""`fsdp2kit plan` counts the document mask the run will make (memory_plan.py, PLANNED_DEVICE): where the build on
CUDA attends packed documents with FlexAttention (model.attn_implementation: auto), with or without Ulysses, the
traced step holds no dense [T, T] mask and predicts what unpacked rows of the same shape do; where the dense mask
stays (sdpa named), the prediction holds at least its T x T bytes more."""

from __future__ import annotations

import pytest

from fsdp2kit.memory_plan import ConfigSource, predict

SEQ_LEN = 512
TINY = [
    "model.config.num_hidden_layers=2",
    f"data.seq_len={SEQ_LEN}",
    "training.per_device_train_batch_size=2",
    "training.gradient_accumulation_steps=1",
]


def planned(*overrides: str) -> dict:
    return predict(ConfigSource("examples/demo.yaml", [*TINY, *overrides], None, None), 2)


@pytest.mark.parametrize("ulysses", [1, 2])
def test_plan_counts_the_dense_document_mask_only_where_it_is_made(ulysses):
    sizes = [f"model.ulysses_size={ulysses}"]
    flex = planned(*sizes)  # packed documents, attn auto: FlexAttention on CUDA
    dense = planned(*sizes, "model.attn_implementation=sdpa")
    unpacked = planned(*sizes, "data.document_mask=false")
    assert flex["document_attention"].startswith("FlexAttention with a document block mask")
    assert "dense [T, T] document mask" in dense["document_attention"]
    assert unpacked["document_attention"] is None
    assert flex["peak_bytes"] == unpacked["peak_bytes"]
    assert dense["peak_bytes"] - flex["peak_bytes"] >= SEQ_LEN**2  # one boolean [T, T] mask at least
