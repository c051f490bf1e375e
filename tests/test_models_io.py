"""Models in and out: HF folders loaded shard by shard, exports transformers trusts, conversions, load errors."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager

import pytest
import torch
from conftest import (
    as_overrides,
    make_hf_folder,
    plain_model,
    process_group,
    read_metrics,
    run_cli,
    set_args,
    sharded_model,
    token_batch,
)
from safetensors.torch import load_file, save_file
from test_infer import TEXTS, infer_records, reference_logprobs

DEMO = "examples/demo.yaml"


def _infer(folder, data, out, nproc=1, settings: dict | None = None) -> list[dict]:
    return infer_records(folder, data, out, nproc, {"infer_batch_size": 2, **(settings or {})})[:-1]


@pytest.fixture
def texts_file(tmp_path):
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    return path


def test_convert_hf_dcp_hf_is_bit_identical(tmp_path, run_main):
    folder = tmp_path / "hf"
    make_hf_folder(folder, "tiny-qwen3", max_shard_size="1MB")  # several files and an index
    assert (folder / "model.safetensors.index.json").is_file()
    assert run_main("convert", folder, tmp_path / "dcp", "--to", "dcp").returncode == 0
    assert run_main("convert", tmp_path / "dcp", tmp_path / "back", "--to", "hf").returncode == 0
    original = {k: v for f in folder.glob("*.safetensors") for k, v in load_file(f).items()}
    back = {k: v for f in (tmp_path / "back").glob("*.safetensors") for k, v in load_file(f).items()}
    assert original.keys() == back.keys()
    assert all(torch.equal(original[k], back[k]) and original[k].dtype == back[k].dtype for k in original)
    assert (folder / "config.json").read_text() == (tmp_path / "back" / "config.json").read_text()
    # Readable as a plain `open` would leave it (0644 under the usual umask), not safetensors' 0600.
    umask = os.umask(0)
    os.umask(umask)
    assert {path.stat().st_mode & 0o777 for path in (tmp_path / "back").iterdir()} == {0o666 & ~umask}


@pytest.mark.slow
def test_export_and_checkpoint_give_the_same_logprobs(tmp_path, texts_file, small_run, run_main):
    """Train 3 steps; the HF export (through transformers) and the run's own DCP checkpoint (through
    `fsdp2kit infer`) give the same log-probs; `convert --to hf|torch` of the checkpoint agree with the export."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    result = run_cli(
        "train",
        DEMO,
        "--nproc",
        2,
        *small_run,
        "--set",
        "training.export_hf=true",
        "--set",
        "training.max_steps=3",
        "--set",
        "model.name_or_path=builtin:tiny-qwen3",
    )
    assert result.returncode == 0, result.stderr
    assert len(read_metrics(run)) == 3
    AutoTokenizer.from_pretrained(run / "hf")
    exported = AutoModelForCausalLM.from_pretrained(run / "hf")
    assert exported.lm_head.weight.data_ptr() == exported.model.embed_tokens.weight.data_ptr()  # still tied
    expected = reference_logprobs(exported, run / "hf")
    got = _infer(run / "checkpoints" / "step_3", texts_file, tmp_path / "infer", nproc=2)
    assert [r["sum_logprob"] for r in got] == pytest.approx(expected, abs=1e-4)

    assert run_main("convert", run / "checkpoints" / "step_3", tmp_path / "conv", "--to", "hf").returncode == 0
    assert run_main("convert", run / "checkpoints" / "step_3", tmp_path / "pt", "--to", "torch").returncode == 0
    exported_state = load_file(run / "hf" / "model.safetensors")
    converted_state = load_file(tmp_path / "conv" / "model.safetensors")
    torch_state = torch.load(tmp_path / "pt" / "model.pt", weights_only=True)
    assert all(torch.equal(exported_state[k], converted_state[k]) for k in exported_state)
    assert all(torch.equal(exported_state[k], torch_state[k]) for k in exported_state)


@pytest.mark.slow
@pytest.mark.parametrize("nproc, loading", [(4, "sliced"), (2, "rank0_broadcast")])
def test_load_modes_and_world_sizes(tmp_path, texts_file, nproc, loading):
    folder = tmp_path / "hf"
    model = make_hf_folder(folder, "tiny-qwen3", max_shard_size="1MB")
    expected = reference_logprobs(model, folder)
    got = _infer(folder, texts_file, tmp_path / "out", nproc, {"model.weights_loading": loading})
    assert [r["sum_logprob"] for r in got] == pytest.approx(expected, abs=1e-4)


def test_weight_mistakes_exit_2_naming_the_tensor_or_file(tmp_path, texts_file, run_main):
    folder = tmp_path / "hf"
    make_hf_folder(folder, "tiny-llama")
    weights = load_file(folder / "model.safetensors")

    def infer():
        given = {"model.name_or_path": folder, "data.source": texts_file, "training.output_dir": tmp_path / "out"}
        code, _, err = run_main("infer", DEMO, *set_args({key: str(value) for key, value in given.items()}))
        return code, err

    def attempt(state, config_changes=None):
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
        if config_changes:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
        return infer()

    missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
    code, err = attempt(missing)
    assert code == 2
    assert "tensor 'model.norm.weight' is missing from the safetensors files" in err

    wrong = dict(weights, **{"model.norm.weight": torch.ones(7)})
    code, err = attempt(wrong)
    assert code == 2
    assert "tensor 'model.norm.weight' in 'model.safetensors' has shape (7,), the model expects (256,)" in err

    code, err = attempt(weights, {"num_hidden_layers": 1})
    assert code == 2
    assert "tensor 'model.layers.1.input_layernorm.weight'" in err and "config and weights do not match" in err

    (folder / "model.safetensors").unlink()
    (folder / "config.json").write_text(
        json.dumps({**json.loads((folder / "config.json").read_text()), "num_hidden_layers": 2})
    )
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "gone.safetensors" for k in weights}})
    )
    save_file({"x": torch.zeros(1)}, folder / "other.safetensors")
    code, err = infer()
    assert code == 2
    assert (
        err.strip() == f"error: model weights: file '{folder / 'gone.safetensors'}' named by the index does not exist"
    )


