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


# Context parallel (issue 48) beside Ulysses and expert parallelism, the router loss at coefficient 1 so that it
# counts: 3 steps of 2 micro-batches, through a caller's next-token loss_fn and through the router loss alone.
CP_STEPS, COUNTING = 3, {"config": {"router_aux_loss_coef": 1.0}}


def cp_run(folder: Path, out: Path, name: str, loss: str, accumulation: int = 2, **options: Any) -> dict[str, Any]:
    return run(
        folder,
        out / f"{name}-{loss}.pt",
        accumulation,
        steps=CP_STEPS,
        model=COUNTING,
        caller_loss=loss == "caller",
        router_only=loss == "router",
        **options,
    )


@pytest.fixture(scope="module")
def cp_one_rank(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("router_cp_one")
    planned = {loss: cp_run(folder, out, "one", loss) for loss in ("caller", "router")}
    try:
        for spec in planned.values():
            train_in_process(spec)
    finally:
        shutdown()
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


def launch(planned: dict[Any, dict[str, Any]], out: Path, ranks: int) -> dict[Any, dict[str, Any]]:
    spec = out / f"runs-{ranks}.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec, ranks=ranks)
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


def assert_cp_training(got: dict[str, Any], expected: dict[str, Any], data_parallel: int) -> float:
    """Losses, gradient norms and weights after 3 steps within 1e-5 of one rank's; returns the largest difference."""
    assert got["data_parallel_size"] == data_parallel and got["attention"].startswith("ulysses_")
    assert_same_training(got, expected)
    worst = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"], strict=True))
    worst = max(worst, *(abs(a - b) / b for a, b in zip(got["grad_norms"], expected["grad_norms"], strict=True)))
    return max(worst, *((got["weights"][k] - t).abs().max().item() for k, t in expected["weights"].items()))


@pytest.mark.slow
def test_moe_router_loss_under_cp_ulysses_and_ep_trains_like_one_rank(folder, cp_one_rank, tmp_path):
    """One 2-rank launch (CP 2 x EP 2) and one 4-rank launch (Ulysses 2 x CP 2 x EP 2; CP 4; CP 2 x EP 2 beside 2
    data-parallel ranks), each through a caller's loss_fn and the router loss alone: one rank's losses, gradient
    norms and weights."""
    assert cp_one_rank["router"]["grad_norms"][0] > 0
    two = launch(
        {("cp2 ep2", loss): cp_run(folder, tmp_path, "cp2ep2", loss, cp=2, ep=2) for loss in ("caller", "router")},
        tmp_path,
        2,
    )
    four_planned = {
        **{
            ("u2 cp2 ep2", loss): cp_run(folder, tmp_path, "u2cp2ep2", loss, ulysses=2, cp=2, ep=2)
            for loss in ("caller", "router")
        },
        ("cp4", "router"): cp_run(folder, tmp_path, "cp4", "router", cp=4),
        ("cp2 ep2 dp2", "router"): cp_run(folder, tmp_path, "cp2ep2dp2", "router", 1, cp=2, ep=2),
    }
    four = launch(four_planned, tmp_path, 4)
    for (name, loss), got in {**two, **four}.items():
        data_parallel = 2 if name.endswith("dp2") else 1
        print(f"{name} {loss}: max difference", assert_cp_training(got, cp_one_rank[loss], data_parallel))
