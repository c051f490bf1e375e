"""SPEC §4.3: every way of splitting the same global batch over ranks and micro-batches, sharded or not, with or
without recompute and prefetch, trains to the same per-step losses as one plain PyTorch process with no FSDP."""

from __future__ import annotations

import pytest
import torch
import yaml
from conftest import SMALL_RUN, as_overrides, read_metrics, reference_run, run_cli, set_args
from safetensors.torch import load_file

from fsdp2kit.config.load import load_config

STEPS = 8
GLOBAL_BATCH = 4  # samples per optimizer step in every case
TOLERANCE = 1e-5  # relative, per step

CONFIG = {
    "model": {"name_or_path": "builtin:tiny-llama", "dtype": "fp32"},
    "data": {"source": "builtin:corpus"},
    "training": {
        "learning_rate": 3.0e-3,
        "weight_decay": 0.01,
        "warmup_steps": 4,
        "lr_scheduler_type": "cosine",
        "max_steps": STEPS,
        "max_grad_norm": 1.0,
        "seed": 7,
        "per_device_train_batch_size": 1,
    },
}
SMALL = {**SMALL_RUN, "training.save_steps": 0}

# name: (ranks, overrides). per_device_train_batch_size (1) x gradient_accumulation_steps x ranks = GLOBAL_BATCH.
STRATEGY = "strategy_args.strategy_config."
CASES = {
    "1 rank x 4 micro-batches": (1, {}),
    "FSDP 2 ranks x 2": (2, {}),
    "HSDP 4 ranks, fsdp_size 2": (4, {STRATEGY + "fsdp_size": 2}),
    "ZeRO-2": (2, {STRATEGY + "reshard_after_forward": False}),
    "NO_SHARD": (2, {STRATEGY + "sharding_strategy": "NO_SHARD"}),
    "recompute, reentrant": (
        2,
        {STRATEGY + "recompute_modules": ["model.layers.{*}"], STRATEGY + "use_reentrant": True},
    ),
    "recompute, non-reentrant": (
        2,
        {STRATEGY + "recompute_modules": ["model.layers.{*}"], STRATEGY + "use_reentrant": False},
    ),
    "explicit prefetch": (2, {STRATEGY + "num_to_forward_prefetch": 2, STRATEGY + "num_to_backward_prefetch": 2}),
    # Ignored modules stay replicated outside FSDP: only if their gradients are averaged over the ranks do the
    # replicas stay identical and the loss follow the reference.
    "ignored embeddings": (2, {STRATEGY + "ignored_modules": ["model.embed_tokens"]}),
    # The plan of examples/custom_plan: embeddings, each attention, each MLP and the head in their own groups.
    "the model's own plan": (2, {"model.model_class": "examples/custom_plan/planned_llama.py:PlannedLlamaForCausalLM"}),
}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("numerics") / "numerics.yaml"
    path.write_text(yaml.safe_dump(CONFIG))
    return path


@pytest.fixture(scope="module")
def reference_losses(config_file) -> list[float]:
    """One process, no FSDP: `train_step` on each whole global batch (the mean token cross-entropy, clip, AdamW)."""
    cfg = load_config(config_file, as_overrides(SMALL | {"training.per_device_train_batch_size": GLOBAL_BATCH}))
    return reference_run(cfg, STEPS).losses


def test_reference_trains(reference_losses):
    """The comparison means something only if the loss actually moves."""
    assert reference_losses[-1] < reference_losses[0] - 0.5


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_losses_match_single_process_reference(case, config_file, reference_losses, tmp_path):
    ranks, overrides = CASES[case]
    accumulation = GLOBAL_BATCH // ranks
    settings = SMALL | {"training.gradient_accumulation_steps": accumulation, "training.output_dir": str(tmp_path)}
    result = run_cli("train", config_file, "--nproc", ranks, *set_args(settings | overrides))
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [record["loss"] for record in read_metrics(tmp_path)]
    assert len(losses) == STEPS
    differences = [abs(loss - ref) / abs(ref) for loss, ref in zip(losses, reference_losses, strict=True)]
    assert max(differences) < TOLERANCE, f"{case}: relative differences per step {differences}"


# Tied input embeddings and LM head (tiny-qwen3): one parameter in the reference, as transformers holds it, and in
# every run, sharded with the rest or replicated outside FSDP (ignored); the export stores it once.
TIED_STEPS = 3
TIED = {"model.name_or_path": "builtin:tiny-qwen3", "training.max_steps": TIED_STEPS, "training.export_hf": True}
TIED_CASES = {
    "FSDP 2 ranks x 2": {},
    "ignored tied pair": {STRATEGY + "ignored_modules": ["model.embed_tokens", "lm_head"]},
}


@pytest.fixture(scope="module")
def tied_reference(config_file):
    cfg = load_config(config_file, as_overrides(SMALL | TIED | {"training.per_device_train_batch_size": GLOBAL_BATCH}))
    return reference_run(cfg, TIED_STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(TIED_CASES))
def test_tied_embeddings_match_single_process_reference(case, config_file, tied_reference, tmp_path):
    """Losses and gradient norms per step (2 ranks attending by documents against one process with the dense
    mask), and the exported weights after the last: one tied tensor."""
    settings = SMALL | TIED | {"training.gradient_accumulation_steps": GLOBAL_BATCH // 2}
    settings |= TIED_CASES[case] | {"training.output_dir": str(tmp_path)}
    result = run_cli("train", config_file, "--nproc", 2, *set_args(settings))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention document_sdpa" in result.stdout + result.stderr  # the reference: the dense mask, one process
    records = read_metrics(tmp_path)
    for key in ("loss", "grad_norm"):
        pairs = [(record[key], getattr(ref, key)) for record, ref in zip(records, tied_reference.results, strict=True)]
        differences = [abs(got - ref) / abs(ref) for got, ref in pairs]
        assert max(differences) < TOLERANCE, f"{case}: {key} relative differences per step {differences}"
    exported = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported |= load_file(file)
    trained = tied_reference.model
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    assert sorted(exported) == sorted(name for name, _ in trained.named_parameters())  # the head not stored apart
    for name, param in trained.named_parameters():
        torch.testing.assert_close(exported[name], param.detach(), rtol=0, atol=1e-5, msg=name)
