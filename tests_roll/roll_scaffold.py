"""Test scaffolding that lets ROLL's own worker code run in one process per rank on the CPU, as a ROLL user's Ray
cluster would run it: ROLL's shared key-value store (a Ray actor) is a dict here, its rendezvous port the one the
test gives, and the CPU platform ROLL picks without a GPU (roll/platforms/cpu.py, which falls back to `torch.cpu`)
gets the few device calls its FSDP2 strategy makes (empty_cache, memory counters, the RNG). Nothing of ROLL is
changed: only these Ray/platform pieces, which ROLL reaches through objects it holds."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import yaml

HERE = Path(__file__).parent
_STORE: dict[str, Any] = {}


def _method(function: Any) -> SimpleNamespace:
    return SimpleNamespace(remote=function)


class _Storage:
    put = _method(lambda key, data: _STORE.__setitem__(key, data))
    put_if_absent = _method(lambda key, data: _STORE.setdefault(key, data) is data)
    get = _method(lambda key: _STORE.get(key))


class SharedStorage:
    """ROLL's `roll.distributed.scheduler.storage.SharedStorage` actor, in-process."""

    @staticmethod
    def options(**_: Any) -> SimpleNamespace:
        return SimpleNamespace(remote=lambda: _Storage())


def install() -> None:
    """The Ray and platform pieces above, before any ROLL worker is built."""
    import ray
    import roll.distributed.executor.worker as worker_module
    import roll.utils.checkpoint_manager as checkpoint_module
    from roll.platforms import current_platform

    worker_module.SharedStorage = SharedStorage
    checkpoint_module.SharedStorage = SharedStorage
    ray.get = lambda value, **_: value  # the stand-ins above return values, not object refs
    # Ray's cluster gives every rank rank 0's address; here the test does
    worker_module.Worker.get_free_port = lambda self: int(os.environ["MASTER_PORT"])
    worker_module.Worker.get_node_ip = lambda self: "127.0.0.1"
    platform = {
        "empty_cache": lambda: None,
        "synchronize": lambda *_: None,
        "memory_allocated": lambda *_: 0,
        "memory_reserved": lambda *_: 0,
        "max_memory_allocated": lambda *_: 0,
        "max_memory_reserved": lambda *_: 0,
        "reset_peak_memory_stats": lambda *_: None,
        "reset_max_memory_allocated": lambda *_: None,
        "reset_max_memory_cached": lambda *_: None,
        "device_memory_used": lambda *_: 0,
        "mem_get_info": lambda *_: (0, 0),
        "get_rng_state": torch.get_rng_state,
        "set_rng_state": torch.set_rng_state,
        "current_device": lambda: torch.device("cpu"),
        "set_device": lambda *_: None,
        "manual_seed_all": lambda *_: None,
    }
    for name, function in platform.items():
        setattr(current_platform, name, function)


def pipeline_config(
    model_dir: str,
    output_dir: str,
    ranks: int,
    learning_rate: float = 1e-2,
    actor_strategy: dict | None = None,
    actor_model_args: dict | None = None,
) -> Any:
    """ROLL's RLVRConfig read from tests_roll/rlvr_tiny.yaml as ROLL's launcher reads a YAML (dacite over the
    dict) and its RLVR pipeline completes it, on `ranks` ranks per role; `actor_strategy` and `actor_model_args` add
    keys to the actor's strategy_config and model_args."""
    from dacite import from_dict
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig

    text = (HERE / "rlvr_tiny.yaml").read_text()
    text = text.replace("MODEL_DIR", model_dir).replace("OUTPUT_DIR", output_dir).replace("RANKS", str(ranks))
    raw = yaml.safe_load(text)
    raw["actor_train"]["training_args"]["learning_rate"] = learning_rate
    raw["actor_train"]["strategy_args"]["strategy_config"].update(actor_strategy or {})
    raw["actor_train"]["model_args"].update(actor_model_args or {})
    config = from_dict(data_class=RLVRConfig, data=raw)
    config.set_max_steps(max_steps=config.max_steps)  # as roll/pipeline/rlvr/rlvr_pipeline.py does
    return config


# The tiny models' common shape: 2 layers of 64, a 512-token vocabulary, untied head
TINY_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def tiny_qwen2(folder: Path) -> Path:
    """A seeded 2-layer Qwen2 (hidden 64) with fsdp2kit's built-in tokenizer, and its critic (a token classifier
    of one label, as ROLL's value model provider loads it) in folder/critic."""
    import shutil

    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

    from fsdp2kit.data.builtin import tokenizer_dir

    config = Qwen2Config(
        **TINY_SHAPE,
        num_labels=1,
        classifier_dropout=0.0,  # transformers' default 0.1 would make the two critics' training differ by chance
    )
    for model_class, where in ((Qwen2ForCausalLM, folder), (Qwen2ForTokenClassification, folder / "critic")):
        torch.manual_seed(3)
        model_class(config).save_pretrained(where)
        for file in tokenizer_dir().iterdir():
            shutil.copy(file, where / file.name)
    return folder


def tiny_qwen3_moe(folder: Path) -> Path:
    """A seeded 2-layer Qwen3-MoE (hidden 64; 4 fused experts, 2 per token) with fsdp2kit's built-in tokenizer."""
    import shutil

    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fsdp2kit.data.builtin import tokenizer_dir

    config = Qwen3MoeConfig(**TINY_SHAPE, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, head_dim=16)
    torch.manual_seed(3)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, folder / file.name)
    return folder
