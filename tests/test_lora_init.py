"""LoRA adapters built on the meta device start where peft starts them (issue 63): every layer type fsdp2kit lets
peft build — embeddings (bare parameters, not modules: they kept the meta build's memory and trained on NaN),
linear layers, 3-D convolutions, MoE fused experts (`ParamWrapper`), modules to save — as peft's `update_layer`
makes them on a normally built CPU model with the same config, each layer seeded by its name (fsdp2kit's rule: the
same at any world size); and adapter folders with DoRA magnitudes or `lora_bias` as `PeftModel.from_pretrained`
reads them. An embedding adapter trains (finite gradient norms, a falling loss) at 1 and 2 ranks alike."""

from __future__ import annotations

import copy
import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import launch_two_ranks, make_hf_folder, process_group, sharded_model
from lora_worker import train
from packaging.version import Version
from test_lora_moe import peft_adapter
from zoo_case import FAMILIES, family_folder

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.distributed import shutdown
from fsdp2kit.models.build import resolve_model
from fsdp2kit.models.lora import ADAPTER, adapter_modules, full_tensor, peft_config, peft_state
from fsdp2kit.models.shards import module_seed
from fsdp2kit.models.vl import auto_model_class

LLAMA, MOE, VL = "tiny-llama", "qwen3_moe", "builtin:tiny-qwen2.5-vl"
Lora = Callable[[Path], dict[str, Any]]


def section(**settings: Any) -> Lora:
    return lambda folder: {"rank": 4, "alpha": 8, **settings}


