"""Expert parallelism (issue 43): `strategy_config.ep_size` splits each MoE layer's experts over the ranks of an EP
group (`efsdp_size` shards them further), and tokens travel to their experts by all-to-all. Every MoE family trains at
EP 2 on 2 ranks and EP 2 x efsdp 2 on 4 ranks with the losses, gradient norms and weights of one rank without it;
unbalanced routing (ranks that receive nothing, ragged micro-batches) neither hangs nor changes a number; checkpoints
resume at another EP size; exports load in transformers with the same log-probs; each rank holds and gathers half
the experts at EP 2, as `plan` predicts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_two_ranks, process_group, sharded_model
from moe_families_worker import micro_batches
from moe_families_worker import train as train_in_process
from test_moe_families import FAMILIES, saved_folder, stored, transformers_log_probs

from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError

STEPS = 3
QWEN3_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "head_dim": 8}
SETTINGS = {"qwen3_moe": QWEN3_MOE, **{family: FAMILIES[family][0] for family in FAMILIES}}
FP16 = {"param_dtype": "fp16", "reduce_dtype": "fp16"}  # fp32 master weights; loss scaling on


def run(folder: Path, out: Path, accumulation: int, **options: Any) -> dict[str, Any]:
    """One run of tests/moe_families_worker.py: fused experts (no per-expert groups), `options` as it reads them."""
    return {
        "folder": str(folder),
        "out": str(out),
        "experts": "",
        "per_expert": False,
        "accumulation": accumulation,
        "ulysses": 1,
        "steps": STEPS,
        "export": False,
        **options,
    }


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ep_families")
    return {family: saved_folder(root / family, family, settings) for family, settings in SETTINGS.items()}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ep_runs")


def results(planned: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {key: torch.load(spec["out"]) for key, spec in planned.items()}


@pytest.fixture(scope="module")
def one_rank(folders: dict[str, Path], out: Path) -> dict[str, dict[str, Any]]:
    """The references, in this process (a world of one, no expert parallelism): 4 micro-batches a step, as 2 ranks x 2
    and 4 ranks x 1 train; qwen3_moe's also saves a checkpoint after step 2, and trains with forced, ragged routing."""
    planned = {family: run(folder, out / f"{family}-1.pt", 4) for family, folder in folders.items()}
    planned["qwen3_moe"].update(save_at=2, checkpoint=str(out / "ckpt-ep1"))
    planned["forced"] = run(folders["qwen3_moe"], out / "forced-1.pt", 4, forced=True, ragged=True)
    planned["packed"] = run(folders["qwen3_moe"], out / "packed-1.pt", 4, packed=True)
    planned["fp16"] = run(folders["qwen3_moe"], out / "fp16-1.pt", 4, strategy=FP16)
    try:
        for spec in planned.values():
            train_in_process(spec)
    finally:
        shutdown()
    return results(planned)


@pytest.fixture(scope="module")
def two_ranks(folders: dict[str, Path], out: Path, one_rank: dict) -> dict[str, dict[str, Any]]:
    """One 2-rank launch: every family at EP 2 (exported), the forced routing, EP over a Ulysses pair, the eager
    experts loop, and the resumes from EP 1 to EP 2 and from EP 2 to none."""
    planned = {
        family: run(folder, out / f"{family}-ep2.pt", 2, ep=2, export=True) for family, folder in folders.items()
    }
    qwen3 = folders["qwen3_moe"]
    planned["qwen3_moe"].update(save_at=2, checkpoint=str(out / "ckpt-ep2"))
    planned["forced"] = run(qwen3, out / "forced-ep2.pt", 2, ep=2, forced=True, ragged=True)
    planned["no ep"] = run(qwen3, out / "noep-2.pt", 2)
    planned["ulysses"] = run(qwen3, out / "ulysses-ep2.pt", 4, ep=2, ulysses=2)
    planned["ulysses packed"] = run(qwen3, out / "ulysses-packed-ep2.pt", 4, ep=2, ulysses=2, packed=True)
    planned["no shard"] = run(qwen3, out / "noshard-ep2.pt", 2, ep=2, strategy={"sharding_strategy": "NO_SHARD"})
    planned["zero2"] = run(
        qwen3, out / "zero2-ep2.pt", 2, ep=2, strategy={"reshard_after_forward": False, "sync_each_batch": True}
    )
    planned["eager"] = run(qwen3, out / "eager-ep2.pt", 2, ep=2, grouped_mm=False)
    planned["fp16"] = run(qwen3, out / "fp16-ep2.pt", 2, ep=2, strategy=FP16)
    planned["1->2"] = run(qwen3, out / "resume-1-2.pt", 2, ep=2, resume=str(out / "ckpt-ep1"))
    planned["2->1"] = run(qwen3, out / "resume-2-1.pt", 2, ep=1, resume=str(out / "ckpt-ep2"))
    spec = out / "two_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec)
    return results(planned)


