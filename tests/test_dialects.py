"""Foreign config dialects: ROLL role files, MindSpeed-MM fsdp2_config.yaml, Accelerate configs and the Trainer's
`fsdp`/`fsdp_config`. Each example gives the plan its keys ask for (read back from `fsdp2kit check --json`); every
mapping, note and mistake is pinned down by a fast in-process test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_cli

from fsdp2kit.cli import main
from fsdp2kit.config.dialects.translation import Translation, Written, apply_rules, ignored, to
from fsdp2kit.config.load import load_config
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.mesh import mesh_layout

ROLL_EXAMPLE = "examples/roll_rlvr.yaml"
LAYERS = [f"model.layers.{i}" for i in range(4)]


def check_json(*args: str) -> dict:
    result = run_cli("check", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def load_error(*args, **kwargs) -> str:
    with pytest.raises(UserError) as error:
        load_config(*args, **kwargs)
    return str(error.value)


# ---------------------------------------------------------------- the examples, through `fsdp2kit check --json`


@pytest.mark.slow
def test_roll_example_runs_its_first_fsdp2_role_on_the_ranks_of_its_device_mapping():
    plan = check_json(ROLL_EXAMPLE)  # device_mapping: list(range(0,2)) launches 2 ranks
    assert plan["world_size"] == 2
    assert plan["mesh"] == {"shape": [2], "dim_names": ["fsdp"]}
    assert plan["strategy"] == "fsdp2_train"
    assert plan["model"] == {"name_or_path": "builtin:tiny-qwen3", "class": "Qwen3ForCausalLM"}
    assert plan["sharded_modules"] == ["", *LAYERS]
    assert plan["recompute_modules"] == LAYERS  # disable_gradient_checkpointing: false
    assert plan["ignored_modules"] == []
    assert plan["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": None,
        "cast_forward_inputs": False,  # ROLL casts no inputs into layers or the root
        "no_cast_modules": [],
    }
    assert plan["reshard_after_forward"] is True
    assert plan["offload"] is False
    assert plan["prefetch"] == {"forward": 0, "backward": 1}
    assert plan["ulysses_size"] == 1
    notes = plan["config_notes"]
    assert notes[0] == f"ROLL role 'actor_train' (fsdp2_train) of {ROLL_EXAMPLE}: the first role with an FSDP2 strategy"
    assert "ROLL role 'reference' (fsdp2_infer) not used; pick it with --role reference" in notes
    assert "ignored (roles whose strategy is not FSDP2): actor_infer (vllm)" in notes
    assert (
        "mapped actor_train.model_args.disable_gradient_checkpointing=False → model.gradient_checkpointing=True"
        in notes
    )
    assert "mapped prompt_length + response_length = 128 → data.seq_len (ROLL's sequence_length)" in notes
    assert "ignored (Hydra runtime settings): hydra" in notes
    assert (
        "ignored (no FSDP2 meaning): exp_name, logging_dir, track_with, tracker_kwargs, rollout_batch_size, "
        "num_return_sequences_in_group, ppo_epochs, adv_estimator"
    ) in notes


def test_roll_example_reference_role_is_forward_only():
    plan = check_json(ROLL_EXAMPLE, "--role", "reference")
    assert plan["world_size"] == 1
    assert plan["mesh"] == {"shape": [1], "dim_names": ["fsdp"]}
    assert plan["strategy"] == "fsdp2_infer"
    assert plan["sharded_modules"] == ["", *LAYERS]
    assert plan["recompute_modules"] == []
    assert plan["mixed_precision"]["param_dtype"] == "bfloat16"
    assert plan["mixed_precision"]["reduce_dtype"] == "float32"
    assert plan["reshard_after_forward"] is True
    assert "ROLL role 'reference' (fsdp2_infer) of examples/roll_rlvr.yaml: picked with --role" in plan["config_notes"]


def test_mindspeed_example_strategy_comes_from_its_fsdp2_config_yaml():
    plan = check_json("examples/mindspeed_job.yaml")
    assert plan["world_size"] == 1
    assert plan["strategy"] == "fsdp2_train"
    assert plan["sharded_modules"] == ["", "model.embed_tokens", *LAYERS]  # sub_modules_to_wrap
    assert plan["recompute_modules"] == ["model.layers.0", "model.layers.1"]  # model.layers.{0-1}
    assert plan["ignored_modules"] == []
    assert plan["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
        "output_dtype": "float32",
        "cast_forward_inputs": True,
        "no_cast_modules": [],
    }
    assert plan["use_reentrant"] is False
    assert plan["reshard_after_forward"] is True
    assert plan["offload"] is False
    assert plan["prefetch"] == {"forward": 1, "backward": 2}
    assert plan["config_notes"] == [
        "strategy_args.strategy_config read from examples/mindspeed_fsdp2_config.yaml (MindSpeed-MM fsdp2_config)",
        "mapped sharding_size → strategy_args.strategy_config.fsdp_size",
        "mapped offload_to_cpu → strategy_args.strategy_config.offload_policy",
        "ignored (used only with offload_to_cpu): pin_memory",
    ]


def test_accelerate_example_replaces_the_strategy_given_with_fsdp_config():
    plan = check_json("examples/accelerate_trainer.yaml", "--fsdp-config", "examples/accelerate_fsdp_config.yaml")
    assert plan["world_size"] == 1
    assert plan["sharded_modules"] == ["", *LAYERS]  # TRANSFORMER_BASED_WRAP of LlamaDecoderLayer
    assert plan["recompute_modules"] == LAYERS  # fsdp_activation_checkpointing
    assert plan["use_reentrant"] is False
    assert plan["mixed_precision"] == {
        "param_dtype": "bfloat16",
        "reduce_dtype": "bfloat16",  # Accelerate's set_mixed_precision: one dtype for all three
        "output_dtype": "bfloat16",
        "cast_forward_inputs": True,
        "no_cast_modules": [],
    }
    assert plan["reshard_after_forward"] is False  # fsdp_reshard_after_forward: false
    assert plan["offload"] is False
    assert plan["prefetch"] == {"forward": 1, "backward": 1}
    notes = plan["config_notes"]
    assert notes[:2] == [
        "strategy_args.strategy_config of examples/accelerate_trainer.yaml replaced by "
        "examples/accelerate_fsdp_config.yaml (keys dropped: fsdp, fsdp_config, param_dtype)",
        "strategy_args.strategy_config read from examples/accelerate_fsdp_config.yaml (Accelerate config)",
    ]
    assert (
        "mapped mixed_precision=bf16 → param_dtype, reduce_dtype, output_dtype=bf16 (Accelerate's FSDP policy); "
        "Accelerate also upcasts the parameters to fp32 (here model.dtype decides) and autocasts the forward "
        "(fsdp2kit does not)"
    ) in notes
    assert (
        "ignored (FSDP2 always keeps the original parameters (as DTensors)): fsdp_config.fsdp_use_orig_params" in notes
    )
    assert (
        "ignored (Accelerate launcher settings; --nproc N or torchrun decide processes and machines): "
        "compute_environment, debug, enable_cpu_affinity, machine_rank, main_training_function, num_machines, "
        "num_processes, rdzv_backend, same_network, use_cpu"
    ) in notes


def test_trainer_fsdp_string_example():
    plan = check_json("examples/accelerate_trainer.yaml")
    assert plan["sharded_modules"] == ["", *LAYERS]
    assert plan["reshard_after_forward"] is False  # shard_grad_op
    assert plan["recompute_modules"] == []
    assert plan["mixed_precision"]["param_dtype"] == "bfloat16"
    assert plan["prefetch"] == {"forward": 0, "backward": 1}
    assert (
        "mapped strategy_args.strategy_config.fsdp='shard_grad_op auto_wrap' → strategy_args.strategy_config: "
        "sharding_strategy='SHARD_GRAD_OP'"
    ) in plan["config_notes"]


def test_accelerate_offload_on_a_cpu_only_machine_exits_2(tmp_path, capsys):
    accelerate_file = yaml.safe_load((REPO / "examples/accelerate_fsdp_config.yaml").read_text())
    accelerate_file["fsdp_config"]["fsdp_offload_params"] = True
    path = write_yaml(tmp_path / "offload.yaml", accelerate_file)
    assert main(["check", "examples/accelerate_trainer.yaml", "--fsdp-config", str(path)]) == 2
    assert "CPU offload needs an accelerator (CUDA) and this machine has none" in capsys.readouterr().err


# ---------------------------------------------------------------- ROLL

ROLL_FILE = {
    "pretrain": "builtin:tiny-llama",
    "seed": 3,
    "sequence_length": 64,
    "rollout_batch_size": 16,
    "actor_infer": {"strategy_args": {"strategy_name": "vllm"}, "device_mapping": "list(range(0,4))"},
    "actor_train": {
        "model_args": {"dtype": "fp32", "disable_gradient_checkpointing": True},
        "training_args": {"learning_rate": 2.0e-5, "max_steps": 5},
        "strategy_args": {"strategy_name": "fsdp2_train", "strategy_config": {"fsdp_size": 2}},
    },
    "critic": {"strategy_args": {"strategy_name": "megatron_train"}},
    "reference": {"strategy_args": {"strategy_name": "fsdp2_infer"}},
}


def roll_file(tmp_path: Path, changes: dict | None = None, role_changes: dict | None = None) -> Path:
    data = json.loads(json.dumps(ROLL_FILE)) | (changes or {})
    for section, values in (role_changes or {}).items():
        data["actor_train"][section] = data["actor_train"].get(section, {}) | values
    return write_yaml(tmp_path / "roll.yaml", data)


def test_roll_s_value_model_is_fsdp2kit_s_critic(tmp_path):
    """ROLL's critic (its default_value_model_provider with model_type auto_token_classification: the family's
    AutoModelForTokenClassification, num_labels 1) is a critic here: a LlamaForTokenClassification for a Llama."""
    from transformers import LlamaConfig, LlamaForTokenClassification

    from fsdp2kit.models.build import load_model_class

    cfg = load_config(roll_file(tmp_path, role_changes={"model_args": {"model_type": "auto_token_classification"}}))
    assert (cfg.model.model_class, cfg.model.config) == (
        "transformers:AutoModelForTokenClassification",
        {"num_labels": 1},
    )
    assert load_model_class(cfg.model.model_class, LlamaConfig()) is LlamaForTokenClassification


def test_roll_maps_top_level_and_role_keys(tmp_path):
    cfg = load_config(roll_file(tmp_path))
    assert cfg.model.name_or_path == "builtin:tiny-llama"
    assert (cfg.training.seed, cfg.training.learning_rate, cfg.training.max_steps) == (3, 2.0e-5, 5)
    assert cfg.data.seq_len == 64
    assert cfg.model.gradient_checkpointing is False
    assert cfg.strategy_args.strategy_name == "fsdp2_train"
    assert cfg.strategy_args.strategy_config.fsdp_size == 2
    assert "ignored (no FSDP2 meaning): rollout_batch_size" in cfg.notes


def test_roll_decays_every_parameter_as_its_fsdp2_strategy_does(tmp_path):
    """Issue 53 (3): ROLL's FSDP2 strategy builds one AdamW group over every trainable parameter, so its
    training_args.weight_decay decays biases and norms too (the HF Trainer, whose arguments they are, would not)."""
    cfg = load_config(roll_file(tmp_path, role_changes={"training_args": {"weight_decay": 0.1}}))
    assert (cfg.training.weight_decay, cfg.training.weight_decay_every_parameter) == (0.1, True)
    assert (
        "training.weight_decay_every_parameter=True: ROLL's FSDP2 strategy decays every parameter (one AdamW group)"
    ) in cfg.notes


def test_roll_interleave_probs_weigh_its_files_and_eval_file_name_is_the_evaluation(tmp_path):
    data_args = {"file_name": ["a.jsonl", "b.jsonl"], "interleave_probs": "0.7,0.3", "eval_file_name": "val.jsonl"}
    cfg = load_config(roll_file(tmp_path, role_changes={"data_args": data_args}))
    assert [(e.path, e.weight) for e in cfg.data.source] == [("a.jsonl", 0.7), ("b.jsonl", 0.3)]
    assert cfg.data.eval_source == "val.jsonl"
    assert any("interleave_probs → data.source: a mixture of 2 files" in note for note in cfg.notes)
    # ROLL's examples write "1.0" beside several files: one source, the probability ignored
    data_args = {"file_name": ["a.jsonl", "b.jsonl"], "interleave_probs": "1.0"}
    training_args = {"per_device_eval_batch_size": 3}
    cfg = load_config(roll_file(tmp_path, role_changes={"data_args": data_args, "training_args": training_args}))
    assert cfg.data.source == ["a.jsonl", "b.jsonl"] and cfg.training.per_device_eval_batch_size == 3
    assert "actor_train.data_args.interleave_probs" in "\n".join(cfg.notes)


def test_roll_sft_pipeline_evaluates_its_validation_data_every_eval_steps(tmp_path):
    sft = {
        "model_args": {"dtype": "fp32"},
        "data_args": {"file_name": "train.json"},
        "strategy_args": {"strategy_name": "fsdp2_train"},
    }
    top = {"pretrain": "builtin:tiny-llama", "eval_steps": 25, "validation": {"data_args": {"file_name": "v.json"}}}
    cfg = load_config(write_yaml(tmp_path / "sft.yaml", {**top, "sft_train": sft}))
    assert (cfg.training.eval_steps, cfg.data.eval_source) == (25, "v.json")
    rl = load_config(roll_file(tmp_path, {"eval_steps": 25, "validation": {"data_args": {"file_name": "v.json"}}}))
    assert (rl.training.eval_steps, rl.data.eval_source) == (0, None)  # RL validation: rewards, not a loss


def test_roll_fills_in_rolls_own_defaults_and_says_so(tmp_path):
    cfg = load_config(roll_file(tmp_path), role="reference")
    assert cfg.model.dtype == "bf16"  # ROLL's ModelArguments.dtype
    assert cfg.infer_batch_size == 16  # ROLL's WorkerConfig.infer_batch_size
    assert cfg.data.pack is False  # use_sequence_packing: false
    assert cfg.training.resume == "never"  # resume_from_checkpoint: false
    assert cfg.model.gradient_checkpointing is False  # forward-only roles run no backward
    assert "ROLL default reference.model_args.dtype='bf16' (the file does not set it)" in cfg.notes
    assert "ROLL default output_dir='./output' (the file does not set it)" in cfg.notes
    train = load_config(roll_file(tmp_path, role_changes={"model_args": {"dtype": "fp32"}}))
    assert train.model.gradient_checkpointing is False  # the file disables it
    # ROLL's unset gradient_checkpointing_use_reentrant: non-reentrant recompute of a dense model (fsdp2kit's own
    # default is reentrant)
    assert train.strategy_args.strategy_config.use_reentrant is False
    default = "actor_train.model_args.gradient_checkpointing_use_reentrant=False (the file does not set it)"
    assert f"ROLL default {default}" in train.notes


def test_roll_resolves_interpolations_and_leaves_hydra_alone(tmp_path):
    path = roll_file(
        tmp_path,
        {"hydra": {"run": {"dir": "outputs/${now:%Y-%m-%d}"}}, "lr": 3.0e-4},
        {"training_args": {"learning_rate": "${lr}"}},
    )
    cfg = load_config(path)
    assert cfg.training.learning_rate == 3.0e-4
    assert "ignored (Hydra runtime settings): hydra" in cfg.notes


def test_roll_role_sections_accept_rolls_spellings(tmp_path):
    cfg = load_config(
        roll_file(
            tmp_path,
            role_changes={
                "model_args": {
                    "freeze_module_prefix": "model.embed_tokens, lm_head",
                    "attn_implementation": "fa2",
                    "gradient_checkpointing_use_reentrant": False,
                    "model_type": None,
                },
                "training_args": {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 3},
                "data_args": {"file_name": ["data/train.jsonl"], "template": "qwen2_5"},
            },
        )
    )
    assert cfg.model.freeze_module_prefix == ["model.embed_tokens", "lm_head"]
    assert (
        cfg.model.attn_implementation == "flash_attention_2"
    )  # sdpa where flash-attn or CUDA is missing (check notes it)
    assert cfg.strategy_args.strategy_config.use_reentrant is False
    assert cfg.training.lr_scheduler_type == "constant"
    assert cfg.data.source == "data/train.jsonl"
    assert cfg.data.template == "qwen2_5"  # the model's own template, checked against its family when read
    assert (
        "mapped actor_train.model_args.attn_implementation='fa2' → model.attn_implementation='flash_attention_2'"
        in cfg.notes
    )


@pytest.mark.parametrize(
    "role, message",
    [
        (
            "actor_infer",
            "--role actor_infer: role 'actor_infer' of '{path}' uses strategy 'vllm', which fsdp2kit does not "
            "run; usable roles: actor_train, reference (strategy fsdp2_train or fsdp2_infer)",
        ),
        (
            "critic",
            "--role critic: role 'critic' of '{path}' uses strategy 'megatron_train', which fsdp2kit does not run; "
            "usable roles: actor_train, reference (strategy fsdp2_train or fsdp2_infer)",
        ),
        (
            "actor",
            "--role actor: '{path}' has no role 'actor'; its roles: actor_infer (vllm), actor_train (fsdp2_train), "
            "critic (megatron_train), reference (fsdp2_infer)",
        ),
    ],
)
def test_roll_role_that_cannot_run_exits_2_naming_it(tmp_path, capsys, role, message):
    path = roll_file(tmp_path)
    assert main(["check", str(path), "--role", role]) == 2
    assert capsys.readouterr().err == f"error: {message.format(path=path)}\n"


def test_role_on_a_native_file_and_roll_file_without_fsdp2_roles(tmp_path, capsys):
    assert main(["check", "examples/demo.yaml", "--role", "actor_train"]) == 2
    assert capsys.readouterr().err == (
        "error: --role actor_train: 'examples/demo.yaml' is a native fsdp2kit config, "
        "which has no roles (--role picks a role of a ROLL file)\n"
    )
    path = write_yaml(
        tmp_path / "megatron.yaml", {"actor_train": {"strategy_args": {"strategy_name": "megatron_train"}}}
    )
    assert load_error(path) == (
        f"'{path}' has no role with strategy fsdp2_train or fsdp2_infer; its roles: actor_train (megatron_train)"
    )


@pytest.mark.parametrize(
    "changes, role_changes, message",
    [
        (
            {},
            {"model_args": {"model_type": "trl"}},
            "'actor_train.model_args.model_type' = 'trl' is not supported: fsdp2kit trains causal language models "
            "(model_type: ~) and critics (model_type: auto_token_classification); ROLL's trl value head and reward "
            "models are not",
        ),
        (
            {},
            {"model_args": {"lora_target": "q_proj|v_proj"}},
            "'actor_train.model_args.lora_target' = 'q_proj|v_proj' is not valid: a regular expression; list the "
            "module names (q_proj,v_proj) or give all-linear",
        ),
        (
            {},
            {"training_args": {"learning_rat": 1.0}},
            "unknown key 'actor_train.training_args.learning_rat' "
            "(did you mean 'actor_train.training_args.learning_rate'?)",
        ),
        (
            {},
            {"training_args": {"learning_rate": "fast"}},
            "'actor_train.training_args.learning_rate' = 'fast' is not valid: expected a number",
        ),
        (
            {},
            {"strategy_args": {"strategy_config": {"fsdp_sise": 2}}},
            "unknown key 'actor_train.strategy_args.strategy_config.fsdp_sise' "
            "(did you mean 'actor_train.strategy_args.strategy_config.fsdp_size'?)",
        ),
        (
            {"defaults": ["../config/envs@_here_"]},
            {},
            "'defaults' is a Hydra defaults list (../config/envs@_here_), which Hydra composes with the files it names "
            "before ROLL reads them; fsdp2kit reads one composed file: compose it first (hydra.compose, then "
            "OmegaConf.save) and give that file",
        ),
        (
            {},
            {"training_args": {"lr_scheduler_type": "polynomial"}},
            "'actor_train.training_args.lr_scheduler_type' = 'polynomial' is not valid: expected one of cosine, "
            "linear, constant, constant_with_warmup",
        ),
        (
            {"pretrain": None},
            {},
            "names no model for role 'actor_train': set pretrain or actor_train.model_args.model_name_or_path",
        ),
        (
            {"training": {"max_steps": 3}},
            {},
            "'training' = {'max_steps': 3} is not supported: a native section in a ROLL file; a file holds either "
            "native sections or ROLL roles",
        ),
        (
            {"response_length": "${prompt_lenght}"},
            {},
            "cannot resolve 'response_length': Interpolation key 'prompt_lenght' not found",
        ),
    ],
)
def test_roll_mistakes_name_the_key_as_written(tmp_path, changes, role_changes, message):
    path = roll_file(tmp_path, changes, role_changes)
    error = load_error(path)
    assert error.startswith(f"{path}: ") or error.startswith(f"'{path}' "), error
    assert error.endswith(message)


def test_set_overrides_the_translated_config_and_names_native_keys(tmp_path):
    path = roll_file(tmp_path)
    assert load_config(path, ["training.max_steps=9"]).training.max_steps == 9
    assert load_error(path, ["training.max_steps=abc"]) == (
        f"{path}: 'training.max_steps' = 'abc' is not valid: expected an integer"
    )


def test_roll_role_names_a_strategy_file_beside_it(tmp_path):
    write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": 1, "reshard_after_forward": False})
    path = roll_file(tmp_path, role_changes={"strategy_args": {"strategy_config_path": "fsdp2_config.yaml"}})
    cfg = load_config(path)
    assert cfg.strategy_args.strategy_config.fsdp_size == 1
    assert cfg.strategy_args.strategy_config.reshard_after_forward is False
    assert (
        f"actor_train.strategy_args.strategy_config of {path} replaced by {tmp_path / 'fsdp2_config.yaml'} "
        "(keys dropped: fsdp_size)"
    ) in cfg.notes
    # model_args' recompute kind is not the strategy file's to drop: ROLL's default, and a value the file gives
    assert cfg.strategy_args.strategy_config.use_reentrant is False
    role_changes = {
        "strategy_args": {"strategy_config_path": "fsdp2_config.yaml"},
        "model_args": {"gradient_checkpointing_use_reentrant": True},
    }
    assert load_config(roll_file(tmp_path, role_changes=role_changes)).strategy_args.strategy_config.use_reentrant


# ---------------------------------------------------------------- MindSpeed-MM fsdp2_config.yaml


def test_mindspeed_file_from_the_command_line_and_set_wins_over_it():
    cfg = load_config(
        "examples/demo.yaml",
        ["strategy_args.strategy_config.num_to_backward_prefetch=3"],
        strategy_file="examples/mindspeed_fsdp2_config.yaml",
    )
    strategy = cfg.strategy_args.strategy_config
    assert strategy.fsdp_size == "auto"  # sharding_size
    assert strategy.sub_modules_to_wrap == ["model.layers.{*}", "model.embed_tokens"]
    assert strategy.offload_policy is False  # offload_to_cpu
    assert strategy.num_to_backward_prefetch == 3
    assert cfg.strategy_args.strategy_config_path == "examples/mindspeed_fsdp2_config.yaml"
    assert mesh_layout(2, strategy).shape == (2,)  # sharding_size auto = the world size


def test_mindspeed_sharding_size_below_world_is_hsdp(tmp_path):
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": 2, "param_dtype": "bf16"})
    cfg = load_config("examples/demo.yaml", strategy_file=str(path))
    layout = mesh_layout(4, cfg.strategy_args.strategy_config)
    assert (layout.shape, layout.dim_names) == ((2, 2), ("ddp", "fsdp"))


def test_mindspeed_mistake_names_its_own_file_and_key(tmp_path):
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_sise": 2})
    assert load_error("examples/demo.yaml", strategy_file=str(path)) == (
        f"{path}: unknown key 'sharding_sise' (did you mean 'sharding_size'?)"
    )
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"param_dtype": "int8"})
    assert load_error("examples/demo.yaml", strategy_file=str(path)) == (
        f"{path}: 'param_dtype' = 'int8' is not valid: expected one of 'bf16', 'fp16' or 'fp32'"
    )


# ---------------------------------------------------------------- Accelerate config files and Trainer keys


def accelerate_strategy(tmp_path: Path, fsdp_config: dict, **top) -> tuple:
    path = write_yaml(tmp_path / "accelerate.yaml", {"distributed_type": "FSDP", **top, "fsdp_config": fsdp_config})
    cfg = load_config("examples/demo.yaml", strategy_file=str(path))
    return cfg.strategy_args.strategy_config, cfg


@pytest.mark.parametrize(
    "fsdp_config, expected",
    [
        ({"fsdp_sharding_strategy": 2}, {"sharding_strategy": "SHARD_GRAD_OP"}),
        ({"fsdp_sharding_strategy": "HYBRID_SHARD_ZERO2"}, {"sharding_strategy": "_HYBRID_SHARD_ZERO2"}),
        ({"fsdp_reshard_after_forward": "FULL_SHARD", "fsdp_version": 1}, {"sharding_strategy": "FULL_SHARD"}),
        ({"fsdp_reshard_after_forward": "false"}, {"reshard_after_forward": False}),
        ({"fsdp_backward_prefetch": "NO_PREFETCH"}, {"num_to_backward_prefetch": 0}),
        (
            {"fsdp_backward_prefetch": "BACKWARD_POST", "fsdp_forward_prefetch": True},
            {"num_to_backward_prefetch": 1, "num_to_forward_prefetch": 1},
        ),
        (
            {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": "A, B"},
            {"wrap_policy": {"transformer_layer_cls_to_wrap": ["A", "B"], "min_num_params": 0}},
        ),
        (
            {
                "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                "fsdp_min_num_params": 100000,
                "fsdp_transformer_layer_cls_to_wrap": "A",
            },
            {"wrap_policy": {"transformer_layer_cls_to_wrap": [], "min_num_params": 100000}},
        ),
        ({"fsdp_offload_params": True}, {"offload_policy": True}),
        ({"fsdp_ignored_modules": "model.embed_tokens"}, {"ignored_modules": ["model.embed_tokens"]}),
    ],
)
def test_accelerate_fsdp_config_keys(tmp_path, fsdp_config, expected):
    strategy, _ = accelerate_strategy(tmp_path, fsdp_config)
    dumped = strategy.model_dump()
    for key, value in expected.items():
        actual = {k: dumped[key][k] for k in value} if isinstance(value, dict) else dumped[key]
        assert actual == value, key


def test_accelerate_notes_what_fsdp2kit_does_differently(tmp_path):
    _, cfg = accelerate_strategy(
        tmp_path,
        {
            "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
            "fsdp_min_num_params": 10,
            "fsdp_transformer_layer_cls_to_wrap": "A",
            "fsdp_version": 1,
        },
    )
    assert "fsdp_config.fsdp_version=1: FSDP1 settings read as FSDP2 (fsdp2kit only runs fully_shard)" in cfg.notes
    assert (
        "ignored (read only with fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP): "
        "fsdp_config.fsdp_transformer_layer_cls_to_wrap"
    ) in cfg.notes
    _, cfg = accelerate_strategy(tmp_path, {}, mixed_precision="no")
    assert cfg.strategy_args.strategy_config.param_dtype is None
    assert cfg.strategy_args.strategy_config.wrap_policy.no_wrap is True  # Accelerate's default: NO_WRAP
    assert (
        "fsdp_config.fsdp_auto_wrap_policy=NO_WRAP (Accelerate's default) → "
        "strategy_args.strategy_config.wrap_policy.no_wrap: only the root is sharded"
    ) in cfg.notes


def test_accelerate_parallelism_config_is_the_hsdp_mesh(tmp_path):
    strategy, cfg = accelerate_strategy(
        tmp_path,
        {},
        parallelism_config={
            "parallelism_config_dp_replicate_size": 2,
            "parallelism_config_dp_shard_size": 2,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": 1,
        },
    )
    layout = mesh_layout(4, strategy)
    assert (layout.shape, layout.dim_names) == ((2, 2), ("ddp", "fsdp"))


def test_accelerate_tp_size_is_tensor_parallelism_beside_the_hsdp_mesh(tmp_path):
    """Accelerate's mesh is dp_replicate x dp_shard x tp: tp_size is model.tensor_parallel_size, innermost, and the
    dp_shard group is FSDP's over the other ranks."""
    sizes = {"parallelism_config_dp_replicate_size": 2, "parallelism_config_dp_shard_size": 2}
    strategy, cfg = accelerate_strategy(tmp_path, {}, parallelism_config={**sizes, "parallelism_config_tp_size": 2})
    assert cfg.model.tensor_parallel_size == 2
    assert "mapped parallelism_config.parallelism_config_tp_size → model.tensor_parallel_size" in cfg.notes
    layout = mesh_layout(8, strategy, tp_size=cfg.model.tensor_parallel_size)
    assert (layout.shape, layout.dim_names) == ((2, 2, 2), ("ddp", "fsdp", "tp"))


