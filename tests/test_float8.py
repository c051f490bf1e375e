"""strategy_config.float8: torchao's float8 matmuls on the tiny Llama (dimensions multiples of 16), on the CPU
(torch._scaled_mm runs float8 there): losses against bf16, float8 all-gather on and off, 2 ranks against 1, resume,
the HF export, `check`'s list, LoRA over a float8 base and the refusals."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
import yaml
from conftest import as_overrides, process_group, read_metrics, run_cli, set_args, sharded_model, token_batch

from fsdp2kit.config.load import load_config
from fsdp2kit.distributed import shutdown
from fsdp2kit.memory_plan import computed_sizes

pytest.importorskip("torchao.float8")

DEMO = "examples/demo.yaml"
F8 = "strategy_args.strategy_config.float8"
RUN = {
    "model.config.num_hidden_layers": 2,
    "data.seq_len": 64,
    "training.max_steps": 20,
    "training.lr_scheduler_type": "constant",
    "training.export_hf": False,
    "strategy_args.strategy_config.param_dtype": "bf16",
    "strategy_args.strategy_config.async_save_ckpt": False,
}


def losses(run) -> list[float]:
    return [record["loss"] for record in read_metrics(run)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """bf16 and float8 (all-gather on, an HF export) at 1 rank, in one subprocess each: the references."""
    runs = tmp_path_factory.mktemp("one_rank")
    for name, extra in {"bf16": {}, "float8": {f"{F8}.enabled": True, "training.export_hf": True}}.items():
        settings = {**RUN, **extra, "training.output_dir": str(runs / name)}
        result = run_cli("train", DEMO, *set_args(settings))
        assert result.returncode == 0, result.stderr
        (runs / f"{name}.stderr").write_text(result.stderr)
    return runs


def test_installed_torchao_adds_no_warnings_to_a_run(one_rank):
    """transformers imports torchao wherever it is installed: its CUDA libraries' load failures on a CPU build and
    torch's notice about its enum registrations would otherwise open every run's output."""
    for name in ("bf16", "float8"):
        said = (one_rank / f"{name}.stderr").read_text()
        assert "Failed to load" not in said and "Enum subclass" not in said, said


def test_float8_follows_the_bf16_loss_curve(one_rank):
    bf16, float8 = losses(one_rank / "bf16"), losses(one_rank / "float8")
    assert len(bf16) == len(float8) == 20
    assert float8 != bf16  # the matmuls did run in float8
    for step, (got, expected) in enumerate(zip(float8, bf16, strict=True), start=1):
        assert got == pytest.approx(expected, rel=0.02), step
    assert float8[-1] == pytest.approx(bf16[-1], rel=0.01)


def test_the_float8_export_is_a_normal_hf_folder_in_the_models_dtype(one_rank):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = one_rank / "float8" / "hf"
    stored = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    assert {t.dtype for t in stored.values()} == {torch.float32}  # model.dtype fp32: no float8 tensor, no scale
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert set(model.state_dict()) == set(stored)
    q_proj = model.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(q_proj, stored["model.layers.0.self_attn.q_proj.weight"].bfloat16())
    logits = model(torch.tensor([[5, 6, 7, 8]])).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.slow
def test_two_ranks_with_and_without_float8_all_gather_equal_one_rank(tmp_path):
    """The float8 all-gather casts each shard with the scale of the whole weight (one all-reduce of the amaxes after
    the step), so it gathers the float8 weight that a cast of the gathered weight makes. Computed in the master dtype
    (fp32): with param_dtype bf16 the gather without float8 rounds to bf16 before the float8 cast (docs/training.md).
    2 ranks sum gradients in another order than 1: a last-bit difference in a weight moves it across a float8 rounding
    boundary now and then, so after the first steps the curves part by float8's error, not by rounding's (measured:
    1e-5 through step 6, 0.3% by step 20)."""
    runs = {}
    for nproc, gather in ((2, True), (2, False), (1, True)):
        run = tmp_path / f"{nproc}_{gather}"
        settings = {**RUN, f"{F8}.enabled": True, f"{F8}.fsdp_float8_all_gather": gather, "training.max_steps": 10}
        settings["strategy_args.strategy_config.param_dtype"] = None
        settings["training.gradient_accumulation_steps"] = 2 * 2 // nproc  # the same global batches
        settings["training.output_dir"] = str(run)
        result = run_cli("train", DEMO, "--nproc", str(nproc), *set_args(settings))
        assert result.returncode == 0, result.stderr
        runs[nproc, gather] = losses(run)
    assert runs[2, True] == pytest.approx(runs[2, False], rel=1e-6, abs=1e-6)
    assert runs[2, True][:6] == pytest.approx(runs[1, True][:6], rel=1e-5)
    assert runs[2, True] == pytest.approx(runs[1, True], rel=0.01)


def test_resume_from_a_float8_checkpoint_continues_the_same_curve(tmp_path, run_main):
    settings = {**RUN, f"{F8}.enabled": True, "training.max_steps": 6, "training.save_steps": 3}

    def train(run):
        result = run_main("train", DEMO, *set_args({**settings, "training.output_dir": str(run)}))
        assert result.returncode == 0, result.stderr
        return result

    train(tmp_path / "straight")
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_6")
    assert "resumed from" in train(tmp_path / "resumed").stdout
    assert losses(tmp_path / "resumed") == pytest.approx(losses(tmp_path / "straight"), rel=1e-6, abs=1e-6)


def test_check_lists_the_float8_linears(run_main):
    """The LM head and linears whose dimensions are not multiples of 16 (intermediate_size 200) stay as they were,
    and so do a user's exclude_modules."""
    settings = {
        **RUN,
        f"{F8}.enabled": True,
        f"{F8}.exclude_modules": ["model.layers.1.self_attn.o_proj"],
        "model.config.intermediate_size": 200,
    }
    result = run_main("check", DEMO, "--json", *set_args(settings))
    assert result.returncode == 0, result.stderr
    float8 = json.loads(result.stdout)["float8"]
    attention = [f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"]
    assert float8["modules"] == [name for name in attention if name != "model.layers.1.self_attn.o_proj"]
    mlp = [f"model.layers.{{}}.mlp.{p}_proj" for p in ("gate", "up", "down")]  # 200 is no multiple of 16
    kept = [*(n.format(0) for n in mlp), "model.layers.1.self_attn.o_proj", *(n.format(1) for n in mlp), "lm_head"]
    assert float8["high_precision_linears"] == kept
    assert float8["fsdp_float8_all_gather"] is True
    result = run_main("check", DEMO, "--json", *set_args(RUN))
    assert json.loads(result.stdout)["float8"] is None


# LoRA over every linear at rank 16 (its A and B have dimensions multiples of 16: only the adapters' own mark keeps
# them out of float8), a module to save beside them.
LORA = {"model.lora": {"rank": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj"]}}
LORA_SAVED = {"model.lora": {**LORA["model.lora"], "modules_to_save": ["down_proj"]}}


def test_check_lists_only_the_frozen_base_linears_with_lora(run_main):
    """With LoRA, float8 converts each adapted linear's frozen `base_layer` (and the linears no adapter wraps); lora_A,
    lora_B and the modules to save (their trained copy and its frozen original) stay in high precision."""
    result = run_main("check", DEMO, "--json", *set_args({**RUN, **LORA_SAVED, f"{F8}.enabled": True}))
    assert result.returncode == 0, result.stderr
    float8 = json.loads(result.stdout)["float8"]
    adapted = [*(f"self_attn.{p}_proj" for p in "qkvo"), "mlp.gate_proj", "mlp.up_proj"]
    assert float8["modules"] == [f"model.layers.{i}.{name}.base_layer" for i in (0, 1) for name in adapted]
    kept = [
        *(f"{name}.lora_{ab}.default" for name in adapted for ab in "AB"),
        *(f"mlp.down_proj.{copy}" for copy in ("original_module", "modules_to_save.default")),
    ]
    assert float8["high_precision_linears"] == [f"model.layers.{i}.{name}" for i in (0, 1) for name in kept] + [
        "lm_head"
    ]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """LoRA over a bf16-computed base and LoRA over a float8 base, 10 steps at 1 rank, their adapters exported."""
    runs = tmp_path_factory.mktemp("lora")
    for name, extra in {"lora": {}, "float8": {f"{F8}.enabled": True}}.items():
        settings = {**RUN, **LORA, **extra, "training.max_steps": 10, "training.save_steps": 10}
        settings.update({"training.export_hf": True, "training.output_dir": str(runs / name)})
        result = run_cli("train", DEMO, *set_args(settings))
        assert result.returncode == 0, result.stderr
    return runs


def test_lora_over_a_float8_base_follows_lora_alone(lora_runs):
    lora, float8 = losses(lora_runs / "lora"), losses(lora_runs / "float8")
    assert len(lora) == len(float8) == 10
    assert float8 != lora  # the base's matmuls did run in float8
    for step, (got, expected) in enumerate(zip(float8, lora, strict=True), start=1):
        assert got == pytest.approx(expected, rel=0.02), step
    assert float8[-1] == pytest.approx(lora[-1], rel=0.01)


def test_lora_over_float8_saves_and_exports_what_lora_alone_does(lora_runs):
    """The checkpoint holds the same adapter tensors (and optimizer states) as without float8, in the same dtypes, and
    the exported adapter folder is the same PEFT folder."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    def saved(run):
        metadata = FileSystemReader(str(run / "checkpoints" / "step_10")).read_metadata().state_dict_metadata
        return {key: getattr(meta, "properties", None) for key, meta in metadata.items()}

    def exported(run):
        tensors = load_file(run / "adapter" / "adapter_model.safetensors")
        config = json.loads((run / "adapter" / "adapter_config.json").read_text())
        config["target_modules"] = sorted(config["target_modules"])  # a set in peft: written in hash order
        return {key: (t.dtype, t.shape) for key, t in tensors.items()}, config

    assert saved(lora_runs / "float8") == saved(lora_runs / "lora")
    (tensors, config), (expected, expected_config) = exported(lora_runs / "float8"), exported(lora_runs / "lora")
    assert tensors == expected and {dtype for dtype, _ in tensors.values()} == {torch.float32}
    assert not any("base_layer" in key for key in tensors)
    assert config == expected_config


def test_lora_over_float8_trains_only_the_adapters(tmp_path):
    """The frozen base runs in torchao's Float8Linear (its weight gathered in float8) and stays bitwise as it was;
    every adapter tensor moves."""
    import fsdp2kit
    from fsdp2kit.parallel.float8 import describe_float8, plain_weight

    settings = {**RUN, **LORA, f"{F8}.enabled": True, "training.max_steps": 3, "training.output_dir": str(tmp_path)}
    try:
        strategy = fsdp2kit.Strategy.from_config(DEMO, overrides=as_overrides(settings))
        model = strategy.model
        described = describe_float8(model)
        assert described is not None and described["fsdp_float8_all_gather"]
        bases = [name for name in described["modules"] if name.endswith(".base_layer")]
        assert len(bases) == 12 and set(described["modules"]) - set(bases) == {
            f"model.layers.{i}.mlp.down_proj" for i in (0, 1)
        }

        def weights():
            return {name: plain_weight(p).full_tensor().clone() for name, p in model.named_parameters()}

        before = weights()
        for _ in range(3):
            strategy.train_step([token_batch(2, 64)])
        after = weights()
    finally:
        shutdown()
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert {f"{name}.weight" for name in described["modules"]} <= frozen
    assert all(torch.equal(after[name], before[name]) for name in frozen)
    trained = set(before) - frozen
    assert trained and all("lora_" in name for name in trained)
    assert all(not torch.equal(after[name], before[name]) for name in trained)


@pytest.mark.slow
def test_two_ranks_equal_one_rank_with_lora_over_float8(lora_runs, tmp_path):
    """The frozen base's float8 weights are the same casts at any world size (their scales never change); what
    differs is the order of the adapters' gradient sums."""
    settings = {**RUN, **LORA, f"{F8}.enabled": True, "training.max_steps": 10, "training.output_dir": str(tmp_path)}
    settings["training.gradient_accumulation_steps"] = 1  # 2 ranks x 1: the global batches of 1 rank x 2
    result = run_cli("train", DEMO, "--nproc", "2", *set_args(settings))
    assert result.returncode == 0, result.stderr
    assert losses(tmp_path) == pytest.approx(losses(lora_runs / "float8"), rel=1e-5)


@pytest.mark.parametrize(
    "settings, said",
    [
        (
            {f"{F8}.enabled": True, f"{F8}.recipe": "rowwise"},
            "strategy_config.float8.fsdp_float8_all_gather: torchao gathers float8 weights only with recipe "
            "tensorwise, not rowwise; set fsdp_float8_all_gather: false",
        ),
        (
            {f"{F8}.enabled": True, f"{F8}.exclude_modules": ["model.layers.9"]},
            "strategy_config.float8.exclude_modules: pattern 'model.layers.9' matches no module of the model "
            "(module paths look like 'model.layers.0')",
        ),
    ],
    ids=["rowwise-all-gather", "pattern"],
)
def test_refusals_are_one_line_and_exit_2(run_main, settings, said):
    result = run_main("check", DEMO, *set_args({**RUN, **settings}))
    assert (result.returncode, result.stderr) == (2, f"error: {said}\n")


def test_rowwise_trains_without_the_float8_all_gather(run_main, tmp_path):
    settings = {**RUN, f"{F8}.enabled": True, f"{F8}.recipe": "rowwise", f"{F8}.fsdp_float8_all_gather": False}
    result = run_main(
        "train", DEMO, *set_args({**settings, "training.max_steps": 2, "training.output_dir": str(tmp_path)})
    )
    assert result.returncode == 0, result.stderr
    assert len(losses(tmp_path)) == 2


def test_accelerate_fp8_with_the_ao_backend_is_float8(tmp_path):
    path = tmp_path / "fp8.yaml"
    fp8 = {"backend": "AO", "fp8_format": "HYBRID"}  # Accelerate's template's format, TransformerEngine's key
    path.write_text(yaml.safe_dump({"distributed_type": "FSDP", "mixed_precision": "fp8", "fp8_config": fp8}))
    cfg = load_config(DEMO, strategy_file=str(path))
    strategy = cfg.strategy_args.strategy_config
    assert strategy.float8.enabled and strategy.float8.recipe == "tensorwise" and strategy.float8.fsdp_float8_all_gather
    assert (strategy.param_dtype, strategy.reduce_dtype, strategy.output_dtype) == ("bf16", "bf16", "bf16")
    assert any("ignored (TransformerEngine and MS-AMP settings): fp8_config.fp8_format" in n for n in cfg.notes)


@pytest.mark.parametrize("gather", [True, False])
def test_plan_counts_the_float8_all_gather(gather):
    """A decoder layer (the largest group with intermediate_size 8192) gathers its linears' weights in one byte each
    with the float8 all-gather, and its norms in param_dtype bf16; without it, everything in bf16."""
    settings = {
        **RUN,
        f"{F8}.enabled": True,
        f"{F8}.fsdp_float8_all_gather": gather,
        "model.config.intermediate_size": 8192,
    }
    cfg = load_config(DEMO, as_overrides(settings))
    with process_group() as runtime:
        model = sharded_model(cfg, runtime, training=True).model
        model._get_fsdp_state()._lazy_init()  # the compute dtypes, set as a first forward sets them
        sizes = computed_sizes(model, torch.optim.SGD([torch.zeros(1)]))
    linears, norms = 2 * 256 * 256 + 2 * 128 * 256 + 3 * 8192 * 256, 2 * 256
    assert sizes["largest_unsharded_group"] == (linears if gather else 2 * linears) + 2 * norms


@pytest.mark.cuda
def test_float8_with_compile_trains_like_compile_alone_on_cuda():
    """On a GPU torch._scaled_mm runs float8 on tensor cores; the losses follow compile alone's as on the CPU.
    Its speed and peak on the 1.5B shape: benchmarks/gpu_suite.sh's bf16_seq2048_compile_float8 case."""
    from test_cuda import job, losses

    compiled = losses(job(compile=True), 20)
    float8 = losses(job(strategy_config={"float8": {"enabled": True}}, compile=True), 20)
    assert float8 == pytest.approx(compiled, rel=0.02)
    assert float8[-1] == pytest.approx(compiled[-1], rel=0.01)


def test_float8_without_torchao_is_one_line(monkeypatch):
    from fsdp2kit.config.schema import Float8Config
    from fsdp2kit.errors import UserError
    from fsdp2kit.parallel.float8 import apply_float8

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # what an environment without torchao imports
    with pytest.raises(UserError) as refused:
        apply_float8(torch.nn.Sequential(torch.nn.Linear(16, 16)), Float8Config(enabled=True))
    assert str(refused.value) == (
        "strategy_config.float8.enabled: float8 training needs torchao (pip install 'fsdp2kit[float8]')"
    )


def test_a_moe_models_fused_experts_stay_in_the_compute_dtype_and_say_so(run_main):
    """tiny-qwen3-moe: attention's linears in float8 (its routers are not linears: they stay as they were, as any
    router would); the fused experts (3-D weights run as grouped matmuls, which torchao's float8 training does not
    convert) stay in the compute dtype, listed and noted."""
    settings = {**RUN, f"{F8}.enabled": True, "model.name_or_path": "builtin:tiny-qwen3-moe"}
    result = run_main("check", DEMO, "--json", *set_args(settings))
    assert result.returncode == 0, result.stderr
    described = json.loads(result.stdout)
    float8, layers = described["float8"], range(2)
    assert float8["modules"] == [f"model.layers.{i}.self_attn.{p}_proj" for i in layers for p in "qkvo"]
    assert float8["high_precision_grouped_matmuls"] == [f"model.layers.{i}.mlp.experts" for i in layers]
    assert any("2 fused experts' grouped matmuls stay in the compute dtype" in note for note in described["notes"])
