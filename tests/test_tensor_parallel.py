"""Tensor parallelism: `model.tensor_parallel_size: t` splits each decoder layer by the family's transformers TP plan
over t consecutive ranks, the embedding and the LM head by vocabulary, and computes log-probs and the loss on the
head's vocabulary shards; FSDP shards over the other ranks. Trained that way (fp32) at TP 2, TP 2 x FSDP 2 and TP 2 x
CP 2, with LoRA and with a caller's loss, a Llama, a Qwen3 (tied embeddings, per-head norms) and a Qwen3-MoE follow
one rank without it: the same losses, gradient norms and weights after 3 steps, the same log-probs of left-padded
rows; a checkpoint saved at TP 2 x FSDP 2 resumes at FSDP 4 and at FSDP 2 (TP 1) to the uninterrupted run's loss;
the export loads in transformers with the same log-probs. The runs are tests/moe_families_worker.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import launch_two_ranks
from moe_families_worker import left_padded_probe
from moe_families_worker import train as train_in_process
from test_expert_parallel import QWEN3_MOE, results
from test_expert_parallel import run as expert_run
from test_moe_families import saved_folder, stored, transformers_log_probs

from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.mesh import mesh_layout

LORA = {"lora": {"rank": 4, "target_modules": "all-linear", "init_lora_weights": False}}
# A user's own plan (model.tensor_parallel_plan, MindSpeed-MM's tp_plan): the MLP split, attention left whole.
MLP_ONLY = {
    "tensor_parallel_plan": {
        "model.layers.{*}.mlp.gate_proj": "colwise",
        "model.layers.{*}.mlp.up_proj": "colwise",
        "model.layers.{*}.mlp.down_proj": "rowwise",
    }
}
NO_SHARD = {"sharding_strategy": "NO_SHARD"}  # the mesh [ddp 2, fsdp 1, tp 2]: replicas of the tp pairs
RECOMPUTE = {"gradient_checkpointing": True}
BF16 = {"param_dtype": "bf16"}  # fp32 master weights, bf16 compute: the split layers' sums round otherwise
MUON = {"optimizer": "muon"}  # each matrix orthogonalised whole: the split ones gathered on every rank
# Newton-Schulz starts from the update rounded to bf16, where the last fp32 bits of a gradient summed in another order
# flip a rounding now and then (tests/test_muon.py: 2e-5 after 3 steps at lr 1e-4 under FSDP alone); at these runs'
# lr 1e-3 the weights differ by up to 2.1e-5 (measured at TP 2), the log-probs after them by up to 5e-5, while the
# losses agree to 1e-5.
MUON_WEIGHTS_ATOL = 5e-5
FAMILIES = {"llama": {}, "qwen3": {"head_dim": 8, "tie_word_embeddings": True}, "qwen3_moe": QWEN3_MOE}


# Unit level: the layout and the refusals.


def test_tp_is_the_innermost_dimension_and_shares_the_batch():
    """8 ranks, TP 2 x CP 2 x FSDP: tp pairs are consecutive ranks with one micro-batch; the sequence groups stride
    over them; FSDP's mesh is the other dimension."""
    layout = mesh_layout(8, StrategyConfig(), context_parallel_size=2, tp_size=2)
    assert (layout.shape, layout.dim_names, layout.dense_dims) == ((4, 2), ("fsdp", "tp"), ("fsdp",))
    assert (layout.data_parallel_size, [layout.data_parallel_rank(r) for r in range(8)]) == (2, [0] * 4 + [1] * 4)
    assert layout.sequence_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.data_parallel_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.tensor_parallel_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert layout.parallel_dims() == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "sp": 1, "tp": 2}
    hsdp = mesh_layout(8, StrategyConfig(fsdp_size=2), tp_size=2)
    assert (hsdp.shape, hsdp.dim_names) == ((2, 2, 2), ("ddp", "fsdp", "tp"))
    assert hsdp.parallel_dims() == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "sp": 1, "tp": 2}


def test_a_tp_size_that_does_not_divide_the_world_is_refused():
    with pytest.raises(UserError, match=r"model.tensor_parallel_size = 3 does not divide the world size 4; valid: "):
        mesh_layout(4, StrategyConfig(), tp_size=3)
    with pytest.raises(UserError, match=r"tensor_parallel_size = 2 with strategy_config.ep_size = 2"):
        mesh_layout(4, StrategyConfig(ep_size=2), tp_size=2)
    with pytest.raises(UserError, match=r"size 2; valid: 1, 2; .* \(the world size here: 4 ranks / model.tensor_para"):
        mesh_layout(4, StrategyConfig(), ulysses_size=4, tp_size=2)
    with pytest.raises(UserError, match=r"float8.enabled with model.tensor_parallel_size = 2: float8 matmuls"):
        mesh_layout(4, StrategyConfig(float8={"enabled": True}), tp_size=2)