def test_accelerate_context_parallel_is_context_parallel_and_fsdp_shards_over_its_ranks(tmp_path):
    """Issue 48 (4): Accelerate's cp_size is model.context_parallel_size; it shards over dp_shard x cp ranks (its
    dp_shard_cp mesh), so the fsdp group is that many ranks; what ParallelismConfig refuses is refused."""
    sizes = {"parallelism_config_dp_shard_size": 2, "parallelism_config_cp_size": 2}
    strategy, cfg = accelerate_strategy(tmp_path, {}, parallelism_config=sizes)
    assert (cfg.model.context_parallel_size, cfg.model.ulysses_size, strategy.fsdp_size) == (2, 1, 4)
    assert (
        "mapped parallelism_config.parallelism_config_dp_shard_size=2 x parallelism_config_cp_size=2 → "
        "strategy_args.strategy_config.fsdp_size=4: Accelerate shards the parameters over the dp_shard x cp ranks "
        "(its dp_shard_cp mesh)"
    ) in cfg.notes
    assert "mapped parallelism_config.parallelism_config_cp_size → model.context_parallel_size" in cfg.notes
    refusals = {
        "parallelism_config_sp_size": "'parallelism_config.parallelism_config_cp_size' = 2 with "
        "'parallelism_config.parallelism_config_sp_size' = 2 is not valid: Accelerate refuses context and sequence "
        "parallelism together; give one of them (natively model.context_parallel_size and model.ulysses_size compose)",
        "parallelism_config_dp_replicate_size": "'parallelism_config.parallelism_config_cp_size' = 2 is not valid with "
        "parallelism_config_dp_replicate_size > 1 and parallelism_config_dp_shard_size 1: Accelerate refuses context "
        "parallelism beside pure replication; set parallelism_config_dp_shard_size > 1 (HSDP)",
    }
    for key, message in refusals.items():
        written = {**sizes, "parallelism_config_dp_shard_size": 1, key: 2}
        path = write_yaml(tmp_path / "bad.yaml", {"distributed_type": "FSDP", "parallelism_config": written})
        assert load_error("examples/demo.yaml", strategy_file=str(path)) == f"{path}: {message}"
    path = write_yaml(tmp_path / "bad.yaml", {"parallelism_config": {"parallelism_config_cp_size": "2"}})
    assert load_error("examples/demo.yaml", strategy_file=str(path)) == (
        f"{path}: 'parallelism_config.parallelism_config_cp_size' = '2' is not valid: expected a whole number of "
        "ranks (1 or more)"
    )


