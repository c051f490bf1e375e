"""ROLL's FSDP2 example configs in the snapshot, as ROLL publishes them, read by fsdp2kit's ROLL dialect: every role
that names ROLL's FSDP2 strategy becomes a native config (nothing is built: the models are ROLL's 3B-32B ones)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from test_roll_real import ROLL_SOURCE

from fsdp2kit.config.load import load_config
from fsdp2kit.errors import UserError

EXAMPLES = ROLL_SOURCE / "examples"
# Files in ROLL's *fsdp2* example folders that fsdp2kit refuses, and the sentence it refuses them with (the
# expert-parallel ones read: tests/test_real_configs.py plans and trains them).
REFUSED = {"qwen3-30BA3B-agentic_fsdp2/agentic_val_sokoban_30a3.yaml": "is a Hydra defaults list"}
EXPERT_PARALLEL = ("rlvr_config_ep.yaml", "sft_config_ep.yaml")


def fsdp2_roles(path: Path) -> list[str]:
    raw = yaml.safe_load(path.read_text())
    strategies = {name: ((role.get("strategy_args") or {}).get("strategy_name")) for name, role in raw.items()
                  if isinstance(role, dict)}  # fmt: skip
    return [name for name, strategy in strategies.items() if strategy in ("fsdp2_train", "fsdp2_infer")]


NAMED = sorted(EXAMPLES.glob("**/*fsdp2*.yaml"))
# and the other files of ROLL's *fsdp2* example folders that run its FSDP2 strategy (not its megatron ones)
IN_FOLDERS = sorted(path for path in set(EXAMPLES.glob("*fsdp2*/*.yaml")) - set(NAMED) if fsdp2_roles(path))


def test_the_snapshot_has_rolls_fsdp2_examples():
    assert len(NAMED) == 6 and len(IN_FOLDERS) == 9


@pytest.mark.parametrize("path", NAMED + IN_FOLDERS, ids=lambda path: str(path.relative_to(EXAMPLES)))
def test_rolls_fsdp2_example_reads_as_written(path):
    roles = fsdp2_roles(path)
    refusal = REFUSED.get(str(path.relative_to(EXAMPLES)))
    for role in roles:
        if refusal is None:
            cfg = load_config(path, role=role)
            assert cfg.model.name_or_path
            assert (cfg.strategy_args.strategy_config.ep_size == 8) is (path.name in EXPERT_PARALLEL)
        else:
            with pytest.raises(UserError, match=refusal.replace("(", r"\(").replace(")", r"\)")):
                load_config(path, role=role)
