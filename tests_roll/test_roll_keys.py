"""Every key of ROLL's own role config (WorkerConfig, its ModelArguments and StrategyArguments) and every
strategy_config key ROLL's FSDP2 strategy reads has a rule in fsdp2kit's ROLL dialect (translated, refused or noted):
a key ROLL adds fails here until it is handled. ROLL's defaults the dialect writes in are ROLL's own."""

from __future__ import annotations

import dataclasses
import inspect
import re

import pytest
from test_roll_real import ROLL_SOURCE
from transformers import AutoConfig

from fsdp2kit.config.dialects import roll as dialect
from fsdp2kit.config.schema import StrategyConfig

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
        from roll.models import model_providers

        yield {
            "model_args": ModelArguments,
            "strategy_args": StrategyArguments,
            "role": WorkerConfig,
            "providers": model_providers,
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