@pytest.mark.parametrize(
    "top, fsdp_config, message",
    [
        (
            {"distributed_type": "DEEPSPEED"},
            {},
            "'distributed_type' = 'DEEPSPEED' is not valid: fsdp2kit reads "
            "Accelerate configs with distributed_type: FSDP",
        ),
        (
            {"mixed_precision": "fp8", "fp8_config": {"backend": "TE"}},
            {},
            "'fp8_config.backend' = TE: fsdp2kit trains mixed_precision fp8 with torchao only; set backend: AO "
            "(TransformerEngine and MS-AMP are not available)",
        ),
        (
            {"mixed_precision": "fp8"},
            {},
            "'fp8_config.backend' = not given: fsdp2kit trains mixed_precision fp8 with torchao only; set backend: AO "
            "(TransformerEngine and MS-AMP are not available)",
        ),
        (
            {"mixed_precision": "fp4"},
            {},
            "'mixed_precision' = 'fp4' is not valid: expected one of 'no', 'bf16', 'fp16' or 'fp8'",
        ),
        (
            {},
            {"fsdp_ofload_params": True},
            "unknown key 'fsdp_config.fsdp_ofload_params' (did you mean 'fsdp_config.fsdp_offload_params'?)",
        ),
        (
            {},
            {"fsdp_sharding_strategy": 7},
            "'fsdp_config.fsdp_sharding_strategy' = 7 is not valid: expected one of "
            "FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 "
            "(or their numbers 1-5)",
        ),
        (
            {},
            {"fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"},
            "'fsdp_config.fsdp_auto_wrap_policy' = SIZE_BASED_WRAP needs 'fsdp_config.fsdp_min_num_params' > 0",
        ),
    ],
)
def test_accelerate_mistakes_name_the_file_and_key(tmp_path, top, fsdp_config, message):
    path = write_yaml(tmp_path / "accelerate.yaml", {"distributed_type": "FSDP", "fsdp_config": fsdp_config, **top})
    assert load_error("examples/demo.yaml", strategy_file=str(path)) == f"{path}: {message}"


