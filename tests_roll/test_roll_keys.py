"""Every key of ROLL's own role config (WorkerConfig, its ModelArguments and StrategyArguments) and every
strategy_config key ROLL's FSDP2 strategy reads has a rule in fsdp2kit's ROLL dialect (translated, refused or noted):
a key ROLL adds fails here until it is handled. ROLL's defaults the dialect writes in are ROLL's own, and its
training_args give the learning rate per step that ROLL's FSDP2 strategy's scheduler gives."""

from __future__ import annotations

import dataclasses
import inspect
import re
from types import SimpleNamespace

import pytest
import torch
from roll_scaffold import pipeline_config
from test_roll_real import ROLL_SOURCE
from transformers import AutoConfig

from fsdp2kit.config.dialects import roll as dialect
from fsdp2kit.config.load import load_config
from fsdp2kit.config.schema import StrategyConfig
from fsdp2kit.integrations.roll import worker_arguments
from fsdp2kit.train.optim import build_scheduler

# Where ROLL's FSDP2 strategy reads its strategy_config (a free-form dict, so its keys are read from the code).
STRATEGY_SOURCES = ("roll/distributed/strategy/fsdp2_strategy.py", "roll/utils/fsdp_utils.py")


@pytest.fixture(scope="module")
def roll_configs(tmp_path_factory):
    """ROLL's config dataclasses (importing them starts ROLL's logger, which writes ./output/logs: in a tmp dir)."""
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.chdir(tmp_path_factory.mktemp("roll"))
    monkeypatch.syspath_prepend(str(ROLL_SOURCE))
    try:
        from roll.configs.model_args import ModelArguments
        from roll.configs.worker_config import StrategyArguments, WorkerConfig
        from roll.distributed.strategy.fsdp2_strategy import FSDP2TrainStrategy
        from roll.models import model_providers

        yield {
            "model_args": ModelArguments,
            "strategy_args": StrategyArguments,
            "role": WorkerConfig,
            "providers": model_providers,
            "fsdp2_train": FSDP2TrainStrategy,
        }
    finally:
        monkeypatch.undo()


def field_names(cls: type) -> set[str]:
    return {field.name for field in dataclasses.fields(cls)}


def test_every_field_of_roll_s_role_config_has_a_rule(roll_configs):
    assert field_names(roll_configs["role"]) - set(dialect.ROLE) == set()
    assert field_names(roll_configs["model_args"]) - set(dialect.MODEL_ARGS) == set()
    assert field_names(roll_configs["strategy_args"]) - set(dialect.STRATEGY_ARGS) == set()


def test_every_strategy_config_key_roll_s_fsdp2_strategy_reads_has_a_rule():
    code = "\n".join((ROLL_SOURCE / path).read_text() for path in STRATEGY_SOURCES)
    read = set(re.findall(r"strategy_config(?:\.get\(|\[)\"(\w+)\"", code))
    read |= set(re.findall(r"\bconfig\.get\(\"(\w+)\"", code))  # fsdp_utils.apply_fsdp2(config=strategy_config)
    wrap_policy = set(re.findall(r"get\(\"wrap_policy\", \{\}\)\.get\(\s*\"(\w+)\"", code))
    assert {"param_dtype", "wrap_policy", "offload_policy"} <= read and "wrap_embeddings" in wrap_policy
    # a key without a dialect rule is taken as fsdp2kit's own key of that name, which must then exist
    assert read - set(dialect.STRATEGY_CONFIG_RULES) - set(StrategyConfig.model_fields) == set()
    assert wrap_policy - set(dialect.WRAP_POLICY_RULES) == set()


