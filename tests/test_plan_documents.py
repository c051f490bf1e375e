"""`fsdp2kit plan` counts the document mask the run will make (memory_plan.py, PLANNED_DEVICE): where the build on
CUDA attends packed documents with FlexAttention (model.attn_implementation: auto), with or without Ulysses, the
traced step holds no dense [T, T] mask and predicts what unpacked rows of the same shape do; where the dense mask
stays (sdpa named), the prediction holds at least its T x T bytes more."""

from __future__ import annotations

import warnings

import pytest
import torch

from fsdp2kit.memory_plan import ConfigSource, fake_world, predict

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


def test_plan_says_which_device_it_planned_for_in_checks_words(capsys):
    """On a CPU, `plan` of CP 2 over packed documents names the device it planned for (CUDA) and how a run there
    attends them, and then, apart and not counted, what `check` and `train` do on this machine (sdpa by blocks): the
    same words as `check` for each device. The scores of a layer are labelled as eager attention's, outside the peak;
    the figures as tracked tensors, with `training.track_memory` as their measured counterpart; and torch's module
    tracker warning about its hierarchy does not reach the user."""
    from fsdp2kit.config import load_config
    from fsdp2kit.memory_plan import _headline, print_plan
    from fsdp2kit.models.sharded import build_sharded_model
    from fsdp2kit.parallel.document_attention import document_route

    layout = ["model.context_parallel_size=2", "data.seq_len=384"]  # a length no other test traces: a fresh trace
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = planned(*layout)
    assert not [w for w in caught if "module hierarchy tracking" in str(w.message)]
    assert (report["planned_device"], report["this_device"]) == ("cuda", "cpu")
    assert report["scores_in_peak"] is False

    # `check`'s words: document_route of the model the run builds here, for each device.
    cfg = load_config("examples/demo.yaml", [*TINY, *layout])
    with fake_world(2) as runtime:
        model = build_sharded_model(
            cfg.model, cfg.strategy_args.strategy_config, cfg.data, runtime, training=True, seed=0, materialize=False
        )
        words = {
            device: document_route(model.model, cfg.model, cfg.data, torch.device(device))[1]
            for device in ("cpu", "cuda")
        }
    assert report["document_attention"] == words["cuda"]
    assert report["document_attention_here"] == words["cpu"]
    assert words["cpu"].startswith("sdpa by blocks")

    capsys.readouterr()
    print_plan({"world_size": 2, **report, "strategies": []}, as_json=False)
    out = capsys.readouterr().out
    assert "planned for: cuda" in out and "this machine: cpu" in out
    assert f"document_attention on cuda (counted): {words['cuda']}" in out
    assert (
        f"document_attention on this machine (cpu, as `check` and `train` run here, not counted): {words['cpu']}" in out
    )
    assert "planned as on CUDA" not in out
    assert "tracked tensor bytes" in out and "training.track_memory: true" in out
    assert "scores_bytes (not in the peak)" in out
    assert "scores_bytes: what eager attention would store for one layer;" in out

    on_cuda = _headline({**report, "world_size": 2, "this_device": "cuda"})  # the plan run on a CUDA machine
    assert not any("this machine" in line for line in on_cuda)


def test_plan_counts_the_scores_of_eager_attention_in_its_peak():
    """Eager attention stores each layer's scores: there the plan labels them as held in its peak."""
    from fsdp2kit.memory_plan import _scores_note

    report = predict(
        ConfigSource("examples/demo.yaml", [*TINY, "data.seq_len=96", "model.attn_implementation=eager"], None, None), 1
    )
    assert report["scores_in_peak"] is True
    assert "the traced peak holds them" in _scores_note(True)
