"""Config loading and validation: every user mistake gives exit code 2 and one exact sentence, no traceback."""

from __future__ import annotations

import pytest
from conftest import REPO, run_cli

from fsdp2kit.cli import main
from fsdp2kit.config.load import load_config, validate
from fsdp2kit.config.yaml_io import apply_overrides
from fsdp2kit.distributed import OLDEST_TRANSFORMERS, require_supported_versions
from fsdp2kit.errors import UserError

DEMO = "examples/demo.yaml"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "training.learning_rat=1",
            "examples/demo.yaml: unknown key 'training.learning_rat' (did you mean 'training.learning_rate'?)",
        ),
        (
            "strategy_args.strategy_config.wrap_policy.wrap_embedding=true",
            "examples/demo.yaml: unknown key 'strategy_args.strategy_config.wrap_policy.wrap_embedding' "
            "(did you mean 'strategy_args.strategy_config.wrap_policy.wrap_embeddings'?)",
        ),
        (
            "colour=blue",
            "examples/demo.yaml: unknown key 'colour'; valid keys here: data, device_mapping, infer_batch_size, model, "
            "strategy_args, training",
        ),
        (
            "training.max_steps=abc",
            "examples/demo.yaml: 'training.max_steps' = 'abc' is not valid: expected an integer",
        ),
        (
            "model.dtype=int8",
            "examples/demo.yaml: 'model.dtype' = 'int8' is not valid: expected one of 'bf16', 'fp16' or 'fp32'",
        ),
        (
            "training.learning_rate=-1",
            "examples/demo.yaml: 'training.learning_rate' = -1 is not valid: expected greater than 0",
        ),
        (
            "strategy_args.strategy_config.fsdp_size=foo",
            "examples/demo.yaml: 'strategy_args.strategy_config.fsdp_size' = 'foo' is not valid: "
            "expected an integer or 'auto'",
        ),
        (
            "strategy_args.strategy_config.reshard_after_forward=maybe",
            "examples/demo.yaml: 'strategy_args.strategy_config.reshard_after_forward' = 'maybe' is not valid: "
            "expected true or false or an integer",
        ),
        (
            "strategy_args.strategy_name=fsdp3",
            "examples/demo.yaml: 'strategy_args.strategy_name' = 'fsdp3' is not valid: "
            "expected one of 'fsdp2_train' or 'fsdp2_infer'",
        ),
        (
            "device_mapping=list(rang(8))",
            "examples/demo.yaml: 'device_mapping' = 'list(rang(8))' is not valid: "
            "expected a list of device ids such as [0,1,2,3] or list(range(0,8))",
        ),
        (
            "training.learning_rate=.inf",
            "examples/demo.yaml: 'training.learning_rate' = inf is not valid: expected a finite number",
        ),
        (
            "training.max_grad_norm=.nan",
            "examples/demo.yaml: 'training.max_grad_norm' = nan is not valid: expected a finite number",
        ),
        *[
            (
                f"training.max_steps={steps}",
                f"examples/demo.yaml: 'training.max_steps' = {steps} is not valid: expected a number of steps > 0, "
                "or -1 to run num_train_epochs (0 would not mean no steps)",
            )
            for steps in (0, -3)
        ],
        (
            "device_mapping=list(range(0, 99999999999))",
            "examples/demo.yaml: 'device_mapping' = 'list(range(0, 99999999999))' is not valid: expected at most "
            "1048576 device ids (this range names 99999999999)",
        ),
        ("training=[1,2]", "examples/demo.yaml: 'training' = [1, 2] is not valid: expected a mapping"),
        ("training.max_steps", "--set 'training.max_steps' must look like key.path=value"),
        ("training.max_steps.x=1", "--set 'training.max_steps.x=1': 'training.max_steps' is a value, not a section"),
    ],
)
def test_bad_config_exits_2_with_one_message(override, message, capsys):
    assert main(["check", DEMO, "--set", override]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize(
    "schedule, override, message",
    [
        ("constant", "min_lr_ratio=0.1", "training.min_lr_ratio ends a decay; lr_scheduler_type constant never decays"),
        ("linear", "num_cycles=1", "training.num_cycles shapes a cosine; lr_scheduler_type is linear"),
    ],
)
def test_a_decay_setting_on_a_schedule_that_never_reads_it_exits_2(schedule, override, message, capsys):
    settings = ["--set", f"training.lr_scheduler_type={schedule}", "--set", f"training.{override}"]
    assert main(["check", DEMO, *settings]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "model.name_or_path=builtin:gpt5",
            "model.name_or_path: unknown built-in model 'builtin:gpt5'; valid: "
            "builtin:tiny-llama, builtin:tiny-qwen3, builtin:tiny-qwen3-moe, builtin:tiny-qwen2.5-vl, "
            "builtin:tiny-qwen3-vl, builtin:tiny-qwen3-vl-moe, builtin:tiny-qwen3.5, builtin:tiny-qwen3.5-moe",
        ),
        (
            "model.name_or_path=/no/such/model",
            "model.name_or_path: '/no/such/model' is not a model folder or checkpoint with a "
            "config.json (or a builtin: model: builtin:tiny-llama, builtin:tiny-qwen3, builtin:tiny-qwen3-moe, "
            "builtin:tiny-qwen2.5-vl, builtin:tiny-qwen3-vl, builtin:tiny-qwen3-vl-moe, builtin:tiny-qwen3.5, "
            "builtin:tiny-qwen3.5-moe)",
        ),
        (
            "strategy_args.strategy_config.offload_policy=true",
            "strategy_config.offload_policy: CPU offload needs an "
            "accelerator (CUDA) and this machine has none; set offload_policy: false",
        ),
        ("model.config.num_hidden_layerz=2", "model.config.num_hidden_layerz: the LlamaConfig has no such setting"),
    ],
)
def test_mistakes_found_while_building_exit_2(override, message, capsys):
    assert main(["check", DEMO, "--set", override]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_missing_and_broken_config_files(tmp_path, capsys):
    assert main(["check", str(tmp_path / "nope.yaml")]) == 2
    assert capsys.readouterr().err == f"error: config file '{tmp_path / 'nope.yaml'}' does not exist\n"
    broken = tmp_path / "broken.yaml"
    broken.write_text("model:\n  dtype: [bf16\n")
    assert main(["check", str(broken)]) == 2
    assert capsys.readouterr().err.startswith(f"error: config file '{broken}' is not valid YAML at line 3")


def test_set_parses_values_as_yaml():
    raw = apply_overrides(
        {},
        [
            "training.learning_rate=1e-3",
            "model.freeze_module_prefix=[a,b]",
            "training.export_hf=false",
            "strategy_args.strategy_config.fsdp_size=auto",
        ],
    )
    cfg = validate(raw)
    assert cfg.training.learning_rate == 1e-3
    assert cfg.model.freeze_module_prefix == ["a", "b"]
    assert cfg.training.export_hf is False
    assert cfg.strategy_args.strategy_config.fsdp_size == "auto"


def test_roll_device_mapping_and_aliases():
    cfg = validate(
        {
            "device_mapping": "list(range(0,8))",
            "strategy_args": {"strategy_config": {"sharding_size": 4, "offload_to_cpu": False}},
            "model": {"dtype": "bfloat16", "freeze_module_prefix": "vision_model"},
        }
    )
    assert cfg.device_mapping == list(range(8))
    assert cfg.strategy_args.strategy_config.fsdp_size == 4
    assert cfg.model.dtype == "bf16"
    assert cfg.model.freeze_module_prefix == ["vision_model"]
    with pytest.raises(UserError, match="only one of 'sharding_size' and 'fsdp_size'"):
        validate({"strategy_args": {"strategy_config": {"sharding_size": 4, "fsdp_size": 2}}})


def test_every_field_is_documented():
    from fsdp2kit.config import schema

    sections = [
        schema.ModelConfig,
        schema.DataConfig,
        schema.TrainingConfig,
        schema.WrapPolicy,
        schema.Float8Config,
        schema.StrategyConfig,
        schema.StrategyArgs,
        schema.JobConfig,
    ]
    undocumented = [f"{s.__name__}.{n}" for s in sections for n, f in s.model_fields.items() if not f.description]
    assert undocumented == []


def test_demo_config_loads():
    cfg = load_config(DEMO)
    assert cfg.model.name_or_path == "builtin:tiny-llama"
    assert cfg.training.output_dir == "runs/demo"


@pytest.mark.slow
def test_fsdp_size_not_dividing_world_fails_before_spawning():
    result = run_cli("check", DEMO, "--nproc", "4", "--set", "strategy_args.strategy_config.fsdp_size=3")
    assert result.returncode == 2
    assert result.stderr == (
        "error: strategy_config.fsdp_size = 3 does not divide the world size 4; valid: 'auto' or one of [1, 2, 4]\n"
    )


@pytest.mark.slow
def test_mistake_found_inside_ranks_is_one_message(tmp_path):
    """A data file that is missing is only noticed by the ranks: still one line and exit code 2, no launcher report."""
    missing = tmp_path / "missing.jsonl"
    result = run_cli(
        "train",
        DEMO,
        "--nproc",
        "2",
        "--set",
        f"data.source={missing}",
        "--set",
        f"training.output_dir={tmp_path / 'run'}",
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [f"error: data.source: no such file '{missing}'"]
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.slow
def test_device_mapping_must_match_world_size(tmp_path):
    result = run_cli("check", DEMO, "--nproc", "2", "--set", "device_mapping=[0,1,2,3]")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: device_mapping lists 4 devices but the job has 2 ranks; give 2 device ids or launch 4 ranks"
    )


@pytest.mark.parametrize(
    ("key", "message"),
    [
        ("training.lr=.inf", "expected a finite number"),
        ("training.train_iters=0", "expected a number of steps > 0, or -1"),
        ("training.train_iters=-3", "expected a number of steps > 0, or -1"),
    ],
)
def test_native_mindspeed_steps_and_learning_rate_are_refused_by_their_own_names(key, message):
    """MindSpeed-MM's `lr: .inf` trained NaN weights to exit 0, `train_iters: 0` a whole epoch: each is one line."""
    from test_real_configs import user_args

    config, swaps, _ = user_args("mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml", "tiny-qwen3.5-moe", 2)
    with pytest.raises(UserError, match=f": '{key.split('=')[0]}' = .* is not valid: {message}"):
        load_config(config, [*swaps, key])


@pytest.mark.parametrize("command", ["train", "plan"])
def test_a_torch_older_than_the_tested_ones_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    """Seen on real installs: torch 2.9 fails at the end of a run, 2.6 at the first fully_shard, each with a
    traceback. The run, and plan's fake world, refuse such a torch at once."""
    import torch

    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    code = main([command, DEMO, "--set", f"training.output_dir={tmp_path / 'run'}"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: fsdp2kit needs torch 2.10 or newer (this is torch 2.9.1+cu128): pip install 'torch>=2.10'"
    )
    assert not (tmp_path / "run").exists()
    for newer in ("2.10.0+cu128", "2.12.0.dev20260101+cu130", "3.0.0"):  # a nightly counts as its release
        monkeypatch.setattr(torch, "__version__", newer)
        require_supported_versions()


# Every command that reads a model, a tokenizer or a checkpoint: (its arguments, written to `run` under tmp_path).
VERSIONED_COMMANDS = {
    command: [command, DEMO, "--set", "training.output_dir={run}"] for command in ("train", "plan", "check", "prepare")
} | {f"convert_{to}": ["convert", "{run}.src", "{run}", "--to", to] for to in ("hf", "dcp")}


@pytest.mark.parametrize("command", list(VERSIONED_COMMANDS))
def test_a_transformers_older_than_the_tested_ones_is_one_line_before_any_work(command, tmp_path, monkeypatch, capsys):
    """pyproject said transformers>=4.56, but fsdp2kit's loading uses weight conversions 4.x lacks, and the suite
    runs on 5.2 and newer (`make test-floor`): an older release is refused at once, naming the floor, by every
    command that loads with transformers (with 4.57 `convert` died on a missing module, `prepare` blamed the
    tokenizer's class)."""
    import transformers

    monkeypatch.setattr(transformers, "__version__", "5.1.0")
    code = main([arg.format(run=tmp_path / "run") for arg in VERSIONED_COMMANDS[command]])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: fsdp2kit needs transformers 5.2 or newer (this is transformers 5.1.0): pip install 'transformers>=5.2'"
    )
    assert not (tmp_path / "run").exists()
    for newer in ("5.2.0", "5.10.4", "5.25.0.dev0", "6.0.0"):
        monkeypatch.setattr(transformers, "__version__", newer)
        require_supported_versions()


def test_the_transformers_floor_is_the_one_pyproject_and_the_floor_environment_state():
    """The refusal, pyproject's requirement and the constraints `make test-floor` installs name one release."""
    oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
    assert f'"transformers>={oldest}"' in (REPO / "pyproject.toml").read_text()
    assert f"transformers=={oldest}.0\n" in (REPO / ".ci" / "floor-constraints.txt").read_text()