def trainer_config(tmp_path: Path, strategy_config: dict, **model) -> Path:
    return write_yaml(tmp_path / "job.yaml", {"model": model, "strategy_args": {"strategy_config": strategy_config}})


@pytest.mark.parametrize(
    "fsdp, expected",
    [
        ("full_shard auto_wrap offload", {"sharding_strategy": "FULL_SHARD", "offload_policy": True}),
        (["hybrid_shard_zero2", "auto_wrap"], {"sharding_strategy": "_HYBRID_SHARD_ZERO2", "offload_policy": False}),
        ("no_shard", {"sharding_strategy": "NO_SHARD", "offload_policy": False}),
        (True, {"sharding_strategy": None, "offload_policy": False}),
    ],
)
def test_trainer_fsdp_option_string(tmp_path, fsdp, expected):
    strategy = load_config(trainer_config(tmp_path, {"fsdp": fsdp})).strategy_args.strategy_config
    assert {key: getattr(strategy, key) for key in expected} == expected


def test_trainer_fsdp_config_without_prefix_and_its_conflicts(tmp_path):
    cfg = load_config(
        trainer_config(
            tmp_path, {"fsdp_config": {"version": 2, "cpu_offload": "true", "activation_checkpointing": True}}
        )
    )
    assert cfg.strategy_args.strategy_config.offload_policy is True
    assert cfg.model.gradient_checkpointing is True
    path = trainer_config(tmp_path, {"fsdp_config": {"activation_checkpointing": True}}, gradient_checkpointing=False)
    assert load_error(path) == (
        f"{path}: 'strategy_args.strategy_config.fsdp_config.activation_checkpointing' = True contradicts {path}: "
        "'model.gradient_checkpointing' = False (both set model.gradient_checkpointing); give only one of them"
    )
    path = trainer_config(tmp_path, {"fsdp": "full_shard shard_everything"})
    assert load_error(path) == (
        f"{path}: 'strategy_args.strategy_config.fsdp' = 'full_shard shard_everything' is not valid: unknown option "
        "'shard_everything'; options: full_shard, shard_grad_op, no_shard, hybrid_shard, hybrid_shard_zero2, "
        "offload, auto_wrap"
    )