def test_a_model_class_with_a_persistent_buffer_trains_from_the_folder_that_stores_it(tmp_path):
    """`model.model_class` with a persistent buffer no `_init_weights` writes (a per-channel embedding scale), from a
    folder save_pretrained wrote with it: the buffer is read from the folder, as `from_pretrained` reads it, and two
    steps train as a plain loop of transformers' model loaded with from_pretrained (it was refused: "_init_weights
    leaves 'embedding_scale' uninitialised")."""
    import shutil
    import sys

    from strategy_case import global_micro_batches, plain_training, policy_loss, strategy_config
    from transformers import AutoConfig

    import fsdp2kit
    from fsdp2kit.data.builtin import tokenizer_dir
    from fsdp2kit.distributed import shutdown
    from fsdp2kit.models.builtin import BUILTIN_MODELS

    class_file = "tests/fixtures/model_classes/scaled_llama.py"
    sys.path.insert(0, os.path.dirname(class_file))
    try:
        from scaled_llama import ScaledLlamaForCausalLM
    finally:
        sys.path.pop(0)
    small = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
    settings = dict(BUILTIN_MODELS["tiny-llama"], num_hidden_layers=2, vocab_size=512, **small)
    torch.manual_seed(0)
    model = ScaledLlamaForCausalLM(AutoConfig.for_model(settings.pop("model_type"), **settings))
    model.embedding_scale.copy_(torch.linspace(0.5, 2.0, 64))
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, folder / file.name)
    assert "embedding_scale" in load_file(folder / "model.safetensors")

    def micro_batches(step: int) -> list[dict[str, torch.Tensor]]:
        return global_micro_batches(step, 2)

    cfg = strategy_config(str(folder), str(tmp_path / "run"), 2)
    cfg["model"]["model_class"] = f"{class_file}:ScaledLlamaForCausalLM"
    try:
        strategy = fsdp2kit.Strategy.from_config(cfg)
        buffer = strategy.model.embedding_scale.detach().clone()
        losses = [strategy.train_step(micro_batches(step), policy_loss)["loss"] for step in range(2)]
    finally:
        shutdown()
    torch.testing.assert_close(buffer, torch.linspace(0.5, 2.0, 64), rtol=0, atol=0)

    reference = ScaledLlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def loss_of(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        logits = reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        log_probs = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
        return policy_loss(log_probs, batch)

    assert losses == pytest.approx(plain_training(reference, 2, micro_batches, loss_of)["losses"], abs=1e-5)


@contextmanager
def one_process_model(cfg, ignored: bool):
    """The config's model in this process: plain (no FSDP: the tests' reference) or sharded on one rank."""
    if not ignored:
        yield plain_model(cfg)[0]
        return
    with process_group() as runtime:
        yield sharded_model(cfg, runtime, training=True).model


@pytest.mark.parametrize("ignored", [False, True], ids=["unsharded", "ignored by FSDP"])
def test_tied_embeddings_stay_one_parameter_as_transformers_loads_them(tmp_path, ignored):
    """Tied input embeddings and LM head (tiny-qwen3) are one parameter wherever they are not sharded: in the one-
    process model (the tests' reference) and under FSDP with the pair ignored (replicated), with transformers'
    values and logits. `to_empty` off the meta device used to give each module its own parameter: the head kept
    whatever memory it was given (a folder stores it once, under the embeddings) or a fresh init of its own, and
    trained apart from the embeddings."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from fsdp2kit.config.load import load_config

    folder = tmp_path / "qwen3"
    make_hf_folder(folder, "tiny-qwen3")
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert expected.lm_head.weight is expected.model.embed_tokens.weight
    config_file = tmp_path / "tied.yaml"
    config_file.write_text(json.dumps({"model": {"name_or_path": str(folder), "dtype": "fp32"}}))
    ignore = ["model.embed_tokens", "lm_head"] if ignored else []
    cfg = load_config(config_file, as_overrides({"strategy_args.strategy_config.ignored_modules": ignore}))
    batch = {key: value for key, value in token_batch().items() if key != "labels"}
    with one_process_model(cfg, ignored) as model, torch.no_grad():
        assert model.lm_head.weight is model.model.embed_tokens.weight
        for name, tensor in model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            torch.testing.assert_close(full, expected.state_dict()[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(model(**batch).logits, expected(**batch).logits, rtol=0, atol=0)
    cfg.model.name_or_path = "builtin:tiny-qwen3"  # fresh weights
    with one_process_model(cfg, ignored) as model:
        assert model.lm_head.weight is model.model.embed_tokens.weight
