"""Every field of verl's own config dataclasses has a verdict in fsdp2kit (integrations/verl_keys.py): translated,
refused unless at verl's default, or not part of the computation. A field verl adds fails here until it is handled;
and verl's own defaults (HFModelConfig's recompute among them) give the run verl's engine would run, and verl's
optimizer settings the learning rate per step that verl's FSDP engine's scheduler gives."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

import pytest
import torch
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
from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

from fsdp2kit.config.load import validate
from fsdp2kit.integrations import verl_keys
from fsdp2kit.integrations.verl import Fsdp2kitActorConfig, Fsdp2kitCriticConfig, Fsdp2kitEngineConfig, job_config
from fsdp2kit.train.optim import build_scheduler


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


def test_every_field_of_verl_s_fsdp_optimizer_config_has_a_verdict():
    assert names(FSDPOptimizerConfig) == verdicts(verl_keys.OPTIMIZER_TRANSLATED, verl_keys.OPTIMIZER_REFUSED)


def stepped_rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> list[float]:
    """The learning rate each of the schedule's steps runs at (verl steps the scheduler once per training step)."""
    rates = []
    for _ in range(SCHEDULE_STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def one_parameter(lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


SCHEDULE_STEPS = 12


@pytest.mark.parametrize(
    "settings",
    [
        {"lr_scheduler_type": "constant", "lr_warmup_steps": 4},  # issue 63: verl's 0, 2.5e-4, 5e-4, 7.5e-4, then 1e-3
        {"lr_scheduler_type": "constant", "lr_warmup_steps_ratio": 0.3, "min_lr_ratio": 0.5},  # constant reads no floor
        {"lr_scheduler_type": "cosine", "lr_warmup_steps": 3},
        {"lr_scheduler_type": "cosine", "lr_warmup_steps": 3, "min_lr_ratio": 0.1},
        {"lr_scheduler_type": "cosine", "lr_warmup_steps_ratio": 0.25, "min_lr_ratio": 0.2, "num_cycles": 1.0},
        {"lr_scheduler_type": "cosine", "num_cycles": 0.75},
    ],
)
def test_fsdp2kit_s_learning_rate_per_step_is_verl_s_fsdp_engine_s(tmp_path, settings):
    """Issue 63 (2): verl's schedules warm up from 0 and its cosine ends at min_lr_ratio over num_cycles; fsdp2kit's
    verl engine warmed up one step ahead and refused the cosine's settings. verl's side is its FSDP engine's own
    `_build_lr_scheduler` (it reads only the optimizer config); fsdp2kit's the config job_config translates."""
    optim = FSDPOptimizerConfig(lr=1e-3, total_training_steps=SCHEDULE_STEPS, **settings)
    optimizer = one_parameter(optim.lr)
    verl_scheduler = FSDPEngine._build_lr_scheduler(SimpleNamespace(optimizer_config=optim, rank=1), optimizer)
    verl = stepped_rates(optimizer, verl_scheduler)
    model = SimpleNamespace(path=str(tmp_path), model_type="language_model")
    training = validate(job_config(model, Fsdp2kitEngineConfig(), optim), "verl").training
    optimizer = one_parameter(training.learning_rate)
    assert stepped_rates(optimizer, build_scheduler(optimizer, training, training.max_steps)) == verl


def test_verl_s_default_model_config_recomputes_every_layer(tmp_path):
    model = HFModelConfig(path=str(tiny_qwen2(tmp_path / "actor")), override_config={"attn_implementation": "sdpa"})
    assert model.enable_gradient_checkpointing  # verl's default, which its FSDP engine applies
    config = job_config(model, Fsdp2kitEngineConfig(), FSDPOptimizerConfig(total_training_steps=2))
    assert config["model"]["gradient_checkpointing"] is True
    assert config["strategy_args"]["strategy_config"]["use_reentrant"] is False
