"""A critic or reward model started from a causal LM's folder, as verl and ROLL start a critic from the actor's SFT
checkpoint: the backbone is read exactly as transformers' `from_pretrained(..., num_labels=1)` reads it, the LM head
is left unread and the new `score` layer initialised fresh (seeded), said in one line; a folder that lacks backbone
tensors is still refused. Its export and its checkpoints name its own class in config.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import make_hf_folder
from safetensors.torch import load_file, save_file
from strategy_case import strategy_config
from value_case import MODEL_CLASSES, config, micro_batches, value_loss

import fsdp2kit
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture(scope="module")
def causal_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("causal") / "sft"
    make_hf_folder(folder, "tiny-llama", vocab_size=512, pad_token_id=0, **SMALL)
    return folder


def critic_config(folder: Path, output_dir: Path) -> dict:
    cfg = config("critic", str(folder), str(output_dir))
    cfg["model"]["config"] = {"num_labels": 1}
    return cfg


def test_a_critic_starts_from_a_causal_lm_folder_with_its_backbone_and_a_fresh_seeded_head(
    causal_folder, tmp_path, capsys
):
    """The backbone equals transformers' AutoModelForTokenClassification.from_pretrained(causal, num_labels=1)'s
    bit for bit; score is fresh (bias 0, weight ~ N(0, initializer_range)), the same in two builds; it trains; the
    export's config.json names LlamaForTokenClassification, not the source's LlamaForCausalLM."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    weights = []
    try:
        for build in range(2):
            strategy = fsdp2kit.Strategy.from_config(critic_config(causal_folder, tmp_path / f"run{build}"))
            weights.append({name: tensor.clone() for name, tensor in strategy.full_weights()})
        said = capsys.readouterr().out
        losses = [strategy.train_step([batch], value_loss)["loss"] for batch in micro_batches(0, 2)]
        trained = dict(strategy.full_weights())
        strategy.export_hf(tmp_path / "hf")
        strategy.save_checkpoint(tmp_path / "checkpoints" / "step_2")
    finally:
        shutdown()
    assert f"score.weight, score.bias not in '{causal_folder}': initialised fresh" in said
    assert "lm_head.weight in the folder not used" in said
    reference = AutoModelForTokenClassification.from_pretrained(causal_folder, num_labels=1, dtype=torch.float32)
    backbone = {k: v for k, v in reference.state_dict().items() if not k.startswith("score.")}
    assert sorted(weights[0]) == sorted(reference.state_dict())
    for name, tensor in backbone.items():
        torch.testing.assert_close(weights[0][name], tensor, rtol=0, atol=0, msg=name)
    for name in ("score.weight", "score.bias"):
        torch.testing.assert_close(weights[1][name], weights[0][name], rtol=0, atol=0)  # seeded
    assert weights[0]["score.bias"].abs().max() == 0
    assert weights[0]["score.weight"].std().item() == pytest.approx(reference.config.initializer_range, rel=0.3)
    assert losses[0] != losses[1] and not torch.equal(trained["score.weight"], weights[0]["score.weight"])
    exported = AutoConfig.from_pretrained(tmp_path / "hf")
    assert exported.architectures == ["LlamaForTokenClassification"]
    assert exported.num_labels == 1
    saved = json.loads((tmp_path / "checkpoints" / "step_2" / "config.json").read_text())
    assert saved["architectures"] == ["LlamaForTokenClassification"]  # what `convert --to hf` copies


def test_a_reward_model_from_a_causal_folder_and_a_folder_without_backbone_tensors_refused(causal_folder, tmp_path):
    """A reward model (ForSequenceClassification) reads the same backbone; a folder missing a backbone tensor is
    refused naming it (only the new head may start fresh)."""
    cfg = critic_config(causal_folder, tmp_path / "run")
    cfg["model"]["model_class"] = MODEL_CLASSES["reward"]
    try:
        strategy = fsdp2kit.Strategy.from_config(cfg)
        scores = strategy.forward_step(micro_batches(0, 1)[0])["scores"]
        strategy.export_hf(tmp_path / "hf")
    finally:
        shutdown()
    assert scores.shape == (2,)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == [
        "LlamaForSequenceClassification"
    ]
    broken = tmp_path / "broken"
    broken.mkdir()
    for file in causal_folder.iterdir():
        (broken / file.name).write_bytes(file.read_bytes())
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UserError, match="tensor 'model.norm.weight' is missing from the safetensors files"):
        fsdp2kit.Strategy.from_config(critic_config(broken, tmp_path / "run2"))
    shutdown()


def test_a_critic_starts_from_a_causal_lm_checkpoint_of_ours(causal_folder, tmp_path, capsys):
    """The same from a DCP checkpoint that a causal-LM Strategy (the actor) saved: the backbone is the checkpoint's,
    score is fresh and said so, lm_head is left unread."""
    try:
        actor = fsdp2kit.Strategy.from_config(strategy_config(str(causal_folder), str(tmp_path / "actor"), 1))
        actor.save_checkpoint(tmp_path / "actor" / "step_0")
        backbone = {name: tensor.clone() for name, tensor in actor.full_weights() if name.startswith("model.")}
        shutdown()
        capsys.readouterr()
        critic = fsdp2kit.Strategy.from_config(critic_config(tmp_path / "actor" / "step_0", tmp_path / "critic"))
        said = capsys.readouterr().out
        weights = dict(critic.full_weights())
    finally:
        shutdown()
    assert "score.weight, score.bias not in" in said and "lm_head.weight in the folder not used" in said
    assert sorted(weights) == sorted([*backbone, "score.weight", "score.bias"])
    for name, tensor in backbone.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0, msg=name)