# ---------------------------------------------------------------- the translation core


def test_translation_records_where_each_key_was_written_and_groups_ignored_keys():
    translation = Translation("job.yaml")
    where = Written("roll.yaml", "actor_train")
    apply_rules(
        translation,
        {"lr": 0.1, "a": 1, "b": 2, "section": {"x": 1}},
        {"lr": to("training.learning_rate"), "section": to("strategy_args.strategy_config")},
        where,
        otherwise=ignored(),
    )
    assert translation.config == {"training": {"learning_rate": 0.1}, "strategy_args": {"strategy_config": {"x": 1}}}
    assert translation.written_as("strategy_args.strategy_config.x") == ("roll.yaml", "actor_train.section.x")
    assert translation.written_as("model.dtype") == ("job.yaml", "model.dtype")
    assert translation.notes == [
        "mapped actor_train.lr → training.learning_rate",
        "mapped actor_train.section → strategy_args.strategy_config",
        "ignored (no FSDP2 meaning): actor_train.a, actor_train.b",
    ]


# ---------------------------------------------------------------- each reader's tool defaults, read from its code


def plan_of(cfg, ranks: int = 2) -> dict:
    from conftest import process_group

    from fsdp2kit.check import describe

    with process_group(ranks) as runtime:
        return describe(cfg, runtime)