@pytest.fixture(scope="module")
def four_ranks(folders: dict[str, Path], out: Path, two_ranks: dict) -> dict[str, dict[str, Any]]:
    """One 4-rank launch: every family at EP 2 x efsdp 2, EP 2 replicated over 2 (the mesh [eddp, efsdp, ep] beside
    HSDP for the dense parts), the forced routing (with the eager loop, which uses no
    weight of an expert without tokens), and the resume from EP 2 on 2 ranks to EP 2 x efsdp 2."""
    planned = {family: run(folder, out / f"{family}-ep2x2.pt", 1, ep=2, efsdp=2) for family, folder in folders.items()}
    planned["forced"] = run(
        folders["qwen3_moe"], out / "forced-ep2x2.pt", 1, ep=2, efsdp=2, forced=True, ragged=True, grouped_mm=False
    )
    planned["eddp"] = run(folders["qwen3_moe"], out / "eddp-ep2.pt", 1, ep=2, strategy={"fsdp_size": 2})
    planned["2->4"] = run(folders["qwen3_moe"], out / "resume-2-4.pt", 1, ep=2, efsdp=2, resume=str(out / "ckpt-ep2"))
    spec = out / "four_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec, ranks=4)
    return results(planned)


def assert_same_training(got: dict[str, Any], expected: dict[str, Any], atol: float = 1e-5) -> None:
    """Losses and weights within `atol`; gradient norms within 1e-6 of their size (the sums of 4 micro-batches'
    gradients come in another order at another world size)."""
    assert got["losses"] == pytest.approx(expected["losses"][-len(got["losses"]) :], abs=atol)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"][-len(got["grad_norms"]) :], rel=1e-6)
    assert sorted(got["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=atol, rtol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("family", SETTINGS)
def test_ep2_on_two_ranks_trains_like_one_rank(family, one_rank, two_ranks):
    assert len(two_ranks[family]["losses"]) == STEPS
    assert_same_training(two_ranks[family], one_rank[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", SETTINGS)
def test_ep2_by_efsdp2_on_four_ranks_trains_like_one_rank(family, one_rank, four_ranks):
    assert_same_training(four_ranks[family], one_rank[family])


@pytest.mark.slow
@pytest.mark.parametrize("family", SETTINGS)
def test_an_ep_export_is_save_pretrained_layout_with_transformers_log_probs(family, folders, out, two_ranks):
    export = out / f"{family}-ep2.pt.hf"
    written, saved = stored(export), stored(folders[family])
    assert sorted(written) == sorted(saved)  # the per-expert names save_pretrained writes, not the ranks' slices
    assert all(written[key].shape == saved[key].shape for key in saved)
    probe = micro_batches(-1, 1)[0]
    real = probe["attention_mask"][:, 1:].bool()
    torch.testing.assert_close(
        two_ranks[family]["log_probs"][real], transformers_log_probs(export, probe)[real], atol=1e-5, rtol=0
    )


@pytest.mark.slow
def test_ep_changes_no_gradient_norm_at_the_same_world_size(one_rank, two_ranks):
    """At 2 ranks the EP run's gradient norms are those of the run without EP, and both one rank's (to 1e-6; they
    differed by 1e-5 while the norm was torch's CPU kernel's, which accumulates a whole shard in fp32)."""
    ep, plain, one = two_ranks["qwen3_moe"], two_ranks["no ep"], one_rank["qwen3_moe"]
    assert ep["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-6)
    assert plain["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-6)


@pytest.mark.slow
def test_ranks_that_receive_no_token_and_ragged_batches_train_like_one_rank(one_rank, two_ranks, four_ranks):
    """Every token goes to experts 0 and 1, both on EP rank 0: EP rank 1's experts receive nothing in every layer,
    yet join their gradient reduction over efsdp (4 ranks) with zero gradients; every other micro-batch is shorter, so
    the ranks send different counts."""
    assert_same_training(two_ranks["forced"], one_rank["forced"])
    assert_same_training(four_ranks["forced"], one_rank["forced"])


@pytest.mark.slow
def test_ep_over_a_ulysses_pair_trains_like_one_rank(one_rank, two_ranks):
    """The 2 ranks of a Ulysses pair hold halves of the same sequences and split the experts: 4 micro-batches a
    step, as the reference."""
    assert_same_training(two_ranks["ulysses"], one_rank["qwen3_moe"])


@pytest.mark.slow
@pytest.mark.parametrize("dense", ["no shard", "zero2"])
def test_ep_beside_other_dense_strategies_trains_like_one_rank(dense, one_rank, two_ranks):
    """The dense parts replicated (NO_SHARD: their replicas' all-reduce, the experts' own groups beside it), or kept
    gathered (ZeRO-2) with a reduction after every micro-batch."""
    assert_same_training(two_ranks[dense], one_rank["qwen3_moe"])


@pytest.mark.slow
def test_ep_replicated_over_eddp_beside_hsdp_trains_like_one_rank(one_rank, four_ranks):
    """4 ranks, EP 2 x efsdp 1: the experts' mesh [eddp 2, efsdp 1, ep 2] (each expert on 2 ranks, all-reduced), the
    dense parts HSDP [ddp 2, fsdp 2]."""
    assert_same_training(four_ranks["eddp"], one_rank["qwen3_moe"])


@pytest.mark.slow
def test_packed_documents_over_a_ulysses_pair_keep_the_router_loss_of_one_rank(one_rank, two_ranks):
    """Two documents a row: Ulysses attends through their whole-sequence mask, which the model never gets as its
    `attention_mask` (transformers' load-balancing loss would read it as a [B, T] padding mask and fail)."""
    assert_same_training(two_ranks["ulysses packed"], one_rank["packed"])


@pytest.mark.slow
def test_the_eager_experts_loop_trains_like_grouped_mm(one_rank, two_ranks):
    """moe_use_grouped_mm: false runs transformers' eager per-expert loop on each rank's experts; the reference runs
    transformers' default, grouped_mm."""
    assert_same_training(two_ranks["eager"], one_rank["qwen3_moe"])


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["1->2", "2->1"])
def test_a_checkpoint_resumes_at_another_ep_size(resume, one_rank, two_ranks):
    """EP 1 (one rank) -> EP 2, and EP 2 -> no EP (2 ranks): step 3 as the uninterrupted run's."""
    resumed = two_ranks[resume]
    assert len(resumed["losses"]) == 1
    assert_same_training(resumed, one_rank["qwen3_moe"], atol=1e-6)


@pytest.mark.slow
def test_an_ep2_checkpoint_resumes_at_ep2_by_efsdp2_on_four_ranks(one_rank, four_ranks):
    assert_same_training(four_ranks["2->4"], one_rank["qwen3_moe"], atol=1e-6)


# ---------------------------------------------------------------- in this process: memory, check, refusals

MOE = ["model.name_or_path=builtin:tiny-qwen3-moe"]  # 4 experts a layer


def expert_elements(ep_size: int, world_size: int) -> tuple[int, int]:
    """(held, gathered) elements of layer 0's experts on rank 0 of `world_size` ranks: the shards it keeps, and
    what FSDP all-gathers for their forward (their own group under EP, else the decoder layer's)."""
    from fsdp2kit.config import load_config
    from fsdp2kit.parallel.fsdp import fsdp_states

    cfg = load_config("examples/demo.yaml", [*MOE, f"strategy_args.strategy_config.ep_size={ep_size}"])
    with process_group(world_size, 0) as runtime:
        model = sharded_model(cfg, runtime, training=True, materialize=False).model
        experts = {id(p) for p in model.model.layers[0].mlp.experts.parameters()}
        held = sum(p.to_local().numel() for p in model.model.layers[0].mlp.experts.parameters())
        gathered = sum(
            fsdp_param._orig_size.numel()
            for state in fsdp_states(model)
            if state._fsdp_param_group is not None
            for fsdp_param in state._fsdp_param_group.fsdp_params
            if id(fsdp_param.sharded_param) in experts
        )
    return held, gathered


def test_at_ep2_a_rank_holds_and_gathers_half_the_experts():
    """EP 2 on 2 ranks: each rank keeps 2 of the 4 experts whole and gathers nothing more, where FSDP alone (2
    ranks) keeps half of every expert but gathers all 4 for each forward, and one rank holds all 4."""
    one_rank = expert_elements(1, 1)
    fsdp_held, fsdp_gathered = expert_elements(1, 2)
    ep_held, ep_gathered = expert_elements(2, 2)
    assert ep_held * 2 == one_rank[0] == fsdp_gathered
    assert ep_gathered * 2 == fsdp_gathered
    assert fsdp_held == ep_held  # stored shards are halved either way: EP halves what is gathered and computed


def test_each_rank_reads_only_its_experts_rows():
    """Rank 1 of EP 2 (x efsdp 2 on 4 ranks: its half of them) loads rows of experts 2 and 3 only: the slice the
    sliced loader reads from the files (`test_moe_families.py`: a slice reads only those experts' tensors)."""
    from fsdp2kit.config import load_config
    from fsdp2kit.models.shards import local_index

    for ranks, efsdp, rows in ((2, 1, slice(2, 4)), (4, 2, slice(2, 3))):
        sets = [*MOE, "strategy_args.strategy_config.ep_size=2", f"strategy_args.strategy_config.efsdp_size={efsdp}"]
        with process_group(ranks, 1) as runtime:
            model = sharded_model(load_config("examples/demo.yaml", sets), runtime, training=False, materialize=False)
            experts = model.model.model.layers[0].mlp.experts
            assert local_index(experts.gate_up_proj)[0] == rows, (ranks, efsdp)
            assert local_index(experts.down_proj)[0] == rows


def test_check_names_the_expert_mesh_and_each_ranks_experts():
    """`check`'s plan (rank 0 of 4, in this process) at EP 2 x efsdp 2."""
    from fsdp2kit.check import describe
    from fsdp2kit.config import load_config

    sets = [*MOE, "strategy_args.strategy_config.ep_size=2", "strategy_args.strategy_config.efsdp_size=2"]
    with process_group(4, 0) as runtime:
        plan = describe(load_config("examples/demo.yaml", sets), runtime)
    described = plan["expert_parallel"]
    assert described["mesh"] == {"shape": [2, 2], "dim_names": ["efsdp", "ep"]}
    assert described["modules"] == [f"model.layers.{i}.mlp.experts" for i in range(4)]
    assert described["experts_by_rank"] == {"4 experts": [[0, 1], [2, 3], [0, 1], [2, 3]]}
    experts_group = next(g for g in plan["groups"] if g["modules"] == ["model.layers.0.mlp.experts"])
    assert experts_group["gradient_reduce"] == "reduce-scatter over 2 ranks"  # over efsdp only


@pytest.mark.parametrize(
    "sets, ranks, message",
    [
        (
            [*MOE, "strategy_args.strategy_config.ep_size=3"],
            3,
            "strategy_config.ep_size = 3 does not divide the 4 experts of each layer; valid ep_size with efsdp_size 1 "
            "at world size 3: 1",
        ),
        (
            [*MOE, "strategy_args.strategy_config.ep_size=2", "strategy_args.strategy_config.efsdp_size=2"],
            2,
            "strategy_config.ep_size = 2 x efsdp_size = 2 does not divide the world size 2; valid ep_size with "
            "efsdp_size 2 and the 4 experts of each layer: 1",
        ),
        (
            ["strategy_args.strategy_config.ep_size=2"],
            2,
            "strategy_config.ep_size = 2: the model has no mixture-of-experts layers to split; valid: 1",
        ),
        (
            [
                *MOE,
                "strategy_args.strategy_config.ep_size=2",
                "strategy_args.strategy_config.wrap_policy.moe_experts=[Qwen3MoeMLP]",
            ],
            2,
            "does not hold its experts as fused tensors",
        ),
        (
            [*MOE, "strategy_args.strategy_config.ep_size=2", "model.lora.r=4", "model.lora.target_modules=[q_proj]"],
            2,
            "strategy_config.ep_size = 2: LoRA (model.lora) with expert parallelism is not supported; set ep_size: 1",
        ),
    ],
)
def test_what_expert_parallelism_cannot_split_is_one_line(sets, ranks, message):
    """Each refused as the plan is built (`check`, and every rank of a run), in this process as rank 0 of `ranks`."""
    from fsdp2kit.config import load_config
    from fsdp2kit.errors import UserError

    cfg = load_config("examples/demo.yaml", sets)
    with process_group(ranks, 0) as runtime, pytest.raises(UserError) as refused:
        sharded_model(cfg, runtime, training=True, materialize=False)
    assert message in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("ep_size", [3, 4, 6])
def test_an_ep_size_refusal_offers_only_sizes_valid_for_both_the_world_and_the_experts(ep_size, run_main):
    """6 experts a layer at 4 ranks: ep_size must divide both, so 2 is the only split; every refusal (the launcher's
    check before any rank starts, and each rank's) offers 1 or 2 and nothing that the other rule refuses (3 and 6
    were offered for the experts, then refused for the world, whose refusal offered 4). ep_size 2 builds."""
    from fsdp2kit.config import load_config

    six = [*MOE, "model.config.num_experts=6", "model.config.num_hidden_layers=2"]
    sets = [*six, f"strategy_args.strategy_config.ep_size={ep_size}"]
    if ep_size == 4:
        said = "strategy_config.ep_size = 4 does not divide the 6 experts of each layer; valid ep_size with "
        said += "efsdp_size 1 at world size 4: 1, 2"
    else:
        said = f"strategy_config.ep_size = {ep_size} x efsdp_size = 1 does not divide the world size 4; valid "
        said += "ep_size with efsdp_size 1 and the 6 experts of each layer: 1, 2"
    result = run_main("check", "examples/demo.yaml", "--nproc", 4, *[a for s in sets for a in ("--set", s)])
    assert (result.returncode, result.stderr) == (2, f"error: {said}\n")
    with process_group(4, 0) as runtime, pytest.raises(UserError) as refused:
        sharded_model(load_config("examples/demo.yaml", sets), runtime, training=True, materialize=False)
    assert str(refused.value) == said
    with process_group(4, 0) as runtime:
        built = sharded_model(
            load_config("examples/demo.yaml", [*six, "strategy_args.strategy_config.ep_size=2"]),
            runtime,
            training=True,
            materialize=False,
        )
    assert built.layout.ep_size == 2


def test_a_refusal_is_one_line_and_exit_2_from_the_command_line(run_main):
    """The mesh is checked before any rank starts."""
    sets = [*MOE, "strategy_args.strategy_config.ep_size=3"]
    result = run_main("check", "examples/demo.yaml", "--nproc", 2, *[a for s in sets for a in ("--set", s)])
    assert result.returncode == 2
    assert "ep_size = 3 x efsdp_size = 1 does not divide the world size 2" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.slow
def test_fp16_loss_scaling_unscales_the_experts_gradients_on_their_own_mesh(one_rank, two_ranks):
    """fp16 compute and reduction: the loss scaler divides every gradient by its scale, the experts' (on the EP
    mesh) as the dense ones (on the FSDP mesh), and the run follows one rank's fp16 run within fp16's rounding."""
    got, expected = two_ranks["fp16"], one_rank["fp16"]
    assert got["loss_scale"] == expected["loss_scale"] == 2.0**16  # scaled, and no step overflowed
    assert got["losses"] != pytest.approx(two_ranks["qwen3_moe"]["losses"], rel=1e-6)  # fp16 compute: not fp32's
    assert got["losses"] == pytest.approx(expected["losses"], rel=2e-3)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"], rel=2e-2)
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=2e-3, rtol=0, msg=name)
