"""LLaMA-Factory's dataset registry (`data.dataset_dir` holding dataset_info.json, `data.source` naming its keys):
a named dataset gives the samples its file gives read directly in its form; several are concatenated; an entry's
columns and tags read the same conversations as the canonical ShareGPT fields; every refusal is one line.

The registry is LLaMA-Factory's own `data/dataset_info.json` cut to the fixtures' entries (tests/fixtures/llamafactory,
README); the defaults follow hiyouga/LLaMA-Factory src/llamafactory/data/parser.py and converter.py at commit
ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import tokenizer_dir
from fsdp2kit.data.dataset import load_documents
from fsdp2kit.data.mixture import split_samples
from fsdp2kit.data.samples import TrainingSamples
from fsdp2kit.data.store import store_path
from fsdp2kit.errors import UserError
from fsdp2kit.train.resume import data_files

LLAMAFACTORY = Path(__file__).parent / "fixtures" / "llamafactory"
TEMPLATE = (Path(__file__).parent / "fixtures" / "chat_templates" / "chatml.jinja").read_text()


@cache
def chat_tokenizer():
    """The built-in tokenizer with a ChatML template (conversations need one)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def samples_of(samples) -> list[tuple[list[int], list[bool]]]:
    return [(s.tokens.tolist(), s.trained.tolist()) for s in (samples[i] for i in range(len(samples)))]


def config(tmp_path: Path, **data) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path / "cache"), seq_len=256, pack=False, **data)


def test_one_named_dataset_gives_the_samples_of_its_file_read_in_its_form(tmp_path):
    """`dataset: alpaca_en_demo` (LLaMA-Factory's own entry: file_name only, formatting alpaca by default) trains on
    exactly the samples of alpaca_en_demo.json read with data.format: alpaca."""
    tokenizer = chat_tokenizer()
    named, _ = split_samples(config(tmp_path, source="alpaca_en_demo", dataset_dir=str(LLAMAFACTORY)), tokenizer, 0)
    direct = config(tmp_path, source=str(LLAMAFACTORY / "alpaca_en_demo.json"), format="alpaca")
    assert isinstance(named, TrainingSamples) and len(named) == 50
    assert samples_of(named) == samples_of(TrainingSamples.from_config(direct, tokenizer))


@pytest.mark.parametrize("source", ["identity,alpaca_en_demo", ["identity", "alpaca_en_demo"]])
def test_several_named_datasets_are_concatenated(tmp_path, source):
    """LLaMA-Factory's `dataset: a,b` (mix_strategy concat): every sample of each, in order, once an epoch."""
    tokenizer = chat_tokenizer()
    both, _ = split_samples(config(tmp_path, source=source, dataset_dir=str(LLAMAFACTORY)), tokenizer, 0)
    parts = [
        TrainingSamples.from_config(config(tmp_path, source=str(LLAMAFACTORY / f), format="alpaca"), tokenizer)
        for f in ("identity.json", "alpaca_en_demo.json")
    ]
    assert len(both) == 100
    assert samples_of(both) == samples_of(parts[0]) + samples_of(parts[1])


