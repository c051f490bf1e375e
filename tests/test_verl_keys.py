"""verl's model, engine and actor settings as fsdp2kit runs them (integrations/verl_keys.py), without verl: its
configs are stood in for by objects with the fields and defaults of verl 0.9.1's dataclasses
(tests_verl/test_verl_keys.py holds the key tables to verl's own). The plan is read back from the sharded model on
the meta device, so what is asserted is what the engine builds, not what the translation meant."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import process_group, sharded_model

from fsdp2kit.config.load import validate
from fsdp2kit.errors import UserError
from fsdp2kit.integrations.verl_keys import (
    ACTOR_REFUSED,
    ACTOR_TRANSLATED,
    ACTOR_UNUSED,
    ENGINE_REFUSED,
    ENGINE_TRANSLATED,
    ENGINE_UNUSED,
    MODEL_REFUSED,
    MODEL_TRANSLATED,
    MODEL_UNUSED,
    job_config,
    refuse,
)

LAYERS = [f"model.layers.{i}" for i in range(4)]


def model_config(**fields):
    """verl's HFModelConfig as the trainer gives it, its defaults where `fields` says nothing."""
    defaults = {
        "path": "builtin:tiny-qwen3",
        "model_type": "language_model",
        "override_config": {"attn_implementation": "sdpa"},
        "enable_gradient_checkpointing": True,  # verl's default
        "tiled_mlp": {"enabled": False, "num_shards": 4},
        "lora_rank": 0,
        "mtp": SimpleNamespace(enable=False, enable_train=False),
    }
    return SimpleNamespace(**{**defaults, **fields})


def engine_config(**fields):
    defaults = {
        "forward_only": False,
        "ulysses_sequence_parallel_size": 1,
        "use_remove_padding": True,
        "model_dtype": "fp32",
        "mixed_precision": None,
        "seed": 42,
        "full_determinism": False,
        "router_replay": SimpleNamespace(mode="disabled"),
    }
    return SimpleNamespace(**{**defaults, **fields})


OPTIMIZER = SimpleNamespace(
    optimizer="AdamW",
    lr=1e-6,
    weight_decay=0.01,
    betas=(0.9, 0.999),
    clip_grad=1.0,
    total_training_steps=2,
    lr_warmup_steps=-1,
    lr_warmup_steps_ratio=0.0,
    lr_scheduler_type="constant",
    min_lr_ratio=0.0,
    num_cycles=0.5,
)


def plan_of(model, engine) -> dict:
    """The plan fsdp2kit builds (on the meta device) from verl's configs."""
    cfg = validate(job_config(model, engine, OPTIMIZER), "verl")
    training = cfg.strategy_args.strategy_name == "fsdp2_train"
    with process_group() as runtime:
        sharded = sharded_model(cfg, runtime, training=training, materialize=False)
    return {"recompute": sharded.plan.recompute_modules, "reentrant": cfg.strategy_args.strategy_config.use_reentrant}


def test_verl_s_default_recomputes_every_layer_non_reentrant_as_verl_s_engine():
    assert plan_of(model_config(), engine_config()) == {"recompute": LAYERS, "reentrant": False}


def test_verl_s_recompute_switched_off_and_the_forward_only_reference_recompute_nothing():
    assert plan_of(model_config(enable_gradient_checkpointing=False), engine_config())["recompute"] == []
    assert plan_of(model_config(), engine_config(forward_only=True))["recompute"] == []


def test_override_config_and_tiled_mlp_reach_the_model_and_strategy():
    model = model_config(
        override_config={"model_config": {"attn_implementation": "eager", "rope_theta": 5000.0}},
        tiled_mlp={"enabled": True, "num_shards": 2},
    )
    config = job_config(model, engine_config(), OPTIMIZER)
    assert config["model"]["attn_implementation"] == "eager"
    assert config["model"]["config"] == {"rope_theta": 5000.0}
    strategy = validate(config, "verl").strategy_args.strategy_config
    assert (strategy.apply_tiled_mlp, strategy.tiled_num_shards) == (True, 2)


@pytest.mark.parametrize(
    ("model", "engine", "named"),
    [
        ({"lora_rank": 8}, {}, "model.lora_rank"),
        ({"enable_activation_offload": True}, {}, "model.enable_activation_offload"),
        ({"use_liger": True}, {}, "model.use_liger"),
        ({"mtp": SimpleNamespace(enable=True, enable_train=True)}, {}, "model.mtp"),
        ({"hf_config_path": "/elsewhere"}, {}, "model.hf_config_path"),
        ({}, {"full_determinism": True}, "engine.full_determinism"),
        ({}, {"router_replay": SimpleNamespace(mode="R2")}, "engine.router_replay"),
    ],
)
def test_verl_settings_fsdp2kit_would_not_run_as_verl_are_refused_in_one_sentence(model, engine, named):
    with pytest.raises(UserError, match=named.replace(".", r"\.")) as error:
        job_config(model_config(**model), engine_config(**engine), OPTIMIZER)
    assert "\n" not in str(error.value)


def test_actor_settings_fsdp2kit_s_engine_cannot_answer_are_refused():
    refuse(SimpleNamespace(calculate_sum_pi_squared=False, qat=SimpleNamespace(enable=False)), ACTOR_REFUSED, "actor")
    with pytest.raises(UserError, match=r"actor\.calculate_sum_pi_squared"):
        refuse(SimpleNamespace(calculate_sum_pi_squared=True), ACTOR_REFUSED, "actor")
    with pytest.raises(UserError, match=r"actor\.qat"):
        refuse(SimpleNamespace(qat={"enable": True}), ACTOR_REFUSED, "actor")


@pytest.mark.parametrize(
    "tables",
    [
        (MODEL_TRANSLATED, MODEL_REFUSED, MODEL_UNUSED),
        (ENGINE_TRANSLATED, ENGINE_REFUSED, ENGINE_UNUSED),
        (ACTOR_TRANSLATED, ACTOR_REFUSED, ACTOR_UNUSED),
    ],
)
def test_each_verl_key_has_one_verdict(tables):
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys))
