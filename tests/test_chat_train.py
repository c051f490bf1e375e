"""LLaMA-Factory's own data files (tests/fixtures/llamafactory, their source in its README) train as written with
the model's chat template, on 1 and 2 ranks with the same losses: alpaca, ShareGPT with tool calls and the
identity set on a tiny Qwen-family text model, and the multimodal demo (images beside it) on the tiny Qwen2.5-VL;
`infer` scores exactly the trained tokens; `prepare --show` prints them marked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import make_hf_folder, process_group, read_metrics, run_cli
from test_chat import LLAMAFACTORY, family_tokenizer

from fsdp2kit.config.load import load_config
from fsdp2kit.data.builtin import VOCAB_SIZE
from fsdp2kit.data.chat import ChatTemplate
from fsdp2kit.data.dataset import open_source
from fsdp2kit.infer.logprobs import infer
from fsdp2kit.trainer import train

TEXT_FILES = ["alpaca_en_demo.json", "glaive_toolcall_en_demo.json", "identity.json"]
STEPS = 3


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    """A tiny Qwen2-architecture model whose tokenizer has Qwen2.5's chat template (as a downloaded one has)."""
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    make_hf_folder(folder, "tiny-qwen3", model_type="qwen2", vocab_size=VOCAB_SIZE + 64)
    family_tokenizer("qwen2.5").save_pretrained(folder)
    return folder


def write_config(path: Path, model: str, source, **data) -> Path:
    config = {
        "model": {"name_or_path": model, "dtype": "fp32"},
        "data": {"source": source, "seq_len": 256, "shuffle": False, **data},
        "training": {
            "learning_rate": 1.0e-3,
            "max_steps": STEPS,
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 2,
            "export_hf": False,
            "report_to": [],
            "seed": 3,
        },
    }
    path.write_text(yaml.safe_dump(config))
    return path


def losses(config: Path, out: Path, ranks: int, *settings: str) -> list[float]:
    """The run's losses: 2 ranks through the command line, 1 rank in this process."""
    overrides = [f"training.output_dir={out}", f"training.gradient_accumulation_steps={2 // ranks}", *settings]
    if ranks > 1:
        result = run_cli("train", config, "--nproc", ranks, *(a for s in overrides for a in ("--set", s)))
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        with process_group() as runtime:
            train(load_config(config, overrides), runtime)
    return [record["loss"] for record in read_metrics(out)]


@pytest.mark.slow
def test_llamafactory_text_files_train_as_written_on_1_and_2_ranks(qwen_folder, tmp_path):
    sources = [str(LLAMAFACTORY / name) for name in TEXT_FILES]
    config = write_config(tmp_path / "sft.yaml", str(qwen_folder), sources, cache_dir=str(tmp_path / "cache"))
    one = losses(config, tmp_path / "one", 1)
    two = losses(config, tmp_path / "two", 2)
    assert len(one) == STEPS and two == pytest.approx(one, rel=1e-5, abs=1e-5)
    unpacked = losses(config, tmp_path / "unpacked", 1, "data.pack=false", "data.seq_len=512")
    assert len(unpacked) == STEPS


@pytest.mark.slow
def test_llamafactory_multimodal_demo_trains_on_the_tiny_vl_model_on_1_and_2_ranks(tmp_path):
    config = write_config(
        tmp_path / "vl.yaml", "builtin:tiny-qwen2.5-vl", str(LLAMAFACTORY / "mllm_demo.json"), pack=False
    )
    one = losses(config, tmp_path / "one", 1)
    two = losses(config, tmp_path / "two", 2)
    assert len(one) == STEPS and two == pytest.approx(one, rel=1e-5, abs=1e-5)


def test_infer_scores_exactly_the_trained_tokens(qwen_folder, tmp_path):
    source = str(LLAMAFACTORY / "identity.json")
    config = write_config(tmp_path / "infer.yaml", str(qwen_folder), source, max_samples=4, pack=False)
    cfg = load_config(config, [f"training.output_dir={tmp_path / 'out'}", f"data.cache_dir={tmp_path / 'c'}"])
    cfg.strategy_args.strategy_name = "fsdp2_infer"
    with process_group() as runtime:
        infer(cfg, runtime)
    records = [json.loads(line) for line in (tmp_path / "out" / "infer.jsonl").read_text().splitlines()][:-1]
    tokenizer = family_tokenizer("qwen2.5")
    template = ChatTemplate(tokenizer, tokenizer.chat_template)
    chats = open_source(cfg.data).read(0, 4)
    assert [r["num_tokens"] for r in records] == [sum(template.encode(c)[1][1:]) for c in chats]
    assert all(r["mean_logprob"] < 0 for r in records)


def test_prepare_show_prints_samples_with_their_targets_marked(qwen_folder, tmp_path):
    config = write_config(tmp_path / "p.yaml", str(qwen_folder), str(LLAMAFACTORY / "identity.json"), pack=False)
    result = run_cli("prepare", config, "--show", "2", "--set", f"data.cache_dir={tmp_path / 'cache'}")
    assert result.returncode == 0, result.stderr
    record = json.loads((LLAMAFACTORY / "identity.json").read_text())[0]
    assert f"[[{record['output']}<|im_end|>]]" in result.stdout
    assert f"<|im_start|>user\n{record['instruction']}<|im_end|>" in result.stdout


def test_check_renders_the_template_and_refuses_a_template_name_of_another_family(qwen_folder, tmp_path):
    from fsdp2kit.check import checked_files
    from fsdp2kit.errors import UserError

    config = write_config(tmp_path / "c.yaml", str(qwen_folder), str(LLAMAFACTORY / "glaive_toolcall_en_demo.json"))
    checked = checked_files(load_config(config, ["data.template=qwen2_5"]))
    assert checked["chat template"] == (
        "the tokenizer's own; data.template 'qwen2_5' read as it; assistant turns end with '<|im_end|>', records "
        "read as sharegpt"
    )
    with pytest.raises(UserError, match=r"data.template: 'llama3' is not the chat template of this model \(qwen2\)"):
        checked_files(load_config(config, ["data.template=llama3"]))
    text = write_config(tmp_path / "t.yaml", str(qwen_folder), "builtin:corpus")
    assert "chat template" not in checked_files(load_config(text))