def _renamed_glaive(folder: Path) -> None:
    """glaive_toolcall_en_demo written with other field names and speakers, as LLaMA-Factory's mllm_demo writes
    its own (role/content, user/assistant), with a registry entry saying so."""
    speakers = {"human": "USER", "gpt": "BOT", "function_call": "CALL", "observation": "RESULT"}
    records = json.loads((LLAMAFACTORY / "glaive_toolcall_en_demo.json").read_text())
    renamed = [
        {
            "dialog": [{"speaker": speakers[t["from"]], "text": t["value"]} for t in r["conversations"]],
            "functions": r["tools"],
        }
        for r in records
    ]
    (folder / "renamed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in renamed))
    tags = {"role_tag": "speaker", "content_tag": "text", "user_tag": "USER", "assistant_tag": "BOT"}
    tags |= {"function_tag": "CALL", "observation_tag": "RESULT"}
    entry = {"file_name": "renamed.jsonl", "formatting": "sharegpt", "columns": {"messages": "dialog"}, "tags": tags}
    entry["columns"]["tools"] = "functions"
    shutil.copy(LLAMAFACTORY / "glaive_toolcall_en_demo.json", folder / "glaive_toolcall_en_demo.json")
    registry = json.loads((LLAMAFACTORY / "dataset_info.json").read_text())
    (folder / "dataset_info.json").write_text(
        json.dumps({"renamed": entry, "glaive_toolcall_en_demo": registry["glaive_toolcall_en_demo"]})
    )


def test_a_sharegpt_entry_with_its_own_columns_and_tags_reads_the_canonical_conversations(tmp_path):
    _renamed_glaive(tmp_path)
    renamed = load_documents(DataConfig(source="renamed", dataset_dir=str(tmp_path)))
    canonical = load_documents(DataConfig(source=str(LLAMAFACTORY / "glaive_toolcall_en_demo.json"), format="sharegpt"))
    registered = load_documents(DataConfig(source="glaive_toolcall_en_demo", dataset_dir=str(tmp_path)))
    assert len(renamed) == 20
    as_read = [(c.messages, c.tools) for c in canonical]  # type: ignore[union-attr]
    assert [(c.messages, c.tools) for c in renamed] == as_read  # type: ignore[union-attr]
    assert [(c.messages, c.tools) for c in registered] == as_read  # type: ignore[union-attr]
    assert any(m.get("tool_calls") for c in renamed for m in c.messages)  # type: ignore[union-attr]


def test_editing_an_entry_moves_the_store_and_is_seen_by_resume(tmp_path):
    """The token store's fingerprint holds what the entry says (its columns and tags decide the tokens), and the
    data a checkpoint records includes dataset_info.json."""
    _renamed_glaive(tmp_path)
    cfg = config(tmp_path, source="renamed", dataset_dir=str(tmp_path))
    before, recorded = store_path(cfg, chat_tokenizer()), data_files(cfg)
    registry = json.loads((tmp_path / "dataset_info.json").read_text())
    registry["renamed"]["columns"]["tools"] = None
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    assert store_path(cfg, chat_tokenizer()) != before
    assert str((tmp_path / "dataset_info.json").resolve()) in [path for path, _, _ in recorded]
    assert data_files(cfg) != recorded


REFUSALS = {
    "missing": ({"file_name": "missing.json"}, "names file_name 'missing.json', which is not a file in '{tmp}'"),
    "outside": ({"file_name": "../outside.json"}, "names file_name '../outside.json', outside the folder '{tmp}'"),
    "itself": ({"file_name": "dataset_info.json"}, "names the registry dataset_info.json itself as its file_name"),
    "hub": ({"hf_hub_url": "llamafactory/alpaca_en"}, "is read from hf_hub_url (a hub, script or cloud); fsdp2kit "),
    "modelscope": ({"ms_hub_url": "llamafactory/alpaca_en"}, "is read from ms_hub_url (a hub, script or cloud); "),
    "script": ({"script_url": "my_script"}, "is read from script_url (a hub, script or cloud); fsdp2kit reads local"),
    "cloud": ({"cloud_file_name": "s3://b/a.json"}, "is read from cloud_file_name (a hub, script or cloud); fsdp2"),
    "openai": ({"file_name": "data.json", "formatting": "openai"}, "has formatting 'openai'; valid: alpaca, sharegpt"),
    "ranking": ({"file_name": "data.json", "ranking": True}, "sets ranking: True, preference (chosen/rejected) data"),
    "sampled": ({"file_name": "data.json", "num_samples": 5}, "sets num_samples: 5, which fsdp2kit does not sample"),
    "kto": ({"file_name": "data.json", "columns": {"kto_tag": "label"}}, "has the column kto_tag of preference data"),
}


@pytest.mark.parametrize("name", [*REFUSALS, "unknown"])
def test_each_refused_entry_is_one_line_naming_it(tmp_path, name):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "data.json").write_text("[]")
    (tmp_path / "outside.json").write_text("[]")
    (folder / "dataset_info.json").write_text(json.dumps({key: attrs for key, (attrs, _) in REFUSALS.items()}))
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source=name, dataset_dir=str(folder)))
    message = str(error.value)
    assert "\n" not in message
    if name == "unknown":
        assert message == f"data.source: 'unknown' is not a dataset of '{folder / 'dataset_info.json'}'; valid: " + (
            ", ".join(REFUSALS)
        )
    else:
        where = f"data.source: dataset '{name}' of '{folder / 'dataset_info.json'}' "
        assert message.startswith(where + REFUSALS[name][1].format(tmp=folder))


def test_a_folder_without_a_registry_and_a_registry_folder_as_source_are_one_line(tmp_path):
    with pytest.raises(UserError, match=r"^data.dataset_dir: '.*' holds no dataset_info.json"):
        load_documents(DataConfig(source="identity", dataset_dir=str(tmp_path)))
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source=str(LLAMAFACTORY)))
    assert str(error.value) == (
        f"data.source: '{LLAMAFACTORY}' is a LLaMA-Factory data folder (its dataset_info.json names datasets: "
        f"identity, alpaca_en_demo, glaive_toolcall_en_demo, mllm_demo); set data.dataset_dir: '{LLAMAFACTORY}' "
        "and data.source to the names of the datasets to train on"
    )


