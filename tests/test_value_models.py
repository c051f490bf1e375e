"""Value and reward models through `fsdp2kit.Strategy` (`model.model_class` a transformers ...ForTokenClassification
or ...ForSequenceClassification with one label): a PPO critic's clipped value loss and a Bradley-Terry reward loss
train as a plain PyTorch loop does at 1 and 2 ranks (the critic under Ulysses too), forward_step gives transformers'
values and scores, and the export loads with the same auto class and gives the same outputs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, make_hf_folder, read_metrics, run_python
from value_case import AUTO_CLASSES, MODEL_CLASSES, config, load_reference, micro_batches, outputs, reference, train

import fsdp2kit
from fsdp2kit.distributed import free_port, shutdown
from fsdp2kit.errors import UserError

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}


def value_model(folder: Path, kind: str) -> Path:
    """A small Llama critic or reward model (one label; token 0, the batches' padding, is its pad token)."""
    make_hf_folder(
        folder, "tiny-llama", vocab_size=512, auto_class=AUTO_CLASSES[kind], num_labels=1, pad_token_id=0, **SMALL
    )
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("value_models")
    return {kind: value_model(root / kind, kind) for kind in AUTO_CLASSES}


@pytest.fixture(scope="module")
def expected(models: dict[str, Path]) -> dict[str, dict]:
    return {kind: reference(kind, folder) for kind, folder in models.items()}


def assert_same_training(result: dict, expected: dict) -> None:
    assert result["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert sorted(result["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["critic", "reward"])
def test_a_value_or_reward_model_trains_as_a_plain_loop_and_exports_for_its_auto_class(
    kind, models, expected, tmp_path
):
    """One rank, two micro-batches accumulated per step: the losses and weights of transformers' model under AdamW;
    forward_step's values [B, T] / scores [B] are the trained model's; the HF export (with its `score` head) loads
    with the same auto class and gives the same outputs."""
    import transformers

    batch = micro_batches(0, 1)[0]
    try:
        strategy, losses = train(kind, str(models[kind]), str(tmp_path / "run"))
        weights = {name: tensor.clone() for name, tensor in strategy.full_weights()}
        got = strategy.forward_step(batch)
        strategy.export_hf(tmp_path / "hf")
    finally:
        shutdown()
    assert_same_training({"losses": losses, "weights": weights}, expected[kind])
    assert losses[0] != losses[-1]  # it trained
    assert list(got) == [{"critic": "values", "reward": "scores"}[kind]]
    exported = getattr(transformers, AUTO_CLASSES[kind]).from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    trained = load_reference(kind, models[kind]).eval()
    trained.load_state_dict(expected[kind]["weights"])
    with torch.no_grad():
        want = outputs(trained, batch)
        torch.testing.assert_close(outputs(exported, batch), want, rtol=0, atol=1e-5)
    assert got[next(iter(got))].shape == want.shape == ((2, 17) if kind == "critic" else (2,))
    torch.testing.assert_close(next(iter(got.values())), want, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_value_and_reward_models_at_two_ranks_and_the_critic_under_ulysses_equal_a_plain_loop(
    models, expected, tmp_path
):
    """Two data-parallel ranks with a micro-batch each (critic, reward model), then a Ulysses pair that splits each
    sequence and gathers the critic's values (and the reward model's last-token pick sees whole sequences); a reward
    model's rows padded with another id than its pad_token_id are refused under Ulysses (their score would be read at
    padding, whose output depends on the split)."""
    out = tmp_path / "out.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--master-port", str(free_port()), str(REPO / "tests" / "value_case.py")]
    command += [str(models["critic"]), str(models["reward"]), str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = torch.load(out)
    for name, kind in [("critic", "critic"), ("reward", "reward"), ("critic-ulysses", "critic")]:
        assert_same_training(runs[name], expected[kind])
    assert runs["reward-ulysses-padded-with-5"].startswith(
        "forward_step: under sequence parallel an output at padding depends on how the sequence is split, but row "
    ), runs["reward-ulysses-padded-with-5"]


def test_a_value_model_is_refused_where_log_probs_are_asked_and_its_labels_must_be_one(models, tmp_path):
    cfg = config("critic", str(models["critic"]), str(tmp_path))
    batch = micro_batches(0, 1)[0]
    try:
        s = fsdp2kit.Strategy.from_config(cfg)
        with pytest.raises(UserError, match="gives values, not next-token log-probs"):
            s.forward_step(batch, entropy=True)
        with pytest.raises(UserError, match="no default loss"):
            s.train_step([batch])
    finally:
        shutdown()
    cfg["model"]["config"] = {"num_labels": 2}
    with pytest.raises(UserError, match="model.config.num_labels: LlamaForTokenClassification .* needs num_labels: 1"):
        fsdp2kit.Strategy.from_config(cfg)
    shutdown()


@pytest.mark.slow
def test_the_ppo_example_raises_the_reward_and_lowers_the_value_loss(tmp_path):
    """examples/rl_ppo.py at 2 ranks: a policy Strategy and a critic Strategy (a value model) on the CPU."""
    result = run_python("examples/rl_ppo.py", "--nproc", "2", "--steps", "10", "--output-dir", tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == list(range(1, 11))
    first, last = records[:3], records[-3:]
    reward = [sum(r["reward"] for r in part) / 3 for part in (first, last)]
    value_loss = [sum(r["value_loss"] for r in part) / 3 for part in (first, last)]
    assert reward[1] > reward[0] + 0.1, reward
    assert value_loss[1] < value_loss[0] / 2, value_loss


def _command_config(path: Path, model_dir: Path, model_class: str, output_dir: Path) -> Path:
    """A native config for the commands: the model as model_class, the built-in corpus, one short step."""
    import yaml

    config = {
        "model": {"name_or_path": str(model_dir), "model_class": model_class},
        "data": {"seq_len": 32},
        "training": {"max_steps": 1, "output_dir": str(output_dir), "export_hf": False},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_check_and_train_refuse_a_head_fsdp2kit_does_not_serve_and_check_refuses_a_critic(tmp_path, run_main):
    """Issue 42 (3, 7): a question-answering head (no LM head, no score layer) passed `check` and died in `train`
    with a StopIteration; a critic passed `check` and was refused by `train` only after loading. Each is now the
    same one line in `check` as in the run."""
    folder = tmp_path / "critic-model"  # the built-in tokenizer's vocabulary, as the commands' data needs
    make_hf_folder(folder, "tiny-llama", layers=1, auto_class=AUTO_CLASSES["critic"], num_labels=1, **SMALL)
    answering = _command_config(tmp_path / "qa.yaml", folder, "transformers:LlamaForQuestionAnswering", tmp_path / "qa")
    said = []
    for command in ("check", "train"):
        code, _, err = run_main(command, answering)
        assert code == 2 and err.startswith("error: model.model_class: LlamaForQuestionAnswering has no LM head"), err
        assert "fsdp2kit serves causal LMs (...ForCausalLM" in err and err.count("\n") == 1
        said.append(err)
    assert said[0] == said[1]
    critic = _command_config(
        tmp_path / "critic.yaml", folder, "transformers:LlamaForTokenClassification", tmp_path / "critic"
    )
    code, _, err = run_main("check", critic, "--set", "model.config.num_labels=1")
    assert code == 2 and err == (
        "error: the train command (next-token cross-entropy): model.model_class LlamaForTokenClassification gives "
        "values, not next-token log-probs; use forward_step for its values and train_step with a loss_fn(values, "
        "batch)\n"
    )
    code, _, err = run_main(
        "check", critic, "--set", "model.config.num_labels=1", "--set", "strategy_args.strategy_name=fsdp2_infer"
    )
    assert code == 2 and err.startswith("error: the infer command (next-token log-probs): model.model_class Llama")


@pytest.mark.parametrize("kind", list(AUTO_CLASSES))
def test_a_critic_or_reward_folder_converts_to_dcp_and_back_exactly(kind, tmp_path, run_main):
    """Issue 42 (5): convert read every folder as its family's causal LM, so a critic's `score.bias` (transformers'
    token-classification head has one) was 'not in its config.json's model'. The class config.json names is read:
    HF -> DCP -> HF gives the same tensors, and transformers' auto class loads the result."""
    from safetensors.torch import load_file

    folder = tmp_path / "hf"
    make_hf_folder(folder, "tiny-llama", layers=1, auto_class=AUTO_CLASSES[kind], num_labels=1, pad_token_id=0, **SMALL)
    for src, dst, to in ((folder, tmp_path / "dcp", "dcp"), (tmp_path / "dcp", tmp_path / "back", "hf")):
        code, _, err = run_main("convert", src, dst, "--to", to)
        assert code == 0, err
    before, after = load_file(folder / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert "score.bias" in before or kind == "reward"  # the critic's head has a bias, the reward model's none
    assert sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    import transformers

    loaded = getattr(transformers, AUTO_CLASSES[kind]).from_pretrained(tmp_path / "back")
    assert type(loaded).__name__ == MODEL_CLASSES[kind].split(":")[1]


@pytest.mark.parametrize("kind", ["critic", "reward"])
def test_plan_predicts_a_value_or_reward_model(kind, models):
    """`fsdp2kit plan`'s prediction traces a value or reward model's training step (its num_labels-wide `score`
    head, no LM head): the shards it counts are the model's own parameters, and the traced peak holds them with their
    gradients and AdamW's two states. It died on the LM head it looked for (StopIteration)."""
    import transformers

    from fsdp2kit.memory_plan import ConfigSource, predict

    sets = ["model.name_or_path=" + str(models[kind]), "model.model_class=" + MODEL_CLASSES[kind], "data.seq_len=32"]
    report = predict(ConfigSource("examples/demo.yaml", sets, None, None), 1)
    model = getattr(transformers, AUTO_CLASSES[kind]).from_pretrained(models[kind], dtype=torch.float32)
    assert model.score.weight.shape == (1, SMALL["hidden_size"])
    parameter_bytes = 4 * sum(p.numel() for p in model.parameters())
    assert report["computed"]["sharded_params"] == report["categories"]["sharded_param"] == parameter_bytes
    assert report["peak_bytes"] > 4 * parameter_bytes  # parameters, gradients, exp_avg, exp_avg_sq


@pytest.mark.parametrize("kind", ["critic", "reward"])
def test_an_exported_value_model_without_model_class_is_refused_naming_its_class(kind, models, tmp_path):
    """fsdp2kit's own export of a critic or reward model (config.json: its ...ForTokenClassification or
    ...ForSequenceClassification) given without model.model_class: one sentence naming the folder's class and the
    key to set, not "config and weights do not match"; with the key set it loads and gives the exported outputs."""
    batch = micro_batches(0, 1)[0]
    cfg = config(kind, str(models[kind]), str(tmp_path / "run"))
    try:
        strategy = fsdp2kit.Strategy.from_config(cfg)
        exported = strategy.forward_step(batch)
        strategy.export_hf(tmp_path / "hf")
    finally:
        shutdown()
    class_name = MODEL_CLASSES[kind].partition(":")[2]
    del cfg["model"]["model_class"]
    cfg["model"]["name_or_path"] = str(tmp_path / "hf")
    said = (
        f"model.model_class: '{tmp_path / 'hf'}' holds a {class_name} (its config.json's architectures) and "
        "model.model_class is not set, so a causal LM would be built on it; set model.model_class: "
        f"transformers:{class_name} to load it as it is (forward_step then gives its {next(iter(exported))})"
    )
    with pytest.raises(UserError) as refused:
        fsdp2kit.Strategy.from_config(cfg)
    shutdown()
    assert str(refused.value) == said
    cfg["model"]["model_class"] = MODEL_CLASSES[kind]
    try:
        reloaded = fsdp2kit.Strategy.from_config(cfg).forward_step(batch)
    finally:
        shutdown()
    torch.testing.assert_close(reloaded, exported, rtol=0, atol=0)