def test_heads_must_split_and_a_family_needs_a_plan():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from fsdp2kit.parallel.tensor_parallel import split_heads_check, tp_plan

    with pytest.raises(UserError, match=r"does not divide the model's num_key_value_heads \(2\).*valid: 1, 2$"):
        split_heads_check(LlamaConfig(num_attention_heads=4, num_key_value_heads=2), 4)
    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2))
        llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(UserError, match=r"the gpt2 family has no tensor-parallel plan in transformers"):
        tp_plan(gpt2, "lm_head")
    assert tp_plan(llama, "lm_head")["model.layers.*.self_attn.o_proj"] == "rowwise"
    assert "lm_head" not in tp_plan(llama, "lm_head")  # the head is split by vocabulary, whatever the plan says


# End to end: one rank in this process, then one launch of 4 ranks and one of 2.


def run(folder: Path, out: Path, accumulation: int, **options: Any) -> dict[str, Any]:
    """One run of tests/moe_families_worker.py with the left-padded probe and mixed packed and right-padded
    micro-batches."""
    return expert_run(folder, out, accumulation, **({"left_padded": True, "packed": "mixed"} | options))


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp_models")
    return {family: saved_folder(root / family, family, settings) for family, settings in FAMILIES.items()}


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tp_runs")


@pytest.fixture(scope="module")
def one_rank(folders: dict[str, Path], out: Path) -> dict[str, dict[str, Any]]:
    """The references, in this process: 4 micro-batches a step; the Qwen3 with LoRA through a caller's loss."""
    planned = {family: run(folder, out / f"{family}-1.pt", 4) for family, folder in folders.items()}
    for family, folder in folders.items():
        planned[f"{family} lora"] = run(folder, out / f"{family}-lora-1.pt", 4, model=LORA, caller_loss=True)
    planned["muon"] = run(folders["qwen3"], out / "muon-1.pt", 4, training=MUON)
    planned["llama bf16"] = run(folders["llama"], out / "llama-bf16-1.pt", 4, strategy=BF16)
    try:
        for spec in planned.values():
            train_in_process(spec)
    finally:
        shutdown()
    return results(planned)


@pytest.fixture(scope="module")
def four_ranks(folders: dict[str, Path], out: Path, one_rank: dict) -> dict[str, dict[str, Any]]:
    """One 4-rank launch: every family at TP 2 x FSDP 2 (the Llama's saving a checkpoint after step 2), the Llama
    at TP 2 x CP 2, and the resume of that checkpoint at FSDP 4."""
    planned = {f"{name} tp2x2": run(folder, out / f"{name}-tp2x2.pt", 2, tp=2) for name, folder in folders.items()}
    planned["llama tp2x2"].update(save_at=2, checkpoint=str(out / "ckpt-tp2x2"))
    planned["qwen3 tp2x2"].update(sharded_weights=True)
    planned["llama tp2 replicated"] = run(folders["llama"], out / "llama-tp2-ddp.pt", 2, tp=2, strategy=NO_SHARD)
    planned["llama tp2x2 recompute"] = run(folders["llama"], out / "llama-tp2x2-rc.pt", 2, tp=2, model=RECOMPUTE)
    planned["llama tp2x2 bf16"] = run(folders["llama"], out / "llama-tp2x2-bf16.pt", 2, tp=2, strategy=BF16)
    planned["muon tp2x2"] = run(folders["qwen3"], out / "muon-tp2x2.pt", 2, tp=2, training=MUON)
    for family, folder in folders.items():
        planned[f"{family} tp2cp2"] = run(folder, out / f"{family}-tp2cp2.pt", 4, tp=2, cp=2)
    planned["resume fsdp4"] = run(folders["llama"], out / "resume-fsdp4.pt", 1, resume=str(out / "ckpt-tp2x2"))
    spec = out / "four_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec, ranks=4)
    return results(planned)