@pytest.mark.parametrize("model, embeddings_group", [("builtin:tiny-llama", True), ("builtin:tiny-qwen3", False)])
def test_roll_gives_untied_embeddings_their_own_group(tmp_path, model, embeddings_group):
    """roll/utils/fsdp_utils.py apply_fsdp2 wraps every nn.Embedding of a model whose embeddings are not tied."""
    plan = plan_of(load_config(roll_file(tmp_path), [f"model.name_or_path={model}"]))
    assert ("model.embed_tokens" in plan["sharded_modules"]) is embeddings_group
    assert plan["mixed_precision"]["cast_forward_inputs"] is False


def test_mindspeed_class_paths_and_its_mesh_rule(tmp_path):
    path = write_yaml(
        tmp_path / "fsdp2_config.yaml",
        {"sharding_size": 1, "sub_modules_to_wrap": ["transformers.models.llama.modeling_llama.LlamaDecoderLayer"]},
    )
    cfg = load_config("examples/demo.yaml", strategy_file=str(path))
    assert cfg.strategy_args.strategy_config.wrap_policy.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    plan = plan_of(cfg, 4)
    assert plan["mesh"] == {"shape": [4, 1], "dim_names": ["ddp", "fsdp"]}  # sharding_size 1: replicate everywhere
    assert plan["sharded_modules"] == ["", *LAYERS]
    assert plan["prefetch"]["backward"] == 0  # MindSpeed-MM's default
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": 8})
    with pytest.raises(UserError) as error:
        plan_of(load_config("examples/demo.yaml", strategy_file=str(path)), 4)
    assert str(error.value).startswith("strategy_config.fsdp_size = 8 does not divide the world size 4")


def test_mindspeed_pins_offloaded_memory_by_default(tmp_path):
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": "auto", "offload_to_cpu": True})
    strategy = load_config("examples/demo.yaml", strategy_file=str(path)).strategy_args.strategy_config
    assert (strategy.offload_policy, strategy.pin_memory) == (True, True)


# ---------------------------------------------------------------- expert parallelism (issue 43)


def test_roll_expert_parallel_keys_are_the_native_ones_and_wrap_its_experts(tmp_path):
    """ROLL's ep_size/efsdp_size/moe_use_grouped_mm (fsdp2_strategy.py) are fsdp2kit's; with ep_size > 1 ROLL wraps
    wrap_policy.moe_experts (fsdp_utils.py apply_fsdp2), without it and the patch it does not (noted)."""
    experts = {"wrap_policy": {"moe_experts": ["Qwen3MoeExperts"]}}
    ep = {"ep_size": 2, "efsdp_size": 2, "moe_use_grouped_mm": True, **experts}
    cfg = load_config(roll_file(tmp_path, role_changes={"strategy_args": {"strategy_config": ep}}))
    strategy = cfg.strategy_args.strategy_config
    assert (strategy.ep_size, strategy.efsdp_size, strategy.moe_use_grouped_mm) == (2, 2, True)
    assert strategy.wrap_policy.moe_experts == ["Qwen3MoeExperts"]
    cfg = load_config(
        roll_file(
            tmp_path,
            role_changes={"strategy_args": {"strategy_config": {"ep_size": 1, "moe_use_grouped_mm": False, **experts}}},
        )
    )
    assert cfg.strategy_args.strategy_config.wrap_policy.moe_experts == []
    assert cfg.strategy_args.strategy_config.moe_use_grouped_mm is None  # ROLL's false: transformers' default
    assert (
        "ignored (ROLL wraps experts only with apply_expert_patch or ep_size > 1): "
        "actor_train.strategy_args.strategy_config.wrap_policy.moe_experts"
    ) in cfg.notes


MOE_MODULES = ["model.layers.{*}.mlp.experts"]


