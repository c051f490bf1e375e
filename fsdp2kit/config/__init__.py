"""Config: the native schema, YAML loading with `--set` overrides, and foreign dialects."""

from fsdp2kit.config.load import load_config
from fsdp2kit.config.schema import DataConfig, JobConfig, ModelConfig, StrategyConfig, TrainingConfig

__all__ = ["DataConfig", "JobConfig", "ModelConfig", "StrategyConfig", "TrainingConfig", "load_config"]