def test_llamafactorys_mllm_entry_reads_its_images_and_tags_as_the_file_read_directly():
    """mllm_demo's entry (tags role/content, user/assistant; columns messages and images): a vision-language model
    reads the conversations and images that mllm_demo.json gives read directly."""
    from fsdp2kit.data.vl import load_conversations

    named = load_conversations(DataConfig(source="mllm_demo", dataset_dir=str(LLAMAFACTORY.resolve())))
    direct = load_conversations(DataConfig(source=str(LLAMAFACTORY.resolve() / "mllm_demo.json")))
    assert len(named) == 6 and [(c.messages, c.tools) for c in named] == [(c.messages, c.tools) for c in direct]
    assert all(c.images for c in named)


def test_mindspeed_native_dataset_and_its_registry_folder_name_the_datasets():
    """MindSpeed-MM's native basic_parameters: a dataset_dir holding dataset_info.json is data.dataset_dir and
    `dataset` (comma-separated) names its datasets; a media folder stays ignored, as the file's own does."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_real_configs import load_config, user_args

    config, swaps, _ = user_args("mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml", "tiny-qwen3.5-moe", 2)
    swaps = [s for s in swaps if not s.startswith("data.source=")]
    basic = "data.dataset_param.basic_parameters"
    named = [f"{basic}.dataset_dir={LLAMAFACTORY.resolve()}", f"{basic}.dataset=identity,alpaca_en_demo"]
    cfg = load_config(config, [*swaps, *named])
    assert (cfg.data.source, cfg.data.dataset_dir) == (["identity", "alpaca_en_demo"], str(LLAMAFACTORY.resolve()))
    as_written = load_config(config, swaps)
    assert (as_written.data.source, as_written.data.dataset_dir) == (
        "./data/mllm_format_llava_instruct_data.json",
        None,
    )
    assert any("basic_parameters.dataset_dir" in note for note in as_written.notes)


def test_an_entry_column_no_record_has_and_tags_without_speakers_are_one_line(tmp_path):
    """Issue 42 (2, 9): `columns` mapping prompt to a field no record has would train on empty user turns (LLaMA-Factory
    fails on it); `tags` that give role_tag alone name no speaker. Both are one line naming the entry."""
    shutil.copy(LLAMAFACTORY / "alpaca_en_demo.json", tmp_path / "alpaca.json")
    shutil.copy(LLAMAFACTORY / "glaive_toolcall_en_demo.json", tmp_path / "glaive.json")
    registry = {
        "nocolumn": {"file_name": "alpaca.json", "columns": {"prompt": "question", "response": "output"}},
        "sharecols": {"file_name": "glaive.json", "formatting": "sharegpt", "tags": {"role_tag": "from"}},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    where = f"data.source: dataset '{{}}' of '{tmp_path / 'dataset_info.json'}' "
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source="nocolumn", dataset_dir=str(tmp_path)))
    assert str(error.value).startswith(
        where.format("nocolumn") + f"maps column prompt to 'question', which no record of '{tmp_path / 'alpaca.json'}'"
        " has; its records' fields: input, instruction, output"
    )
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source="sharecols", dataset_dir=str(tmp_path)))
    assert str(error.value).startswith(where.format("sharecols") + "has tags without content_tag; an entry's tags")
    assert "give role_tag, content_tag, user_tag, assistant_tag (the defaults: role_tag: from" in str(error.value)


def test_a_mindspeed_native_dataset_that_is_a_file_is_that_file_beside_a_registry_folder():
    """Issue 42 (10): `dataset:` an existing data file with `dataset_dir:` its media root, a folder that also holds a
    dataset_info.json: the path was read as a registry name and refused. A value that is an existing file is that
    file (as MindSpeed-MM's load_dataset reads it); the folder stays the media root, ignored and noted."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from test_real_configs import load_config, user_args

    config, swaps, _ = user_args("mindspeed_mm/examples/qwen3_5/qwen3_5_35B_config.yaml", "tiny-qwen3.5-moe", 2)
    swaps = [s for s in swaps if not s.startswith("data.source=")]
    basic = "data.dataset_param.basic_parameters"
    file = str(LLAMAFACTORY.resolve() / "alpaca_en_demo.json")
    cfg = load_config(config, [*swaps, f"{basic}.dataset_dir={LLAMAFACTORY.resolve()}", f"{basic}.dataset={file}"])
    assert (cfg.data.source, cfg.data.dataset_dir) == (file, None)
    assert any("basic_parameters.dataset_dir" in note for note in cfg.notes)
