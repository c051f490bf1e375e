"""Every field of verl's own config dataclasses has a verdict in fsdp2kit (integrations/verl_keys.py): translated,
refused unless at verl's default, or not part of the computation. A field verl adds fails here until it is handled;
and verl's own defaults (HFModelConfig's recompute among them) give the run verl's engine would run."""

from __future__ import annotations

from dataclasses import fields

from tiny_models import tiny_qwen2
from verl.workers.config import (
    ActorConfig,
    CriticConfig,
    EngineConfig,
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
)

from fsdp2kit.integrations import verl_keys
from fsdp2kit.integrations.verl import Fsdp2kitActorConfig, Fsdp2kitCriticConfig, Fsdp2kitEngineConfig, job_config


def names(*classes: type) -> set[str]:
    return {field.name for cls in classes for field in fields(cls) if not field.name.startswith("_")}


def verdicts(*tables: dict) -> set[str]:
    keys = [key for table in tables for key in table]
    assert len(keys) == len(set(keys)), "a key with two verdicts"
    return set(keys)


def test_every_field_of_verl_s_model_config_has_a_verdict():
    assert names(HFModelConfig) == verdicts(verl_keys.MODEL_TRANSLATED, verl_keys.MODEL_REFUSED, verl_keys.MODEL_UNUSED)


def test_every_field_of_verl_s_engine_configs_has_a_verdict():
    assert names(EngineConfig) <= names(Fsdp2kitEngineConfig)
    assert names(Fsdp2kitEngineConfig) == verdicts(
        verl_keys.ENGINE_TRANSLATED, verl_keys.ENGINE_REFUSED, verl_keys.ENGINE_UNUSED
    )
    assert names(FSDPEngineConfig) - names(Fsdp2kitEngineConfig) == set(verl_keys.FSDP_ENGINE_ONLY)


def test_every_field_of_verl_s_actor_and_critic_configs_has_a_verdict():
    ours = names(ActorConfig, CriticConfig, Fsdp2kitActorConfig, Fsdp2kitCriticConfig)
    assert ours == verdicts(verl_keys.ACTOR_TRANSLATED, verl_keys.ACTOR_REFUSED, verl_keys.ACTOR_UNUSED)
    assert names(FSDPActorConfig, FSDPCriticConfig) - ours == set(verl_keys.FSDP_ROLE_ONLY)


def test_verl_s_default_model_config_recomputes_every_layer(tmp_path):
    model = HFModelConfig(path=str(tiny_qwen2(tmp_path / "actor")), override_config={"attn_implementation": "sdpa"})
    assert model.enable_gradient_checkpointing  # verl's default, which its FSDP engine applies
    config = job_config(model, Fsdp2kitEngineConfig(), FSDPOptimizerConfig(total_training_steps=2))
    assert config["model"]["gradient_checkpointing"] is True
    assert config["strategy_args"]["strategy_config"]["use_reentrant"] is False