@pytest.fixture(scope="module")
def two_ranks(folders: dict[str, Path], out: Path, four_ranks: dict) -> dict[str, dict[str, Any]]:
    """One 2-rank launch: every family at TP 2 (the Llama's exported), the Qwen3 with LoRA through a caller's loss,
    and the resume of TP 2 x FSDP 2's checkpoint at FSDP 2."""
    planned = {f"{family} tp2": run(folder, out / f"{family}-tp2.pt", 4, tp=2) for family, folder in folders.items()}
    planned["llama tp2"].update(export=True)
    for family, folder in folders.items():
        lora_run = run(folder, out / f"{family}-lora-tp2.pt", 4, tp=2, model=LORA, caller_loss=True)
        planned[f"{family} lora tp2"] = lora_run
    planned["muon tp2"] = run(folders["qwen3"], out / "muon-tp2.pt", 4, tp=2, training=MUON)
    planned["own plan tp2"] = run(folders["llama"], out / "own-plan-tp2.pt", 4, tp=2, model=MLP_ONLY)
    planned["resume fsdp2"] = run(folders["llama"], out / "resume-fsdp2.pt", 2, resume=str(out / "ckpt-tp2x2"))
    spec = out / "two_ranks.json"
    spec.write_text(json.dumps(list(planned.values())))
    launch_two_ranks("moe_families_worker.py", spec)
    return results(planned)


