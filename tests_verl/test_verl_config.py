"""`strategy: fsdp2kit` as a verl user writes it: verl's own PPO trainer config (trainer/config/ppo_trainer.yaml,
composed by Hydra as verl's main_ppo composes it) with fsdp2kit's config groups on the search path and
`model_engine=fsdp2kit` gives fsdp2kit's actor, reference and critic configs, from which verl's own TrainingWorker
builds fsdp2kit's engine — its data-parallel layout answered before `reset()`, as the worker's constructor asks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist
import verl
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from tiny_models import tiny_qwen2
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import FSDPOptimizerConfig, TrainingWorkerConfig
from verl.workers.engine_workers import TrainingWorker

from fsdp2kit.distributed import free_port
from fsdp2kit.errors import UserError
from fsdp2kit.integrations.verl import (
    Fsdp2kitActorConfig,
    Fsdp2kitCriticConfig,
    Fsdp2kitEngine,
    Fsdp2kitEngineConfig,
    job_config,
)

# The lines a verl user adds to verl's command line (docs/api.md).
USER_LINES = ["hydra.searchpath=[pkg://fsdp2kit.integrations.verl_config]", "model_engine=fsdp2kit"]


def ppo_config(tmp_path: Path, *extra: str):
    actor, critic = tiny_qwen2(tmp_path / "actor"), tiny_qwen2(tmp_path / "critic", critic=True)
    settings = [
        f"actor_rollout_ref.model.path={actor}",
        f"critic.model.path={critic}",
        "actor_rollout_ref.actor.use_dynamic_bsz=true",
        "critic.use_dynamic_bsz=true",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        *extra,
    ]
    with initialize_config_dir(config_dir=str(Path(verl.__file__).parent / "trainer/config"), version_base=None):
        return compose("ppo_trainer", overrides=[*USER_LINES, *settings])


def reference_config(config):
    """What verl's ActorRolloutRefWorker.init_model does to the reference's section before converting it."""
    ref = config.actor_rollout_ref.ref
    with open_dict(ref):
        ref.ppo_mini_batch_size = config.actor_rollout_ref.actor.ppo_mini_batch_size
        ref.ppo_micro_batch_size = ref.pop("log_prob_micro_batch_size", None)
        ref.ppo_micro_batch_size_per_gpu = ref.pop("log_prob_micro_batch_size_per_gpu", None)
        ref.use_dynamic_bsz = ref.pop("log_prob_use_dynamic_bsz", False)
        ref.ppo_max_token_len_per_gpu = ref.pop("log_prob_max_token_len_per_gpu", None)
    return omega_conf_to_dataclass(ref)


def test_model_engine_fsdp2kit_gives_fsdp2kit_s_configs(tmp_path):
    config = ppo_config(tmp_path, "actor_rollout_ref.actor.fsdp2kit.ulysses_sequence_parallel_size=2")
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    critic = omega_conf_to_dataclass(config.critic)
    reference = reference_config(config)
    assert isinstance(actor, Fsdp2kitActorConfig) and isinstance(reference, Fsdp2kitActorConfig)
    assert isinstance(critic, Fsdp2kitCriticConfig)
    for engine in (actor.engine, reference.engine, critic.engine):
        assert isinstance(engine, Fsdp2kitEngineConfig) and engine.strategy == "fsdp2kit"
    assert (actor.engine.forward_only, reference.engine.forward_only, critic.engine.forward_only) == (0, 1, 0)
    assert reference.engine.ulysses_sequence_parallel_size == actor.engine.ulysses_sequence_parallel_size == 2
    # verl's own optimizer config (optim/fsdp.yaml) reaches fsdp2kit: weight decay on every parameter
    model = omega_conf_to_dataclass(config.actor_rollout_ref.model)  # verl's worker sets it so
    training = job_config(model, actor.engine, actor.optim)["training"]
    assert training["weight_decay"] == 0.01 and training["weight_decay_every_parameter"]


def test_verl_s_training_worker_builds_fsdp2kit_s_engine(tmp_path, monkeypatch):
    config = ppo_config(tmp_path)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor.model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
    port = free_port()
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)
    dist.init_process_group("gloo")
    try:
        worker = TrainingWorker(
            TrainingWorkerConfig(
                model_type="language_model",
                model_config=actor.model_config,
                engine_config=actor.engine,
                optimizer_config=actor.optim,
                checkpoint_config=actor.checkpoint,
            )
        )
        # the constructor asked for the data-parallel layout before reset() builds the model
        assert isinstance(worker.engine, Fsdp2kitEngine)
        assert (worker.engine.get_data_parallel_rank(), worker.engine.is_mp_src_rank_with_outputs()) == (0, True)
        worker.engine.optimizer_config.total_training_steps = 2  # verl's trainer sets it from the data
        worker.reset()
        assert worker.engine.get_data_parallel_size() == 1 and worker.engine.strategy.optimizer is not None
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("engine", "optimizer", "named"),
    [
        ({"mixed_precision": {"buffer_dtype": "bf16"}}, {}, "mixed_precision.buffer_dtype"),
        ({}, {"optimizer_impl": "torchao.optim", "optimizer": "AdamW"}, "optim.optimizer_impl"),
        ({}, {"lr_scheduler_type": "cosine", "zero_indexed_step": False}, "optim.zero_indexed_step"),
    ],
)
def test_settings_fsdp2kit_would_apply_differently_are_refused(tmp_path, engine, optimizer, named):
    model = tiny_qwen2(tmp_path / "actor")
    model_config = type("ModelConfig", (), {"path": str(model), "model_type": "language_model"})()
    with pytest.raises(UserError, match=named.replace(".", r"\.")):
        job_config(
            model_config, Fsdp2kitEngineConfig(**engine), FSDPOptimizerConfig(total_training_steps=2, **optimizer)
        )
