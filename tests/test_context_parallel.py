"""Context parallel (issue 48): `model.context_parallel_size: c` gives each rank of a cp group two of 2c chunks of
every sequence (a front one and its mirror from the back), and attention all-gathers the keys and values over the
group. Trained that way (fp32), alone, beside Ulysses, HSDP or expert parallelism, with packed documents or right
padding, a model follows one rank without it: the same losses, gradient norms and weights after 3 steps, the same
log-probs of left-padded prompts, at their padding too (under eager attention and Ulysses as well); a checkpoint saved
at CP 2 resumes at CP 1 and at Ulysses 2. The runs are tests/moe_families_worker.py's (a Mistral with a sliding window
shorter than the sequence, and a Qwen3-MoE)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import as_overrides, launch_two_ranks, read_metrics, reference_run, run_cli, set_args
from moe_families_worker import left_padded_probe, micro_batches
from moe_families_worker import train as train_in_process
from test_expert_parallel import QWEN3_MOE
from test_expert_parallel import run as expert_run
from test_moe_families import saved_folder

from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.mesh import mesh_layout
from fsdp2kit.parallel.sequence_layout import token_order

STEPS = 3
MISTRAL = {"sliding_window": 6}  # shorter than the sequence: the band is applied by global index


# Unit level: the layout, and which tokens each rank holds.


def test_layout_orders_ranks_dp_cp_sp():
    """8 ranks, Ulysses 2 x CP 2: sequence groups of 4 consecutive ranks (2 data-parallel ranks), Ulysses pairs
    consecutive, cp pairs across them; the FSDP mesh unchanged."""
    layout = mesh_layout(8, StrategyConfig(fsdp_size=4), ulysses_size=2, context_parallel_size=2)
    assert (layout.shape, layout.dim_names) == ((2, 4), ("ddp", "fsdp"))
    assert layout.sequence_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.sequence_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.context_parallel_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert (layout.data_parallel_size, [layout.data_parallel_rank(r) for r in range(8)]) == (2, [0] * 4 + [1] * 4)


def test_context_parallel_size_must_divide_the_ranks_left_by_ulysses():
    with pytest.raises(UserError, match=r"model.context_parallel_size = 3 does not divide world size 8 / "):
        mesh_layout(8, StrategyConfig(), ulysses_size=2, context_parallel_size=3)


def test_each_rank_holds_a_front_chunk_and_its_mirror():
    order = token_order(16, 2, 2)  # 4 chunks of 4: cp rank 0 holds chunks 0 and 3, cp rank 1 chunks 1 and 2
    assert order.tolist() == [[[0, 1, 2, 3], [12, 13, 14, 15]], [[4, 5, 6, 7], [8, 9, 10, 11]]]
    assert token_order(8, 1, 2).tolist() == [[[0, 1, 2, 3], [4, 5, 6, 7]]]  # Ulysses alone: contiguous slices


@pytest.mark.parametrize(("context", "ulysses"), [(2, 1), (4, 1), (2, 2), (8, 1)])
def test_the_causal_work_is_balanced_over_the_cp_ranks(context, ulysses):
    """Per cp rank, the (query, key) pairs causal attention computes for its queries over the whole sequence: within
    10% of each other (a contiguous cut would give the last rank 2c - 1 times the first's)."""
    length = 2 * context * ulysses * 64
    order = token_order(length, context, ulysses)
    work = [int((order[rank].flatten() + 1).sum()) for rank in range(context)]  # query i attends to keys 0..i
    assert max(work) / min(work) < 1.1, work
    contiguous = [int((torch.arange(length).view(context, -1)[rank] + 1).sum()) for rank in range(context)]
    assert max(contiguous) / min(contiguous) > 2


# End to end: one rank, then one launch of 2 ranks and one of 4.


def run(folder: Path, out: Path, accumulation: int, **options: Any) -> dict[str, Any]:
    """One run of tests/moe_families_worker.py as tests/test_expert_parallel.py's, with the left-padded probe and
    mixed packed and right-padded micro-batches unless `options` say otherwise."""
    return expert_run(folder, out, accumulation, **({"left_padded": True, "packed": "mixed"} | options))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cp_models")
    return {
        "dense": saved_folder(root / "mistral", "mistral", MISTRAL),
        "moe": saved_folder(root / "moe", "qwen3_moe", QWEN3_MOE),
    }


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cp_runs")


def results(planned: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


# LoRA over every linear layer, B random (peft's init_lora_weights: false) so that the adapters count from step 1.
# The Strategy API packs each padded micro-batch's rows into one stream of documents (right-padded batches only: it
# refuses packed ones), then cuts that stream for CP.
REMOVE_PADDING = {"remove_padding": True}
LORA = {"lora": {"rank": 4, "target_modules": "all-linear", "init_lora_weights": False}}
# Eager attention gives a query with no key (a left pad) the mean of its row's values, sdpa 0: a step of RL's rows
# with each (the default loss counts the last left pad's prediction of the first real token), then the probe.
EAGER = {"attn_implementation": "eager"}
ONE_LEFT_STEP = {"packed": "left", "steps": 1}


@pytest.fixture(scope="module")
def one_rank(folders: dict[str, Path], out: Path) -> dict[str, dict[str, Any]]:
    """The references, in this process (a world of one): 4 micro-batches a step, 2 right-padded and 2 of packed
    documents (`micro_batches`' "mixed"): every run below trains both kinds in each step, but `model.remove_padding`'s
    (right-padded micro-batches only, "dense padded") and the left-padded RL rows' ("moe left", a caller's loss; "moe
    left step" and "moe left eager", one step of one micro-batch, with sdpa and eager attention)."""
    dense, moe = folders["dense"], folders["moe"]
    planned = {
        "dense": run(dense, out / "dense-1.pt", 4),
        "dense lora": run(dense, out / "dense-lora-1.pt", 4, model=LORA),
        "moe": run(moe, out / "moe-1.pt", 4),
        "dense padded": run(dense, out / "dense-padded-1.pt", 4, packed=False),
        "moe left": run(moe, out / "moe-left-1.pt", 4, packed="left", caller_loss=True),
        "moe left step": run(moe, out / "moe-left-step-1.pt", 1, **ONE_LEFT_STEP),
        "moe left eager": run(moe, out / "moe-left-eager-1.pt", 1, model=EAGER, **ONE_LEFT_STEP),
    }
    try:
        for spec in planned.values():
            train_in_process(spec)
    finally:
        shutdown()
    return results(planned)


@pytest.fixture(scope="module")
def two_ranks(folders: dict[str, Path], out: Path, one_rank: dict) -> dict[str, dict[str, Any]]:
    """One 2-rank launch: CP 2 with a caller's loss and every decoder layer recomputed, CP 2 with LoRA and the loss in
    chunks of 3 tokens, CP 2 with EP 2 on the MoE, CP 2 with `model.remove_padding`, CP 2 on left-padded rows with a
    caller's loss, a step of left-padded rows at Ulysses 2 and with eager attention at CP 2 and Ulysses 2, and the
    resumes of CP 2's checkpoint at CP 1 (2 data-parallel ranks) and at Ulysses 2."""
    dense, moe, checkpoint = folders["dense"], folders["moe"], str(out / "ckpt-cp2")
    planned = {
        "cp2": run(
            dense,
            out / "cp2.pt",
            4,
            cp=2,
            caller_loss=True,
            model={"gradient_checkpointing": True},
            save_at=2,
            checkpoint=checkpoint,
        ),
        "cp2 lora": run(dense, out / "cp2-lora.pt", 4, cp=2, model=LORA, training={"loss_chunk_tokens": 3}),
        "cp2 ep2": run(moe, out / "cp2-ep2.pt", 4, cp=2, ep=2),
        "cp2 remove padding": run(dense, out / "cp2-rmpad.pt", 4, cp=2, model=REMOVE_PADDING, packed=False),
        "cp2 left": run(moe, out / "cp2-left.pt", 4, cp=2, packed="left", caller_loss=True),
        "ulysses2 left": run(moe, out / "u2-left.pt", 1, ulysses=2, **ONE_LEFT_STEP),
        "cp2 left eager": run(moe, out / "cp2-left-eager.pt", 1, cp=2, model=EAGER, **ONE_LEFT_STEP),
        "ulysses2 left eager": run(moe, out / "u2-left-eager.pt", 1, ulysses=2, model=EAGER, **ONE_LEFT_STEP),
        "cp2->cp1": run(dense, out / "resume-cp1.pt", 2, resume=checkpoint),
        "cp2->ulysses2": run(dense, out / "resume-u2.pt", 4, ulysses=2, resume=checkpoint),
    }
    spec = out / "two_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec)
    return results(planned)


@pytest.fixture(scope="module")
def four_ranks(folders: dict[str, Path], out: Path, two_ranks: dict) -> dict[str, dict[str, Any]]:
    """One 4-rank launch: CP 4, Ulysses 2 x CP 2 (its decoder layers recomputed by name), and CP 2 beside HSDP (2
    data-parallel ranks, mesh (2, 2))."""
    dense = folders["dense"]
    recompute = {"strategy": {"recompute_modules": ["model.layers.{*}"]}}
    planned = {
        "cp4": run(dense, out / "cp4.pt", 4, cp=4),
        "u2cp2": run(dense, out / "u2cp2.pt", 4, cp=2, ulysses=2, **recompute),
        "cp2 hsdp": run(dense, out / "cp2-hsdp.pt", 2, cp=2, strategy={"fsdp_size": 2}),
    }
    spec = out / "four_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec, ranks=4)
    return results(planned)


def assert_same_training(
    got: dict[str, Any], expected: dict[str, Any], data_parallel: int, weight_atol: float = 1e-5, unpadded: bool = False
) -> float:
    """Losses, gradient norms and weights after the run's steps within 1e-5, and the left-padded probe's log-probs at
    every position, padding included (`unpadded`, model.remove_padding: at the real tokens, and 0 at the others); the
    run really split its sequences (its data-parallel degree is world / (ulysses x cp), its attention the wrapper's).
    Returns the largest difference seen."""
    assert got["data_parallel_size"] == data_parallel
    assert got["attention"].startswith("ulysses_")
    assert got["losses"] == pytest.approx(expected["losses"][-len(got["losses"]) :], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"][-len(got["grad_norms"]) :], rel=1e-5)
    worst = max(abs(a - b) for a, b in zip(got["losses"], expected["losses"][-len(got["losses"]) :], strict=True))
    assert sorted(got["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=weight_atol, rtol=0, msg=name)
        worst = max(worst, (got["weights"][name] - tensor).abs().max().item())
    mask = left_padded_probe()["attention_mask"]
    real = (mask[:, :-1] * mask[:, 1:]).bool()
    compared = real if unpadded else torch.ones_like(real)
    assert got["left_log_probs"].shape == real.shape
    assert bool((got["left_log_probs"][~compared] == 0).all())
    probe = (got["left_log_probs"] - expected["left_log_probs"])[compared].abs().max().item()
    assert probe < 1e-5, probe
    return max(worst, probe)


# What each case turns on besides CP, and the proof that it was on: a recomputed layer attends twice per micro-batch
# (the attention calls of the train steps double), LoRA's adapters are what trains, the loss was cut in chunks, every
# micro-batch (right-padded and packed documents alike, under the Mistral's sliding window too) attended block by
# block with no dense mask made (parallel/context_attention.py), and so did the left-padded probe (not under a
# sliding window: the Mistral's probe keeps the dense mask, unless padding is removed, which packs it).
# Without padding the model's outputs at padded targets are 0 (else whatever the padded computation gives).
RECOMPUTED, LORA_WEIGHTS, CHUNKED, BLOCKWISE = "recomputed", "lora weights", "chunked loss", "blockwise"
UNPADDED, LEFT_BLOCKWISE = "unpadded", "left-padded probe blockwise"


def assert_features_on(got: dict[str, Any], reference: dict[str, Any], features: set[str]) -> None:
    twice = got["attention_calls"] == 2 * reference["attention_calls"]
    assert twice == (RECOMPUTED in features), (got["attention_calls"], reference["attention_calls"])
    assert any(".lora_B." in name for name in got["trained"]) == (LORA_WEIGHTS in features)
    assert (got["chunk_tokens"] == 3) == (CHUNKED in features)
    assert got["blockwise_calls"] == (got["attention_calls"] if BLOCKWISE in features else 0)
    if BLOCKWISE in features:  # and no dense mask made beside the blocks, packed documents' included
        assert got["dense_masks"] == 0
    blockwise, dense_masks, calls = got["left_calls"]
    assert calls > 0, got["left_calls"]
    assert (blockwise == calls, dense_masks == 0) == (LEFT_BLOCKWISE in features,) * 2, got["left_calls"]
    mask = micro_batches(-1, 1)[0]["attention_mask"]
    padded = ~(mask[:, :-1] * mask[:, 1:]).bool()
    assert bool((got["log_probs"][padded] == 0).all()) == (UNPADDED in features)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "reference", "weight_atol", "features"),
    [
        ("cp2", "dense", 1e-5, {RECOMPUTED, BLOCKWISE}),  # and a caller's loss_fn
        ("cp2 lora", "dense lora", 1e-5, {LORA_WEIGHTS, CHUNKED, BLOCKWISE}),
        # One element of the MoE's layer-1 norm has a tiny gradient (3.7e-6 where the median is 2.5e-3): AdamW's
        # normalised update of it turns fp32 summation order into a ~1e-5 weight difference.
        ("cp2 ep2", "moe", 2e-5, {BLOCKWISE, LEFT_BLOCKWISE}),
        ("cp2 remove padding", "dense padded", 1e-5, {UNPADDED, BLOCKWISE, LEFT_BLOCKWISE}),
        # RL's left-padded rows trained through the Strategy API with a caller's loss: the padding's blocks (none
        # before the prompt) and the prompts' ranges in every train step's attention.
        ("cp2 left", "moe left", 2e-5, {BLOCKWISE, LEFT_BLOCKWISE}),
        # A padding query before the prompt has no key: Ulysses' blocks give it none (0, as sdpa), eager's dense mask
        # the mean of the sequence's values and not of the cut's padding (the probe is not a multiple of the cut).
        ("ulysses2 left", "moe left step", 1e-5, {BLOCKWISE, LEFT_BLOCKWISE}),
        ("cp2 left eager", "moe left eager", 1e-5, set()),
        ("ulysses2 left eager", "moe left eager", 1e-5, set()),
    ],
)
def test_two_rank_layouts_train_like_one_rank(case, reference, weight_atol, features, one_rank, two_ranks):
    """Each case of the 2-rank launch as one rank trains it, and its left-padded probe's log-probs at every position
    (`assert_same_training`)."""
    got, expected = two_ranks[case], one_rank[reference]
    assert_features_on(got, expected, features)
    difference = assert_same_training(got, expected, 1, weight_atol, UNPADDED in features)
    print(f"{case}: max difference", difference)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "data_parallel", "features"),
    [("cp4", 1, {BLOCKWISE}), ("u2cp2", 1, {RECOMPUTED, BLOCKWISE}), ("cp2 hsdp", 2, {BLOCKWISE})],
)
def test_cp_on_four_ranks_trains_like_one_rank(case, data_parallel, features, one_rank, four_ranks):
    assert_features_on(four_ranks[case], one_rank["dense"], features)
    print(f"{case}: max difference", assert_same_training(four_ranks[case], one_rank["dense"], data_parallel))


@pytest.mark.slow
@pytest.mark.parametrize(("case", "data_parallel"), [("cp2->cp1", 2), ("cp2->ulysses2", 1)])
def test_a_cp2_checkpoint_resumes_at_another_layout(case, data_parallel, one_rank, two_ranks):
    """Saved after step 2 at CP 2, step 3 at CP 1 (plain FSDP, 2 data-parallel ranks) or at Ulysses 2: the loss and
    weights of one rank's step 3."""
    got = two_ranks[case]
    assert len(got["losses"]) == 1 and got["data_parallel_size"] == data_parallel
    assert got["losses"] == pytest.approx(one_rank["dense"]["losses"][-1:], abs=1e-5)
    for name, tensor in one_rank["dense"]["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_check_shows_the_context_parallel_layout(tmp_path):
    result = run_cli(
        "check",
        "examples/demo.yaml",
        "--nproc",
        2,
        "--json",
        *set_args({"model.context_parallel_size": 2, "model.config.num_hidden_layers": 1}),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout.strip().splitlines()[-1])
    assert plan["mesh"] == {"shape": [2], "dim_names": ["fsdp"]}  # FSDP still shards over both ranks
    assert plan["sequence_parallel"] == {"size": 1, "groups": [[0], [1]], "data_parallel_size": 1}
    assert plan["context_parallel"] == {
        "size": 2,
        "groups": [[0, 1]],
        "chunks": "rank r: chunks r and 3-r of 4 (the sequence padded to a multiple of 4)",
    }


def test_context_parallel_size_not_dividing_nproc_fails_before_spawning():
    result = run_cli("train", "examples/demo.yaml", "--nproc", 2, "--set", "model.context_parallel_size=3")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: model.context_parallel_size = 3 does not divide world size 2 / model.ulysses_size 1; valid: 1, 2; "
        "launch with --nproc 3 (or a multiple of it) for this layout"
    )


@pytest.mark.slow
def test_train_of_a_moe_at_ulysses2_cp2_ep2_matches_one_process(tmp_path):
    """`fsdp2kit train` on 4 ranks, Ulysses 2 x CP 2 x EP 2 (one data-parallel rank), the builtin Qwen3-MoE with
    its router loss at coefficient 1 (so that it counts), packed documents of 63 tokens (padded to 64 for the cut):
    each step's loss and gradient norm as the one-process reference's."""
    from test_ulysses import CONFIG, train_cli

    from fsdp2kit.config.load import load_config

    config_file = tmp_path / "moe.yaml"
    config_file.write_text(yaml.safe_dump(CONFIG))
    settings = {
        "model.name_or_path": "builtin:tiny-qwen3-moe",
        "model.config.num_hidden_layers": 2,
        "model.config.router_aux_loss_coef": 1.0,
        "data.seq_len": 63,
        "training.max_steps": 4,
        "training.gradient_accumulation_steps": 4,
    }
    # The router loss of a micro-batch is not the mean of its rows': the reference takes the same 4 micro-batches.
    reference = reference_run(load_config(config_file, as_overrides(settings)), 4).results
    layout = {"model.ulysses_size": 2, "model.context_parallel_size": 2, "strategy_args.strategy_config.ep_size": 2}
    train_cli(config_file, 4, settings | layout, tmp_path / "run")
    records = read_metrics(tmp_path / "run")
    assert len(records) == len(reference) == 4
    worst = 0.0
    for key in ("loss", "grad_norm"):
        pairs = [(record[key], getattr(expected, key)) for record, expected in zip(records, reference, strict=True)]
        worst = max(worst, *(abs(a - b) / abs(b) for a, b in pairs))
        assert worst < 1e-5, (key, pairs)
    print("max relative difference of losses and gradient norms:", worst)