@pytest.mark.parametrize(
    ("keys", "efsdp_size", "note"),
    [
        (
            {"reshard_local_experts": False},
            1,
            "mapped reshard_local_experts=False → strategy_args.strategy_config.efsdp_size=1",
        ),
        (
            {},
            1,
            "reshard_local_experts=True: MindSpeed-MM shards each expert over the world / expert_parallel_size ranks "
            "that hold the same experts; fsdp2kit keeps efsdp_size 1",
        ),
    ],
)
def test_mindspeed_fsdp2_config_expert_parallel(tmp_path, keys, efsdp_size, note):
    """MindSpeed-MM's Fsdp2Config (base_model.py _init_ep_model): moe_modules split over expert_parallel_size ranks;
    reshard_local_experts (default true) shards them over the other world / ep ranks, false keeps them whole."""
    data = {"sharding_size": "auto", "expert_parallel_size": 2, "moe_modules": MOE_MODULES, **keys}
    cfg = load_config("examples/demo.yaml", strategy_file=str(write_yaml(tmp_path / "fsdp2_config.yaml", data)))
    strategy = cfg.strategy_args.strategy_config
    assert (strategy.ep_size, strategy.efsdp_size) == (2, efsdp_size)
    assert any(n.startswith(note) for n in cfg.notes), cfg.notes


def test_mindspeed_fsdp2_config_expert_parallel_without_modules_or_with_others(tmp_path):
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": "auto", "expert_parallel_size": 2})
    cfg = load_config("examples/demo.yaml", strategy_file=str(path))
    assert cfg.strategy_args.strategy_config.ep_size == 1
    assert "ignored (moe_modules lists no module: MindSpeed-MM splits none): expert_parallel_size" in cfg.notes
    data = {"sharding_size": "auto", "expert_parallel_size": 2, "moe_modules": ["model.layers.{*}.mlp"]}
    path = write_yaml(tmp_path / "fsdp2_config.yaml", data)
    assert load_error("examples/demo.yaml", strategy_file=str(path)) == (
        f"{path}: 'moe_modules' = 'model.layers.{{*}}.mlp' is not supported: fsdp2kit splits the fused experts of "
        "every MoE block (module paths ending in .experts, such as model.layers.{*}.mlp.experts)"
    )


NATIVE_MOE = "mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml"  # expert_parallel_size 1, an ep_plan


def native_moe(*changes: str):
    from test_real_configs import user_args

    config, swaps, _ = user_args(NATIVE_MOE, "tiny-qwen3.5-moe", 2)
    return load_config(config, [*swaps, *changes])


def test_native_mindspeed_expert_parallel():
    """MindSpeed-MM's native trainer (parallel_args.py, torch_parallelize.py apply_ep_modules): ep_plan.apply_modules
    split over expert_parallel_size ranks, sharded over expert_fully_shard_parallel_size (default world / ep)."""
    cfg = native_moe("parallel.expert_parallel_size=2", "parallel.expert_fully_shard_parallel_size=1")
    strategy, notes = cfg.strategy_args.strategy_config, "\n".join(cfg.notes)
    assert (strategy.ep_size, strategy.efsdp_size) == (2, 1)
    assert "parallel.ep_plan.dispatcher" in notes and "parallel.ep_plan.apply_modules: fsdp2kit splits" in notes
    cfg = native_moe("parallel.expert_parallel_size=2", "features.enable_ep_balance=true")
    notes = "\n".join(cfg.notes)
    assert "parallel.expert_fully_shard_parallel_size not given: MindSpeed-MM shards each expert" in notes
    assert "features.enable_ep_balance=True: MindSpeed-MM's load balancing" in notes
    off = native_moe()  # expert_parallel_size 1: the plan is unused, noted
    assert off.strategy_args.strategy_config.ep_size == 1
    assert any("parallel.ep_plan.apply_modules" in n and n.startswith("ignored (used only with") for n in off.notes)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "parallel.ep_plan.apply_efsdp_modules=[model.language_model.layers.0.mlp.experts]",
            "'parallel.ep_plan.apply_efsdp_modules' = ['model.language_model.layers.0.mlp.experts'] is not supported: "
            "fsdp2kit shards the experts it splits over the expert mesh, those of parallel.ep_plan.apply_modules; "
            "drop it",
        ),
        ("parallel.ep_plan.dispatchr=alltoall", "unknown key 'parallel.ep_plan.dispatchr' (did you mean "),
        (
            "parallel.ep_plan.dispatcher=ring",
            "'parallel.ep_plan.dispatcher' = 'ring' is not valid: expected alltoall, allgather or mc2",
        ),
    ],
)
def test_native_mindspeed_expert_parallel_mistakes_name_the_key(change, message):
    with pytest.raises(UserError) as error:
        native_moe("parallel.expert_parallel_size=2", change)
    assert message in str(error.value)


NATIVE_RING = "mindspeed_mm/examples/qwen3vl/qwen3vl_30B_config_v1.yaml"  # ring_attention_size: 1 as written


def native_ring(*changes: str):
    from test_real_configs import user_args

    config, swaps, _ = user_args(NATIVE_RING, "tiny-qwen3-vl-moe", 2)
    return load_config(config, [*swaps, *changes])


MINDSPEED_HYBRID = ["parallel.ulysses_parallel_size=null", "parallel.context_parallel_algo=hybrid_cp_algo"]


