"""The MoE router (load-balancing) loss under Ulysses (issue 49): every sequence-parallel layout trains with one
rank's losses, gradient norms and weights, through the `train` command's loss and through a caller's loss_fn (the
RL adapters' path) whose own term has no gradient, so that the gradient compared is the router loss's alone (a
doubled router gradient left the loss unchanged); 4 ranks hold two Ulysses groups (with and without expert
parallelism)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_two_ranks
from moe_families_worker import train as train_in_process
from test_expert_parallel import QWEN3_MOE, assert_same_training
from test_moe_families import saved_folder

from fsdp2kit.distributed import shutdown

STEPS = 2


def run(folder: Path, out: Path, accumulation: int, ulysses: int = 1, **options: Any) -> dict[str, Any]:
    """One run of tests/moe_families_worker.py: fused experts, 2 micro-batches a step over the data-parallel ranks."""
    return {
        "folder": str(folder),
        "out": str(out),
        "experts": "",
        "per_expert": False,
        "accumulation": accumulation,
        "ulysses": ulysses,
        "steps": STEPS,
        "export": False,
        **options,
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return saved_folder(tmp_path_factory.mktemp("router") / "qwen3_moe", "qwen3_moe", QWEN3_MOE)


@pytest.fixture(scope="module")
def one_rank(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The references in this process, a world of one: the default loss and the router loss alone."""
    out = tmp_path_factory.mktemp("router_one")
    planned = {
        "default": run(folder, out / "default.pt", 2),
        "router": run(folder, out / "router.pt", 2, router_only=True),
    }
    try:
        for spec in planned.values():
            train_in_process(spec)
    finally:
        shutdown()
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


def launched(folder: Path, out: Path, ranks: int, eps: tuple[int, ...]) -> dict[tuple[str, int], dict[str, Any]]:
    """Both losses at each EP size of `eps`, in one launch of `ranks` ranks in Ulysses pairs (`ranks` / 2
    data-parallel groups, 2 micro-batches a step in all)."""
    planned = {
        (loss, ep): run(folder, out / f"{loss}-{ep}.pt", 4 // ranks, 2, ep=ep, router_only=loss == "router")
        for loss in ("default", "router")
        for ep in eps
    }
    spec = out / "runs.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec, ranks=ranks)
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


@pytest.mark.slow
def test_a_ulysses_pair_gives_a_loss_fns_router_loss_one_ranks_gradient(folder, one_rank, tmp_path):
    """The router loss's gradient was ulysses_size times one rank's under a loss_fn (the loss itself equal)."""
    two = launched(folder, tmp_path, 2, (1,))
    assert one_rank["router"]["grad_norms"][0] > 0
    for loss in ("default", "router"):
        assert_same_training(two[loss, 1], one_rank[loss])


@pytest.mark.slow
def test_two_ulysses_groups_on_four_ranks_train_like_one_rank(folder, one_rank, tmp_path):
    """Ranks 2 and 3 raised "Global rank 0 is not part of group" in the first backward (the router logits' gather),
    with expert parallelism (over each Ulysses pair) and without."""
    four = launched(folder, tmp_path, 4, (1, 2))
    for key, result in four.items():
        assert_same_training(result, one_rank[key[0]])


def test_the_router_loss_is_transformers_load_balancing_loss_of_the_whole_rows(tmp_path):
    """transformers counts each row's last token in its load-balancing loss (its forward reads every token); the
    API's batches left it out of the model's inputs: 10.524712 against 10.526814 at coefficient 1. Now the router loss
    a step adds (here alone, under a loss_fn whose own term is 0) is transformers' `load_balancing_loss_func` of the
    same weights and batch, and the default loss is transformers' own training loss."""
    from strategy_case import global_micro_batches
    from test_strategy import strategy
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    config = {
        "model": {
            "name_or_path": "builtin:tiny-qwen3-moe",
            "config": {"num_hidden_layers": 1, "router_aux_loss_coef": 1.0},
        },
        "training": {"max_steps": 2, "lr_scheduler_type": "constant", "output_dir": str(tmp_path / "run")},
    }
    batch = global_micro_batches(0, 1)[0]
    batch["attention_mask"][0] = 1  # row 0 whole (its last token real), row 1 right-padded
    weight = batch["attention_mask"][:, 1:].sum().float()
    with strategy(config) as s:
        s.export_hf(tmp_path / "hf")
        router_loss = s.train_step([batch], lambda log_probs, _: ((log_probs * 0).sum(), weight))["loss"]
    with strategy(config) as s:
        default_loss = s.train_step([batch])["loss"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels)
    expected = load_balancing_loss_func(
        outputs.router_logits, model.config.num_experts, model.config.num_experts_per_tok, batch["attention_mask"]
    )
    assert router_loss == pytest.approx(expected.item(), abs=1e-6)
    assert default_loss == pytest.approx(outputs.loss.item(), abs=1e-5)