def test_roll_s_defaults_the_dialect_writes_in_are_roll_s(roll_configs):
    model_args = roll_configs["model_args"]()
    train_defaults = dialect._role_defaults("fsdp2_train", {})["model_args"]
    assert train_defaults == {
        "dtype": model_args.dtype,
        "disable_gradient_checkpointing": model_args.disable_gradient_checkpointing,
        "gradient_checkpointing_use_reentrant": False,  # ROLL's None, as ROLL resolves it for a dense model:
    }
    assert model_args.gradient_checkpointing_use_reentrant is None
    providers = roll_configs["providers"]
    assert "use_reentrant = True if _is_moe_config(config) else False" in inspect.getsource(providers)
    assert not providers._is_moe_config(AutoConfig.for_model("qwen2"))


# ROLL's pipeline-wide optimizer steps (set_max_steps' figure), and the data-parallel size whose share (12) each
# worker's schedule runs over
PIPELINE_STEPS, DP_SIZE = 24, 2


def stepped_rates(optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LRScheduler) -> list[float]:
    """The learning rate each optimizer step of a worker's schedule runs at."""
    rates = []
    for _ in range(PIPELINE_STEPS // DP_SIZE):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def roll_rates(strategy_class: type, worker: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """ROLL's own FSDP2TrainStrategy.initialize on a one-parameter model: its AdamW and the scheduler it builds with
    transformers' get_scheduler from training_args (warmup_steps, else warmup_ratio of its share of max_steps); the
    model's build and sharding, which the schedule does not read, stand aside."""
    strategy = strategy_class(worker)
    model = torch.nn.Linear(1, 1)
    strategy._prepare_fsdp2_model = lambda *_, **__: (model, torch.float32, None)
    strategy.setup_fsdp2_configuration = lambda: None
    strategy.initialize_fsdp2_model = lambda built: setattr(strategy, "model", built)
    strategy.ep_enabled, strategy.param_dtype = False, torch.float32
    monkeypatch.setattr(torch.distributed, "barrier", lambda *_, **__: None)
    strategy.initialize(model_provider=None)
    return stepped_rates(strategy.optimizer, strategy.scheduler)


def fsdp2kit_rates(worker: SimpleNamespace) -> list[float]:
    """fsdp2kit's schedule from the config RollStrategy.initialize builds its Strategy from."""
    source, role, overrides, written = worker_arguments(worker)
    training = load_config(source, list(overrides), role, written=written).training
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=training.learning_rate)
    return stepped_rates(optimizer, build_scheduler(optimizer, training, max(1, training.max_steps)))


@pytest.mark.parametrize(
    "training_args",
    [
        {"lr_scheduler_type": "linear", "warmup_steps": 3},
        {"lr_scheduler_type": "linear", "warmup_ratio": 0.3},  # 3.6 warmup steps, rounded up as ROLL does
        {"lr_scheduler_type": "cosine", "warmup_steps": 3},
        {"lr_scheduler_type": "cosine", "warmup_ratio": 0.2},
        {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 4},
        {"lr_scheduler_type": "constant", "warmup_steps": 4},  # HF's constant: no warmup at all
    ],
)
def test_fsdp2kit_s_learning_rate_per_step_is_roll_s_fsdp2_strategy_s(
    roll_configs, tmp_path, monkeypatch, training_args
):
    """Issue 63 (2): the schedule of a ROLL worker on fsdp2kit, step by step, against the one ROLL's FSDP2 strategy
    builds from the same RLVRConfig (its share of the pipeline's max_steps at DP_SIZE ranks)."""
    pipeline = pipeline_config(str(tmp_path / "model"), str(tmp_path / "out"), DP_SIZE, learning_rate=1e-3)
    arguments = pipeline.actor_train.training_args
    for key, value in {**training_args, "max_steps": PIPELINE_STEPS}.items():
        setattr(arguments, key, value)
    worker = SimpleNamespace(
        pipeline_config=pipeline, worker_config=pipeline.actor_train, rank_info=SimpleNamespace(dp_size=DP_SIZE)
    )
    ours = fsdp2kit_rates(worker)  # first: ROLL's initialize divides training_args.max_steps in place
    assert ours == roll_rates(roll_configs["fsdp2_train"], worker, monkeypatch)