@pytest.mark.parametrize(
    ("changes", "sizes", "note"),
    [
        (
            ["parallel.ring_attention_size=2"],
            (1, 2),
            "mapped parallel.ring_attention_size → model.context_parallel_size",
        ),
        (  # older native files: context_parallel_size, the ring (ParallelArguments before ring_attention_size)
            ["parallel.ring_attention_size=null", "parallel.context_parallel_size=2"],
            (1, 2),
            "parallel.context_parallel_size: older files' name of ring_attention_size",
        ),
        (  # MindSpeed's context_parallel_algo beside it: split as MindSpeed splits it
            [
                "parallel.ring_attention_size=null",
                "parallel.ulysses_parallel_size=null",
                "parallel.context_parallel_size=2",
                "parallel.context_parallel_algo=ulysses_cp_algo",
            ],
            (2, 1),
            "parallel.context_parallel_algo='ulysses_cp_algo': parallel.context_parallel_size=2 read as "
            "model.ulysses_size",
        ),
        (
            ["parallel.ring_attention_size=null", "parallel.context_parallel_size=4"]
            + ["parallel.context_parallel_algo=megatron_cp_algo"],
            (1, 4),
            "parallel.context_parallel_algo='megatron_cp_algo': parallel.context_parallel_size=4 read as "
            "model.context_parallel_size",
        ),
        (
            ["parallel.ring_attention_size=null", "parallel.context_parallel_size=8", "parallel.ulysses_degree_in_cp=2"]
            + MINDSPEED_HYBRID,
            (2, 4),
            "mapped parallel.context_parallel_size=8 → model.ulysses_size=2 (parallel.ulysses_degree_in_cp) x "
            "model.context_parallel_size=4",
        ),
    ],
)
def test_native_mindspeed_context_parallel(changes, sizes, note):
    """Issue 48 (4): ring_attention_size is context parallel; the older context_parallel_size too, or with
    MindSpeed's context_parallel_algo as it splits it (mindspeed/arguments.py: ulysses, ring, or
    ulysses_degree_in_cp Ulysses ranks x the rest ring ranks)."""
    cfg = native_ring(*changes)
    assert (cfg.model.ulysses_size, cfg.model.context_parallel_size) == sizes
    assert note in cfg.notes


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            ["parallel.context_parallel_size=8", "parallel.ulysses_degree_in_cp=3"],
            "'parallel.ulysses_degree_in_cp' = 3 is not valid: it must divide 'parallel.context_parallel_size' = 8 "
            "and be smaller (MindSpeed's rule for hybrid context parallel); valid: 2, 4",
        ),
        (
            ["parallel.context_parallel_size=4", "parallel.ulysses_degree_in_cp=4"],
            "'parallel.ulysses_degree_in_cp' = 4 is not valid: it must divide 'parallel.context_parallel_size' = 4 "
            "and be smaller (MindSpeed's rule for hybrid context parallel); valid: 2",
        ),
        (
            ["parallel.context_parallel_size=4"],
            "'parallel.context_parallel_algo' = 'hybrid_cp_algo' needs 'parallel.ulysses_degree_in_cp', the Ulysses "
            "ranks of each context-parallel group (MindSpeed's rule); give a divisor of "
            "'parallel.context_parallel_size' = 4",
        ),
        (
            ["parallel.context_parallel_size=4", "parallel.context_parallel_algo=ring"],
            "'parallel.context_parallel_algo' = 'ring' is not valid: expected one of ulysses_cp_algo, "
            "megatron_cp_algo, hybrid_cp_algo, adaptive_cp_algo, hybrid_adaptive_cp_algo",
        ),
        (  # both spellings of the ring size, disagreeing
            [
                "parallel.ring_attention_size=2",
                "parallel.context_parallel_size=4",
                "parallel.context_parallel_algo=null",
            ],
            "'parallel.ring_attention_size' = 2 contradicts",
        ),
    ],
)
def test_native_mindspeed_context_parallel_mistakes_name_the_key(changes, message):
    with pytest.raises(UserError) as error:
        native_ring(*MINDSPEED_HYBRID, *changes)
    assert f"{REPO / 'tests/fixtures/real_configs' / NATIVE_RING}: {message}" in str(error.value)


def test_trainer_reads_fsdp1_keys_only_with_version_1(tmp_path):
    cfg = load_config(trainer_config(tmp_path, {"fsdp_config": {"backward_prefetch": "NO_PREFETCH"}}))
    assert cfg.strategy_args.strategy_config.num_to_backward_prefetch == 1  # version 2: not read
    assert (
        "ignored (TrainingArguments reads it only with version 1 (FSDP1)): "
        "strategy_args.strategy_config.fsdp_config.backward_prefetch"
    ) in cfg.notes
    cfg = load_config(trainer_config(tmp_path, {"fsdp_config": {"version": 1, "backward_prefetch": "NO_PREFETCH"}}))
    assert cfg.strategy_args.strategy_config.num_to_backward_prefetch == 0
    path = trainer_config(tmp_path, {"fsdp_config": "missing.json"})
    assert load_error(path) == f"{path}: 'strategy_args.strategy_config.fsdp_config' = 'missing.json': no such file"


def test_sft_query_key_and_a_list_of_files(tmp_path):
    from fsdp2kit.config.schema import DataConfig
    from fsdp2kit.data.dataset import PromptResponse, load_documents

    files = []
    for i, query in enumerate(["", "x = 1"]):
        files.append(tmp_path / f"part{i}.jsonl")
        files[-1].write_text(json.dumps({"instruction": f"task {i}", "input": query, "output": f"answer {i}"}) + "\n")
    data = DataConfig(
        source=[str(f) for f in files], prompt_key="instruction", query_key="input", response_key="output"
    )
    assert load_documents(data) == [PromptResponse("task 0", "answer 0"), PromptResponse("task 1\nx = 1", "answer 1")]


def test_warmup_ratio_is_a_share_of_the_runs_steps_rounded_up():
    from fsdp2kit.config.schema import TrainingConfig
    from fsdp2kit.train.optim import warmup_steps

    assert warmup_steps(TrainingConfig(warmup_ratio=0.1), 25) == 3
    assert warmup_steps(TrainingConfig(warmup_ratio=0.1, warmup_steps=5), 25) == 5


def test_class_paths_in_recompute_modules_stand_for_every_module_of_the_class(tmp_path):
    """MindSpeed's documented form (`package.module.DecoderLayer`) in any module pattern, matched by class name."""
    layer = "transformers.models.llama.modeling_llama.LlamaDecoderLayer"
    path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": "auto", "recompute_modules": [layer]})
    plan = plan_of(load_config("examples/demo.yaml", strategy_file=str(path)))
    assert plan["recompute_modules"] == LAYERS
    assert (
        plan_of(load_config("examples/demo.yaml", [f"strategy_args.strategy_config.ignored_modules=[{layer}]"]))[
            "ignored_modules"
        ]
        == LAYERS
    )


@pytest.mark.parametrize("dialect", ["roll", "mindspeed"])
def test_set_that_changes_the_key_which_implied_another_takes_the_implication_back(tmp_path, dialect):
    """ROLL and MindSpeed-MM pin offloaded memory: turning offload off with --set turns pinning off with it, said in
    a note, instead of an error about the pin_memory the user never wrote."""
    key = "strategy_args.strategy_config.offload_policy"
    if dialect == "roll":
        config = roll_file(tmp_path, role_changes={"strategy_args": {"strategy_config": {"offload_policy": True}}})
        cfg = load_config(config, [f"{key}=false"])
    else:
        path = write_yaml(tmp_path / "fsdp2_config.yaml", {"sharding_size": "auto", "offload_to_cpu": True})
        cfg = load_config("examples/demo.yaml", [f"{key}=false"], strategy_file=str(path))
    strategy = cfg.strategy_args.strategy_config
    assert (strategy.offload_policy, strategy.pin_memory) == (False, False)
    assert f"--set {key}=False: strategy_args.strategy_config.pin_memory no longer implied (True before)" in cfg.notes
    assert plan_of(cfg)["offload"] is False


def test_flash_attention_2_runs_as_transformers_choice_on_cpu_and_check_says_so(tmp_path):
    cfg = load_config("examples/demo.yaml", ["model.attn_implementation=flash_attention_2"])
    plan = plan_of(cfg)
    # Llama's: transformers picks sdpa where a family has it, which attends the demo's packed documents one by one
    assert plan["attn_implementation"] == "document_sdpa"
    note = "model.attn_implementation: flash_attention_2 needs CUDA; transformers' choice runs the same attention"
    assert note in plan["notes"]
