"""Fresh weights (no folder): `initialise_weights` gives each tensor what transformers' own `from_config` gives it
(the same distribution, the same buffers), module by module on the meta-built model, including where transformers'
`initialize_weights` does more than call the top model's `_init_weights` on each module: a sub-model initialised by
its own class (Kimi-K2.5's stand-in wraps a transformers Qwen3-MoE), a parent that initialises its children (Qwen3.5-
MoE's MoE block writes its router's weight). A tensor no init writes is refused, never left as whatever memory held."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from transformers import AutoConfig, PretrainedConfig, PreTrainedModel

from fsdp2kit.errors import UserError
from fsdp2kit.models.build import initialise_weights
from fsdp2kit.models.builtin import BUILTIN_MODELS
from fsdp2kit.models.vl import auto_model_class

KIMI = Path(__file__).parent / "fixtures/remote_code/kimi_k25"


def built_config(name: str) -> Any:
    if name == "kimi stand-in":
        return AutoConfig.from_pretrained(KIMI, trust_remote_code=True)
    settings = dict(BUILTIN_MODELS[name])
    return AutoConfig.for_model(settings.pop("model_type"), **settings)


def model_class(config: Any) -> Any:
    if getattr(config, "auto_map", None):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM
    return auto_model_class(config)


def assert_like_transformers(name: str, got: torch.Tensor, expected: torch.Tensor) -> None:
    """A constant (norms' ones, biases' zeros, computed buffers) exactly; a random tensor of 256 values or more by
    its mean and standard deviation (6 standard errors; a quarter of the deviation)."""
    assert not got.isnan().any(), name
    if expected.numel() < 2 or not expected.is_floating_point() or expected.std() == 0:
        torch.testing.assert_close(got, expected, atol=0, rtol=0, msg=name)
    elif expected.numel() >= 256:
        std, mean = expected.float().std().item(), expected.float().mean().item()
        assert got.float().std().item() == pytest.approx(std, rel=0.25), name
        assert got.float().mean().item() == pytest.approx(mean, abs=6 * std / got.numel() ** 0.5), name


@pytest.mark.parametrize("name", [*BUILTIN_MODELS, "kimi stand-in"])
def test_fresh_weights_follow_transformers_init(name):
    config = built_config(name)
    auto = model_class(config)
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, trust_remote_code=True)
    model.to_empty(device="cpu")
    initialise_weights(model, seed=0)
    torch.manual_seed(0)
    reference = auto.from_config(config, dtype=torch.float32, trust_remote_code=True)
    expected = dict(reference.named_parameters(remove_duplicate=False)) | dict(reference.named_buffers())
    got = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    assert sorted(got) == sorted(expected)
    for key, tensor in expected.items():
        assert_like_transformers(key, got[key].detach(), tensor.detach())


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))  # a parameter no `_init_weights` knows


class _Model(PreTrainedModel):
    config_class = PretrainedConfig

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        self.proj = nn.Linear(4, 4)
        self.extra = _Extra()
        self.post_init()


def test_a_tensor_no_init_writes_is_refused():
    with torch.device("meta"):
        model = _Model(PretrainedConfig())
    model.to_empty(device="cpu")
    with pytest.raises(UserError, match=r"_Model's _init_weights leaves 'extra.scale' uninitialised"):
        initialise_weights(model, seed=0)
    initialise_weights(model, seed=0, only={id(model.proj.weight)})  # what a folder lacked: the one that has an init