# case -> (model, what model.lora says, the first peft release that builds the layer type, a key it makes)
CASES: dict[str, tuple[str, Lora, str, str]] = {
    "embedding": (LLAMA, section(target_modules=["embed_tokens"]), "0.12", "embed_tokens.lora_embedding_A"),
    "embedding-fresh-base": (
        "builtin:tiny-llama",
        section(target_modules=["embed_tokens"]),
        "0.12",
        "embed_tokens.lora_embedding_B",
    ),
    "embedding-and-linear-random": (
        LLAMA,
        section(target_modules=["embed_tokens", "q_proj"], init_lora_weights=False),
        "0.12",
        "q_proj.lora_B.weight",
    ),
    "all-linear-gaussian-modules-to-save": (
        LLAMA,
        section(init_lora_weights="gaussian", modules_to_save=["lm_head"]),
        "0.12",
        "lm_head.",
    ),
    "moe-fused-experts": (MOE, section(), "0.17", "mlp.experts.base_layer.lora_A.weight"),
    "conv3d": (VL, section(target_modules=["patch_embed.proj"]), "0.13", "patch_embed.proj.lora_A.weight"),
    "dora-adapter": (
        LLAMA,
        peft_adapter(target_modules=["embed_tokens", "q_proj", "v_proj"], use_dora=True),
        "0.13",
        "embed_tokens.lora_magnitude_vector",
    ),
    "lora-bias-adapter": (
        LLAMA,
        peft_adapter(target_modules=["q_proj", "o_proj"], lora_bias=True),
        "0.14",
        "o_proj.lora_B.bias",
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora_init")
    make_hf_folder(root / LLAMA, LLAMA)
    return {LLAMA: root / LLAMA, MOE: family_folder(root, next(f for f in FAMILIES if f.name == MOE))}


def job(model: str, lora: Lora, folders: dict[str, Path]) -> JobConfig:
    folder = folders.get(model)
    source = {"name_or_path": str(folder) if folder else model}
    return JobConfig.model_validate({"model": {**source, "dtype": "fp32", "lora": lora(folder or Path())}})


def made_again_by_peft(layer: Any, config: Any) -> None:
    """peft's `update_layer` of the layer's adapter (peft < 0.18 took the config's settings one by one)."""
    settings = (ADAPTER, layer.r[ADAPTER], layer.lora_alpha[ADAPTER])
    if "config" in inspect.signature(layer.update_layer).parameters:
        layer.update_layer(*settings, config=config)
    else:
        layer.update_layer(*settings, config.lora_dropout, config.init_lora_weights, config.use_rslora, config.use_dora)


def started_by_peft(cfg: JobConfig) -> dict[str, torch.Tensor]:
    """The adapters peft starts on the same base built normally on the CPU, under PEFT's keys: an adapter folder as
    `PeftModel.from_pretrained` reads it; else `get_peft_model` with the same config, each layer's adapter then made
    again by peft's `update_layer` seeded by the layer's name (`module_seed`)."""
    from peft import PeftModel, get_peft_model, get_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    source = resolve_model(cfg.model)
    auto = auto_model_class(source.hf_config)
    if source.weights_dir is None:
        base = auto.from_config(source.hf_config, dtype=torch.float32)
    else:
        base = auto.from_pretrained(source.weights_dir, dtype=torch.float32)
    if cfg.model.lora is not None and cfg.model.lora.adapter:
        model = PeftModel.from_pretrained(base, cfg.model.lora.adapter)
        return get_peft_model_state_dict(model, save_embedding_layers=False)
    assert cfg.model.lora is not None
    config = peft_config(cfg.model.lora, base)
    model = get_peft_model(base, copy.deepcopy(config))
    with torch.no_grad():
        for name, layer in base.named_modules():
            if isinstance(layer, LoraLayer):
                torch.manual_seed(module_seed(cfg.training.seed, name))
                made_again_by_peft(layer, config)
    return get_peft_model_state_dict(model, save_embedding_layers=False)  # the adapters, not the base's embeddings


def assert_same_adapters(ours: dict[str, torch.Tensor], peft: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(peft)
    for key, tensor in peft.items():
        assert torch.isfinite(ours[key]).all(), key
        assert torch.equal(ours[key], tensor), key


@pytest.mark.parametrize("case", CASES)
def test_every_adapter_starts_where_peft_starts_it(case, folders):
    import peft

    model, lora, since, made = CASES[case]
    if Version(peft.__version__) < Version(since):
        pytest.skip(f"peft {peft.__version__} builds no {case} adapter (peft >= {since})")
    cfg = job(model, lora, folders)
    with process_group() as runtime:
        sharded = sharded_model(cfg, runtime, training=True).model
        ours = {key: full_tensor(tensor).clone() for key, tensor in peft_state(sharded).items()}
        # the comparison covers every adapter tensor the model holds
        held = {id(p) for module in adapter_modules(sharded).values() for p in module.parameters()}
        assert held == {id(tensor) for tensor in peft_state(sharded).values()}
    assert any(made in key for key in ours), sorted(ours)  # the case builds the layer type it names
    assert_same_adapters(ours, started_by_peft(cfg))


STEPS = 5


def embedding_run(folder: Path, out: Path) -> dict[str, Any]:
    lora = {"rank": 4, "alpha": 8, "target_modules": ["embed_tokens"]}
    config = {
        "model": {"name_or_path": str(folder), "dtype": "fp32", "lora": lora},
        "training": {
            "learning_rate": 1e-2,
            "lr_scheduler_type": "constant",
            "max_steps": STEPS,
            "max_grad_norm": 1.0,
            "output_dir": str(out) + ".run",
        },
    }
    return {"config": config, "steps": STEPS, "out": str(out)}


def assert_trains_from_peft_start(result: dict[str, Any], run: dict[str, Any]) -> None:
    assert_same_adapters(result["start"], started_by_peft(JobConfig.model_validate(run["config"])))
    assert all(torch.isfinite(torch.tensor(result["grad_norms"]))), result["grad_norms"]
    losses = result["losses"]
    assert losses == sorted(losses, reverse=True), losses  # the adapter learns: every step lowers the loss
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.fixture(scope="module")
def one_rank(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    run = embedding_run(folders[LLAMA], tmp_path_factory.mktemp("lora_embedding") / "one.pt")
    try:
        train(run)
    finally:
        shutdown()
    return run, torch.load(run["out"])


def test_an_embedding_adapter_trains_from_peft_start(one_rank):
    run, result = one_rank
    assert_trains_from_peft_start(result, run)


@pytest.mark.slow
def test_two_ranks_start_and_train_an_embedding_adapter_as_one(one_rank, folders, tmp_path):
    """Each rank holds half of the embedding adapter's A and B, filled from the same full-size start."""
    run = embedding_run(folders[LLAMA], tmp_path / "two.pt")
    (tmp_path / "run.json").write_text(json.dumps(run))
    launch_two_ranks("lora_worker.py", tmp_path / "run.json")
    result, alone = torch.load(run["out"]), one_rank[1]
    assert_trains_from_peft_start(result, run)
    assert result["losses"] == pytest.approx(alone["losses"], abs=1e-5)
    assert result["grad_norms"] == pytest.approx(alone["grad_norms"], rel=1e-5)