def assert_same_training(got: dict[str, Any], expected: dict[str, Any], data_parallel: int) -> None:
    """Losses, gradient norms and weights after the run's steps within 1e-5 of one rank's (Muon's weights within
    `MUON_WEIGHTS_ATOL`), and the left-padded probe's log-probs at every position; the run's data-parallel degree is
    world / (tp x cp)."""
    muon = bool(got["orthogonalised"][0])
    weight_atol, log_prob_atol = (MUON_WEIGHTS_ATOL, 1e-4) if muon else (1e-5, 1e-5)
    assert got["data_parallel_size"] == data_parallel
    assert got["losses"] == pytest.approx(expected["losses"][-len(got["losses"]) :], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"][-len(got["grad_norms"]) :], rel=1e-5)
    assert sorted(got["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=weight_atol, rtol=0, msg=name)
    torch.testing.assert_close(got["left_log_probs"], expected["left_log_probs"], atol=log_prob_atol, rtol=0)
    # `evaluate` of the same batch on every data-parallel rank: one rank's loss, its tokens counted once per rank
    # that trains its own micro-batches (the ranks of a tp or sequence group share theirs)
    assert got["eval"][0] == pytest.approx(expected["eval"][0], abs=log_prob_atol)
    assert got["eval"][1] == data_parallel * expected["eval"][1]
    if muon:  # every rank orthogonalised every matrix whole (the split ones gathered), as the one rank did
        assert all(steps[-1] == expected["orthogonalised"][0][-1] for steps in got["orthogonalised"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "reference", "data_parallel"),
    [
        ("llama tp2", "llama", 1),
        ("qwen3 tp2", "qwen3", 1),
        ("qwen3_moe tp2", "qwen3_moe", 1),
        ("llama lora tp2", "llama lora", 1),
        ("qwen3 lora tp2", "qwen3 lora", 1),
        ("qwen3_moe lora tp2", "qwen3_moe lora", 1),
        ("own plan tp2", "llama", 1),
        ("muon tp2", "muon", 1),
    ],
)
def test_tp2_follows_one_rank(case, reference, data_parallel, one_rank, two_ranks):
    assert_same_training(two_ranks[case], one_rank[reference], data_parallel)
    if "lora" in case:  # what trained was the adapters
        assert all(".lora_" in name for name in two_ranks[case]["trained"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("case", "reference", "data_parallel"),
    [
        ("llama tp2x2", "llama", 2),
        ("qwen3 tp2x2", "qwen3", 2),
        ("qwen3_moe tp2x2", "qwen3_moe", 2),
        ("llama tp2cp2", "llama", 1),
        ("qwen3 tp2cp2", "qwen3", 1),
        ("qwen3_moe tp2cp2", "qwen3_moe", 1),
        ("muon tp2x2", "muon", 2),
        ("llama tp2 replicated", "llama", 2),
        ("llama tp2x2 recompute", "llama", 2),
    ],
)
def test_tp2_beside_fsdp_and_context_parallel_follows_one_rank(case, reference, data_parallel, one_rank, four_ranks):
    assert_same_training(four_ranks[case], one_rank[reference], data_parallel)


@pytest.mark.slow
def test_each_ranks_weight_blocks_at_tp2x2_tile_the_model(four_ranks):
    """Weight sync's blocks (`sharded_weights`: each rank's piece of each HF tensor and where it sits) from TP 2 x FSDP
    2 put together: exactly `full_weights`, every element from some rank."""
    got = four_ranks["qwen3 tp2x2"]
    assert sorted(got["sharded_weights"]) == sorted(got["weights"])
    for name, tensor in got["weights"].items():
        assert torch.equal(got["sharded_weights"][name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("case", ["resume fsdp4", "resume fsdp2"])
def test_a_tp2x2_checkpoint_resumes_without_tp(case, one_rank, four_ranks, two_ranks):
    got = {**four_ranks, **two_ranks}[case]
    assert len(got["losses"]) == 1
    assert got["losses"] == pytest.approx(one_rank["llama"]["losses"][-1:], abs=1e-5)
    for name, tensor in one_rank["llama"]["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, atol=1e-5, rtol=0, msg=name)


@pytest.mark.slow
def test_a_tp2_export_loads_in_transformers_with_the_same_log_probs(folders, out, two_ranks):
    export = out / "llama-tp2.pt.hf"
    written, saved = stored(export), stored(folders["llama"])
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in saved.items()}
    probe = left_padded_probe()
    mask = probe["attention_mask"]
    real = (mask[:, :-1] * mask[:, 1:]).bool()
    torch.testing.assert_close(
        two_ranks["llama tp2"]["left_log_probs"][real], transformers_log_probs(export, probe)[real], atol=1e-5, rtol=0
    )


# Real files as written: Accelerate's tp_hsdp.yaml (scaled to 4 ranks) and MindSpeed-MM's Qwen3.5-4B native file
# with its own `parallel.tensor_parallel_size` key set to 2.


@pytest.mark.slow
def test_accelerate_tp_hsdp_file_trains_two_steps_on_four_ranks(tmp_path):
    """Accelerate's tp_hsdp.yaml (dp_replicate 2 x dp_shard 2 x tp 2 on 8 processes) with dp_replicate 1 for the 4
    ranks here: the mesh [fsdp 2, tp 2], 2 optimizer steps of tiny-llama on the built-in corpus."""
    from conftest import REPO, run_cli

    written = yaml.safe_load((CORPUS / "accelerate/examples/torch_native_parallelism/configs/tp_hsdp.yaml").read_text())
    written["parallelism_config"]["parallelism_config_dp_replicate_size"] = 1
    written["num_processes"] = 4
    scaled = tmp_path / "tp_hsdp.yaml"
    scaled.write_text(yaml.safe_dump(written))
    settings = [*SHORT_RUN, f"training.output_dir={tmp_path / 'run'}"]
    args = [REPO / "examples/demo.yaml", "--fsdp-config", scaled, "--nproc", 4]
    result = run_cli("train", *args, *(a for s in settings for a in ("--set", s)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_two_steps(tmp_path / "run", result.stdout, "layout: mesh fsdp 2 x tp 2 (4 ranks); data-parallel 2")


@pytest.mark.slow
def test_mindspeed_native_file_with_tensor_parallel_size_2_trains_two_steps(tmp_path):
    """MindSpeed-MM's Qwen3.5-4B file (whose trainer defines tensor_parallel_size and tp_plan but refuses any size
    but 1) with `parallel.tensor_parallel_size=2`: a tiny Qwen3.5 (vision tower whole, language model split) on
    image+text conversations, 2 optimizer steps on 2 ranks."""
    import sys

    from conftest import REPO, run_cli

    sys.path.insert(0, str(REPO / "examples"))
    from make_vl_dataset import main as make_dataset

    make_dataset(tmp_path, 8, 0)
    settings = [
        "parallel.tensor_parallel_size=2",
        "model.name_or_path=builtin:tiny-qwen3.5",
        f"data.source={tmp_path / 'llamafactory.json'}",
        *SHORT_RUN,
        f"training.output_dir={tmp_path / 'run'}",
    ]
    name = CORPUS / "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"
    result = run_cli("train", name, "--nproc", 2, *(a for s in settings for a in ("--set", s)), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_two_steps(tmp_path / "run", result.stdout, "layout: mesh fsdp 1 x tp 2 (2 ranks); data-parallel 1")


CORPUS = Path(__file__).parent / "fixtures/real_configs"
SHORT_RUN = ["data.seq_len=128", "training.max_steps=2", "training.export_hf=false", "training.report_to=[]"]


def assert_two_steps(run_dir: Path, printed: str, layout: str) -> None:
    """Two steps with a loss and a gradient, under the layout the run printed at its start."""
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2]
    assert all(s["loss"] > 0 and s["grad_norm"] > 0 for s in steps)
    assert layout in printed, printed[-2000:]


def test_mindspeed_tp_plan_is_the_users_plan_and_sequence_parallel_is_refused():
    from fsdp2kit.config import load_config

    name = str(CORPUS / "mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml")
    columns, rows = "model.language_model.layers.{*}.mlp.up_proj", "model.language_model.layers.{*}.mlp.down_proj"
    swaps = ["parallel.tensor_parallel_size=2", f'parallel.tp_plan.colwise_parallel=["{columns}"]']
    cfg = load_config(name, [*swaps, f'parallel.tp_plan.rowwise_parallel=["{rows}"]'])
    assert cfg.model.tensor_parallel_size == 2
    assert cfg.model.tensor_parallel_plan == {columns: "colwise", rows: "rowwise"}
    with pytest.raises(UserError, match=r"'parallel.tp_plan.sequence_parallel' is not supported: fsdp2kit keeps"):
        load_config(name, [*swaps, "parallel.tp_plan.sequence_parallel=[model.norm]"])


def test_the_vocabulary_split_head_equals_the_whole_head(tmp_path):
    """tests/vocab_parallel_worker.py on 2 ranks: log-probs with entropies at per-token temperatures, and the summed
    loss, through a soft-capped, scaled head of an odd vocabulary in chunks: values and gradients equal the whole
    head's."""
    launch_two_ranks("vocab_parallel_worker.py", tmp_path / "differences.pt")
    differences = torch.load(tmp_path / "differences.pt")
    assert set(differences) == {
        *(f"{key}{tail}" for key in ("out", "hidden_grad", "weight_grad", "bias_grad") for tail in ("", " summed")),
        "entropies",
    }
    assert max(differences.values()) < 1e-5, differences


@pytest.mark.slow
def test_infer_at_tp2_scores_each_sample_once_as_fsdp_does(folders, tmp_path):
    """`fsdp2kit infer` of a saved Llama on 2 ranks, FSDP 2 and TP 2: the same samples once each, the same sums."""
    from conftest import REPO, run_cli

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " + "words " * (i % 5)}) + "\n" for i in range(9)))
    scored = {}
    for tp in (1, 2):
        out = tmp_path / f"tp{tp}"
        settings = [f"model.name_or_path={folders['llama']}", f"data.source={data}", "data.seq_len=32"]
        settings += [f"training.output_dir={out}"]
        settings += [f"model.tensor_parallel_size={tp}", "training.report_to=[]"]
        args = (a for setting in settings for a in ("--set", setting))
        result = run_cli("infer", REPO / "examples/demo.yaml", "--nproc", 2, *args, timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [json.loads(line) for line in (out / "infer.jsonl").read_text().splitlines()]
        scored[tp] = [line for line in lines if not line.get("summary")]
    assert [r["index"] for r in scored[2]] == list(range(9))
    for fsdp, split in zip(scored[1], scored[2], strict=True):
        assert (split["num_tokens"], split["truncated"]) == (fsdp["num_tokens"], fsdp["truncated"])
        assert split["sum_logprob"] == pytest.approx(fsdp["sum_logprob"], abs=1e-4)


@pytest.mark.slow
def test_tp2x2_in_bf16_follows_one_rank_in_bf16(one_rank, four_ranks):
    """bf16 compute, fp32 master weights: a row-split layer sums its ranks' partial products in bf16 where one rank
    sums inside its matmul, so the runs agree to bf16's rounding, not to fp32's."""
    got, expected = four_ranks["llama tp2x2 bf16"], one_rank["llama bf16"]
    assert got["losses"] == pytest.approx(expected["losses"], abs=2e-3)  # measured: 2.1e-4
    assert got["losses"] != pytest.approx(one_rank["llama"]["losses"], abs=1e-6)  # bf16 did compute


def test_a_value_model_under_tensor_parallelism_is_refused_in_one_line(run_main):
    """A critic (a scalar head, no LM head to split by vocabulary) at TP 2: one line naming the key, exit 2."""
    critic = ["model.model_class=transformers:LlamaForTokenClassification", "model.config.num_labels=1"]
    sets = (a for s in ["model.tensor_parallel_size=2", *critic] for a in ("--set", s))
    code, _, err = run_main("check", "examples/demo.yaml", "--nproc", 2, *sets)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: model.tensor_parallel_size = 2: tensor parallelism serves causal LMs"), err
