"""The second adversarial pass (issue: never silently wrong, never a traceback): each input is built here, and each
ends in a correct result or exit code 2 with one sentence naming the file, key or line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO, SMALL_RUN, CliResult, read_metrics, run_cli, set_args, without_launcher_variables

from fsdp2kit.transformers_compat import configs_check_types

BILLION_LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def one_line_error(result, *fragments: str) -> str:
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            "training:\n  learning_rate: 1e-3\nmodel:\n  dtype: fp32\ntraining:\n  max_steps: 3\n",
            ["key 'training' is written twice (lines 1 and 5)"],
        ),
        (
            "training:\n  learning_rate: 1e-3\n  seed: 1\n  learning_rate: 1e-4\n",
            ["key 'learning_rate' is written twice (lines 2 and 4)"],
        ),
        (BILLION_LAUGHS, ["aliases expand to more than 1,000,000 values"]),
        ("a: &a [*a]\n", ["an anchor refers to itself"]),
        ("a: " + "[" * 20000 + "]" * 20000 + "\n", ["nested more than 100 levels deep"]),
    ],
    ids=["section twice", "key twice", "alias bomb", "recursive anchor", "deep nesting"],
)
def test_yaml_that_is_ambiguous_or_unbounded_is_one_line(tmp_path: Path, text: str, fragments: list[str]):
    config = tmp_path / "config.yaml"
    config.write_text(text)
    started = time.monotonic()
    result = run_cli("check", config, timeout=60)
    assert time.monotonic() - started < 20
    one_line_error(result, f"config file '{config}'", *fragments)


def test_a_set_value_with_a_key_twice_is_refused(tmp_path: Path, run_main):
    result = run_main(
        "check", "examples/demo.yaml", "--set", "model.config={num_hidden_layers: 1, num_hidden_layers: 2}"
    )
    one_line_error(result, "--set 'model.config=", "key 'num_hidden_layers' is written twice")


def test_merge_keys_are_not_duplicates(tmp_path: Path):
    """`<<: *base` then a key of the base: YAML's override, not a key written twice."""
    from fsdp2kit.config.yaml_io import read_yaml

    config = tmp_path / "merge.yaml"
    config.write_text("base: &base {seed: 1, max_steps: 2}\ntraining:\n  <<: *base\n  seed: 3\n")
    assert read_yaml(config)["training"] == {"seed": 3, "max_steps": 2}


def train_run(out: Path, *settings: str, run=run_cli, nproc: int = 1) -> subprocess.CompletedProcess | CliResult:
    """A short run of the demo into `out` (checkpoints every 2 steps) with `settings` (key=value) set, launched as
    its own process (on `nproc` ranks) or, with run=run_main, in this one."""
    base = {**SMALL_RUN, "training.max_steps": 4, "training.save_steps": 2, "training.output_dir": str(out)}
    ranks = ["--nproc", str(nproc)] if nproc > 1 else []
    return run("train", "examples/demo.yaml", *ranks, *set_args(base), *(a for s in settings for a in ("--set", s)))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 4-step run with checkpoints at steps 2 and 4, trained in this process."""
    from fsdp2kit.cli import main

    out = tmp_path_factory.mktemp("faults") / "run"
    with without_launcher_variables():
        code = train_run(out, "training.learning_rate=1e-3", run=lambda *args: main([str(a) for a in args]))
    assert code == 0
    return out


def test_a_resume_trains_at_the_learning_rate_it_is_given(trained: Path, tmp_path: Path, run_main):
    """The checkpoint's optimizer state holds the old learning rate and the scheduler its old peak: both give way to
    this run's, said in one line; steps 3-4 run at the lr a fresh run at 2e-3 has there."""
    step_2 = trained / "checkpoints" / "step_2"
    resumed = train_run(tmp_path / "resumed", "training.learning_rate=2e-3", f"training.resume={step_2}", run=run_main)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming with this run's optimizer settings: training.learning_rate 0.001 -> 0.002" in resumed.stdout
    fresh = train_run(tmp_path / "fresh", "training.learning_rate=2e-3", "training.save_steps=0", run=run_main)
    assert fresh.returncode == 0, fresh.stderr
    expected = [r["lr"] for r in read_metrics(tmp_path / "fresh")][2:]
    assert [r["lr"] for r in read_metrics(tmp_path / "resumed")] == expected


def test_a_crafted_trainer_state_sets_no_learning_rate(trained: Path, tmp_path: Path, run_main):
    checkpoint = tmp_path / "step_2"
    shutil.copytree(trained / "checkpoints" / "step_2", checkpoint)
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state["scheduler"]["base_lrs"] = [1e9] * len(state["scheduler"]["base_lrs"])
    state_file.write_text(json.dumps(state))
    resumed = train_run(
        tmp_path / "resumed", "training.learning_rate=1e-3", f"training.resume={checkpoint}", run=run_main
    )
    assert resumed.returncode == 0, resumed.stderr
    assert [r["lr"] for r in read_metrics(tmp_path / "resumed")] == [r["lr"] for r in read_metrics(trained)][2:]
    state["scheduler"] = "damaged"
    state_file.write_text(json.dumps(state))
    damaged = train_run(tmp_path / "again", f"training.resume={checkpoint}", run=run_main)
    one_line_error(damaged, "trainer_state.json' is damaged: its scheduler state")


def test_nan_weights_stop_the_run_instead_of_exporting_them(tmp_path: Path, run_main):
    import torch
    from conftest import make_hf_folder
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    result = train_run(
        tmp_path / "run",
        f"model.name_or_path={folder}",
        "training.max_steps=3",
        "training.export_hf=true",
        run=run_main,
    )
    assert result.returncode == 1, result.stderr
    assert "every one of this run's 3 steps had a non-finite loss" in result.stderr.splitlines()[-1]
    assert not (tmp_path / "run" / "hf").exists()
    assert torch.isnan(weights["model.norm.weight"][0])


def test_an_absurd_lora_scaling_is_refused(run_main):
    huge = "model.lora={rank: 8, alpha: 1000000000000000000000000000000}"
    result = run_main("check", "examples/demo.yaml", "--set", huge)
    one_line_error(result, "model.lora", "scales every adapter update by")


def test_resume_never_refuses_a_folder_with_another_runs_checkpoints(trained: Path, run_main):
    """Its saves would mix with the old ones and save_total_limit would delete the new run's, keeping the old
    run's newer step for the next `resume: auto`."""
    again = train_run(trained, "training.resume=never", "training.save_total_limit=1", run=run_main)
    one_line_error(again, "training.resume: never", "holds another run's checkpoints (step_2, step_4)")
    assert sorted(p.name for p in (trained / "checkpoints").iterdir()) == ["step_2", "step_4"]


def test_an_output_dir_that_is_the_model_folder_is_refused(tmp_path: Path, run_main):
    from conftest import make_hf_folder

    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    before = (folder / "config.json").read_text()
    result = train_run(folder, f"model.name_or_path={folder}", run=run_main)
    one_line_error(result, f"model.name_or_path: '{folder}' is training.output_dir")
    assert (folder / "config.json").read_text() == before


@pytest.mark.parametrize("check", [False, True], ids=["train", "check"])
def test_safetensors_a_tensor_in_two_files_or_a_damaged_index_is_one_line(tmp_path: Path, check: bool, run_main):
    from conftest import make_hf_folder

    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    shutil.copy(folder / "model.safetensors", folder / "model_backup.safetensors")

    def run() -> CliResult:
        if check:
            return run_main("check", "examples/demo.yaml", "--set", f"model.name_or_path={folder}")
        return train_run(tmp_path / "run", f"model.name_or_path={folder}", "training.max_steps=1", run=run_main)

    one_line_error(run(), "model.safetensors' and '", "model_backup.safetensors' both hold")
    (folder / "model_backup.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text('{"weight_map": ')
    one_line_error(run(), "model.safetensors.index.json' is damaged")


def test_a_config_json_field_of_the_wrong_type_is_one_line(tmp_path: Path, run_main):
    from conftest import make_hf_folder

    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": "64"}))
    result = run_main("check", "examples/demo.yaml", "--set", f"model.name_or_path={folder}")
    if configs_check_types():
        one_line_error(result, "config.json' is not a valid transformers config", "'hidden_size' expected int")
    else:  # transformers 5.2: plain config classes, the model's build fails on the string
        one_line_error(result, "transformers cannot build a model from this config", "does not check config.json's")


def test_a_seed_past_64_bits_is_one_line(run_main):
    result = run_main("check", "examples/demo.yaml", "--set", "training.seed=100000000000000000000000000")
    one_line_error(result, "'training.seed'", "less than 9223372036854775808")


def test_convert_into_an_existing_file_and_report_without_losses_are_one_line(trained: Path, tmp_path: Path, run_main):
    existing = tmp_path / "weights.pt"
    existing.write_text("mine")
    result = run_main("convert", trained / "checkpoints" / "step_4", existing, "--to", "torch")
    one_line_error(result, f"convert: '{existing}' exists and is not an empty folder")
    assert existing.read_text() == "mine"
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    one_line_error(run_main("report", tmp_path / "run"), "record 1 has no number for 'loss'")


def test_a_checkpoint_of_a_larger_model_is_refused_as_a_model_and_in_convert(trained: Path, tmp_path: Path, run_main):
    """A DCP checkpoint (2 layers) read as the weights of a 1-layer model: DCP would load what the model asks for and
    drop the second layer silently."""
    step = trained / "checkpoints" / "step_4"
    smaller = train_run(
        tmp_path / "run", f"model.name_or_path={step}", "model.config={num_hidden_layers: 1}", run=run_main
    )
    one_line_error(smaller, "cannot be loaded into this model", "model tensors this model lacks")
    hf = tmp_path / "hf"
    assert run_main("convert", step, hf, "--to", "hf").returncode == 0
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}))
    converted = run_main("convert", hf, tmp_path / "dcp", "--to", "dcp")
    one_line_error(converted, "convert --to dcp:", "which its config.json's model lacks")
    assert not (tmp_path / "dcp").exists()


def test_a_data_file_edited_since_the_checkpoint_is_refused_at_resume(tmp_path: Path, run_main):
    from fsdp2kit.data.builtin import corpus_documents

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_documents()[:200]))
    out, source = tmp_path / "run", f"data.source={data}"
    assert train_run(out, source, "training.max_steps=2", run=run_main).returncode == 0
    with data.open("a") as handle:
        handle.write(json.dumps({"text": "one more document"}) + "\n")
    refused = train_run(out, source, run=run_main)
    one_line_error(refused, f"data file '{data}' is not the one", "training.resume_allow_changes: true")
    allowed = train_run(out, source, "training.resume_allow_changes=true", run=run_main)
    assert allowed.returncode == 0, allowed.stderr
    assert "warning: training.resume: data file" in allowed.stdout


def prepare(source: Path, cache: Path) -> subprocess.CompletedProcess:
    return run_cli(
        "prepare", "examples/demo.yaml", "--set", f"data.source={source}", "--set", f"data.cache_dir={cache}"
    )


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        (b'{"text": ' + b"[" * 20000 + b"]" * 20000 + b"}\n", "line 2 nests JSON more than 200 levels deep"),
        (
            b'{"text": "' + b"x" * (17 << 20) + b'"}\n',
            "line 2 is a 17.0 MiB document, more than data.max_document_bytes",
        ),
        (b'{"text": "caf\xe9"}\n', "line 2 is not UTF-8 text (byte 0xe9"),
        (b'["a list", "not a record"]\n', "line 2 is not a JSON object"),
    ],
    ids=["20000 deep", "57 MB document", "not utf-8", "not an object"],
)
def test_a_crafted_data_line_is_one_line_quickly(tmp_path: Path, line: bytes, fragment: str):
    """Before this check pyarrow's JSON reader crashed the process on the deep line (exit 139) and a 57 MB line
    peaked at 9 GB."""
    source = tmp_path / "data.jsonl"
    source.write_bytes(b'{"text": "a fine first document"}\n' + line)
    started = time.monotonic()
    result = prepare(source, tmp_path / "cache")
    assert time.monotonic() - started < 30
    one_line_error(result, f"data.source: '{source}' {fragment}")


def test_a_first_line_nested_too_deep_is_one_line(tmp_path: Path):
    """The first line is read early, to tell conversations from plain text: there it ended in a RecursionError
    traceback."""
    source = tmp_path / "data.jsonl"
    source.write_bytes(b"[" * 20000 + b"]" * 20000 + b"\n")
    one_line_error(prepare(source, tmp_path / "cache"), f"data.source: '{source}' line 1 nests JSON more than 200")


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        (b'[{"messages": ' + b"[" * 20000 + b"]" * 20000 + b"}]", "nests JSON more than 200 levels deep"),
        (b'[{"messages": [}]', "is not a JSON array of records (Expecting value"),
        (b'[{"messages": []}, "not a record"]', "is not a JSON array of records (objects)"),
    ],
    ids=["20000 deep", "not json", "not objects"],
)
def test_a_crafted_json_array_file_is_one_line(tmp_path: Path, text: bytes, fragment: str):
    """A .json array (LLaMA-Factory's files) is read whole, not line by line: the deep one ended in a RecursionError
    traceback from Python's JSON parser."""
    source = tmp_path / "data.json"
    source.write_bytes(text)
    one_line_error(prepare(source, tmp_path / "cache"), f"data.source: '{source}' {fragment}")


def crafted_png(path: Path, width: int, height: int) -> Path:
    """A PNG whose header claims width x height pixels (its data is one pixel's): what a decompression bomb looks like
    to a reader that trusts the header."""
    import struct
    import zlib

    from PIL import Image

    Image.new("RGB", (1, 1)).save(path)
    data = bytearray(path.read_bytes())
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("size", "fragment"),
    [((30000, 30000), "decompression bomb"), ((12000, 10000), "more than 100,000,000"), ((20000, 3), "200 times")],
)
def test_an_image_past_the_pixel_budget_is_one_line(tmp_path: Path, size: tuple[int, int], fragment: str):
    from fsdp2kit.data.vl import _read_image
    from fsdp2kit.errors import UserError

    image = crafted_png(tmp_path / "image.png", *size)
    started = time.monotonic()
    with pytest.raises(UserError, match=fragment):
        _read_image(image, "record 1 of 'data.jsonl'")
    assert time.monotonic() - started < 10


def test_vl_lines_that_are_not_records_are_one_line(tmp_path: Path):
    from fsdp2kit.config.schema import DataConfig
    from fsdp2kit.data.vl import load_conversations
    from fsdp2kit.errors import UserError

    source = tmp_path / "vl.jsonl"
    for line, fragment in ((b"[1, 2]\n", "line 1 is not a JSON object"), (b'{"a": "\xff"}\n', "line 1 is not UTF-8")):
        source.write_bytes(line)
        with pytest.raises(UserError, match=fragment):
            load_conversations(DataConfig(source=str(source), pack=False))


@pytest.fixture
def adapter(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny HF model and a PEFT LoRA adapter trained on nothing but initialised with non-zero B (so merging it
    changes the weights)."""
    from conftest import make_hf_folder
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    model = make_hf_folder(base, "tiny-llama")
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], init_lora_weights="gaussian"))
    peft_model.save_pretrained(tmp_path / "adapter")
    return base, tmp_path / "adapter"


def test_an_adapter_whose_config_and_tensors_disagree_is_not_merged(
    adapter: tuple[Path, Path], tmp_path: Path, run_main
):
    base, folder = adapter
    config_file = folder / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, "target_modules": ["q_proj", "v_proj"]}))
    result = run_main("convert", base, tmp_path / "merged", "--to", "hf", "--adapter", folder)
    one_line_error(result, "convert --adapter:", "lacks '", "its adapter_config.json and tensors disagree")


@pytest.mark.parametrize("damage", ["rank", "pissa", "truncated"])
def test_a_damaged_adapter_is_one_line_in_check(adapter: tuple[Path, Path], damage: str, run_main):
    """pissa: an initialisation peft computes from the base weights as it injects (it crashed on the meta device)."""
    base, folder = adapter
    if damage in ("rank", "pissa"):
        config = json.loads((folder / "adapter_config.json").read_text())
        change = {"r": "abc"} if damage == "rank" else {"init_lora_weights": "pissa"}
        (folder / "adapter_config.json").write_text(json.dumps({**config, **change}))
        fragment = "has r = 'abc'" if damage == "rank" else "has init_lora_weights = 'pissa', an initialisation"
    else:
        weights = folder / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:500])
        fragment = "is not a readable safetensors file"
    result = run_main(
        "check",
        "examples/demo.yaml",
        "--set",
        f"model.name_or_path={base}",
        "--set",
        f"model.lora={{adapter: {folder}}}",
    )
    one_line_error(result, "model.lora.adapter", fragment)


TINY = "model.config={num_hidden_layers: 1, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4}"


@contextmanager
def small_disk(path: Path, size: str = "12m") -> Iterator[Path]:
    """A real 12 MB filesystem (tmpfs) at `path`: disk-full errors as the kernel and torch's writers raise them."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root; this machine's CI runs as root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_during_a_save_is_one_line_and_the_run_resumes_exactly(tmp_path: Path, async_save: bool, run_main):
    """A 12 MB tmpfs holds one checkpoint of this model (6.8 MiB) but not two: step_4's save fails with torch's
    'unexpected pos' (no errno); the run ends with one line, step_2 stays, and moved to a roomy disk the run resumes
    to the same losses as an uninterrupted run. One rank, in this process (the 2-rank case below launches)."""
    settings = [TINY, "training.max_steps=6", "training.save_total_limit=1", "training.report_to=[]"]
    settings.append(f"strategy_args.strategy_config.async_save_ckpt={str(async_save).lower()}")
    with small_disk(tmp_path / "disk") as disk:
        full = train_run(disk / "run", *settings, run=run_main)
        assert full.returncode == 1, full.stderr
        line = [entry for entry in full.stderr.splitlines() if entry.strip()][-1]
        assert line.startswith(f"error: no space left on device: checkpoint step_4 in '{disk / 'run' / 'checkpoints'}'")
        assert line.endswith("MiB free; checkpoint step_2 is intact"), line
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["step_2"]
        shutil.copytree(disk / "run", tmp_path / "moved")
    resumed = train_run(tmp_path / "moved", *settings, run=run_main)
    assert resumed.returncode == 0, resumed.stderr
    straight = train_run(tmp_path / "straight", *settings, run=run_main)
    assert straight.returncode == 0, straight.stderr
    losses = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "moved")}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6]
    assert [losses[s] for s in range(1, 7)] == pytest.approx(
        [r["loss"] for r in read_metrics(tmp_path / "straight")], abs=1e-6
    )


@pytest.mark.slow
def test_a_full_disk_during_an_async_save_at_two_ranks_is_one_line_and_the_run_resumes(tmp_path: Path):
    """At 2 ranks every rank's write fails in DCP's collective (torch's 'unexpected pos'); a rank that judged the disk
    after another had removed the partial folder saw room, and printed DCP's CheckpointException (or the missing
    folder's FileNotFoundError) as a traceback beside the one line. Now: the one line alone, step_2 intact, and the
    run moved to a roomy disk resumes from it."""
    settings = [TINY, "training.max_steps=6", "training.save_total_limit=1", "training.report_to=[]"]
    settings.append("strategy_args.strategy_config.async_save_ckpt=true")
    with small_disk(tmp_path / "disk") as disk:
        full = train_run(disk / "run", *settings, nproc=2)
        assert full.returncode == 1, full.stderr
        assert "Traceback" not in full.stderr + full.stdout, full.stderr
        lines = [entry for entry in full.stderr.splitlines() if entry.strip()]
        assert len(lines) == 1, full.stderr
        assert lines[0].startswith(f"error: no space left on device: checkpoint step_4 in '{disk / 'run'}/checkpoints'")
        assert lines[0].endswith("MiB free; checkpoint step_2 is intact"), lines[0]
        assert sorted(p.name for p in (disk / "run" / "checkpoints").iterdir()) == ["step_2"]
        shutil.copytree(disk / "run", tmp_path / "moved")
    resumed = train_run(tmp_path / "moved", *settings, nproc=2)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {tmp_path / 'moved' / 'checkpoints' / 'step_2'} at step 2" in resumed.stdout
    assert [r["step"] for r in read_metrics(tmp_path / "moved")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_a_full_disk_during_the_hf_export_or_the_token_store_is_one_line(tmp_path: Path):
    with small_disk(tmp_path / "disk", "9m") as disk:
        run = disk / "run"  # the final checkpoint (6.8 MiB) fits; the HF folder after it does not
        full = train_run(run, TINY, "training.max_steps=2", "training.save_steps=0", "training.export_hf=true")
        assert full.returncode == 1, full.stderr
        line = [entry for entry in full.stderr.splitlines() if entry.strip()][-1]
        assert line.startswith(f"error: no space left on device: the HF folder in '{run / 'hf'}' needs about"), line
        assert line.endswith("the checkpoints are intact: `fsdp2kit convert CHECKPOINT DST --to hf` writes it from one")
        assert (run / "checkpoints" / "step_2" / "trainer_state.json").is_file()
        assert not list((run / "hf").glob(".part-*"))
    from fsdp2kit.data.builtin import corpus_documents

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus_documents()) * 2)
    with small_disk(tmp_path / "cache", "1m") as cache:
        result = prepare(data, cache)
        assert result.returncode == 1, result.stderr
        assert result.stderr.strip().startswith("error: no space left on device: the token store in"), result.stderr
        assert "nothing was committed" in result.stderr


def launch(out: Path, *settings: str) -> subprocess.Popen:
    """`fsdp2kit train --nproc 2`, its output read line by line as the run reports it."""
    base = {**SMALL_RUN, "training.max_steps": 400, "training.save_steps": 3, "training.output_dir": str(out)}
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", "2", *set_args(base)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.Popen(
        command + [a for s in settings for a in ("--set", s)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_line(process: subprocess.Popen, prefix: str) -> None:
    """Read the run's output until a line starts with `prefix` (what the run reports, not a guessed delay)."""
    assert process.stdout is not None
    for line in process.stdout:
        if line.startswith(prefix):
            return
    raise AssertionError(f"the run ended before printing '{prefix}': {process.stderr.read() if process.stderr else ''}")


def rank_pids(launcher: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True).stdout.split()
    return sorted(int(pid) for pid in children)


@pytest.mark.slow
def test_a_killed_rank_ends_the_job_in_one_line_naming_it_and_the_intact_checkpoint(tmp_path: Path):
    job = launch(tmp_path / "run")
    wait_for_line(job, "checkpoint step_3:")
    wait_for_line(job, "step 5/")
    ranks = rank_pids(job.pid)
    assert len(ranks) == 2, ranks
    started = time.monotonic()
    os.kill(ranks[1], signal.SIGKILL)
    _, stderr = job.communicate(timeout=60)
    assert time.monotonic() - started < 30
    assert job.returncode == 1
    lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]
    assert not any("Traceback" in line for line in lines), stderr
    assert lines[-1].startswith("error: rank ") and " died (SIGKILL); checkpoint step_" in lines[-1], stderr
    assert lines[-1].endswith("is complete and the same command resumes from it")


@pytest.mark.slow
def test_a_killed_launcher_takes_its_ranks_with_it(tmp_path: Path):
    job = launch(tmp_path / "run")
    wait_for_line(job, "step 2/")
    ranks = rank_pids(job.pid)
    assert len(ranks) == 2, ranks
    started = time.monotonic()
    job.kill()
    job.wait()
    while any(Path(f"/proc/{pid}").exists() for pid in ranks) and time.monotonic() - started < 60:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{pid}").exists() for pid in ranks), "the ranks outlived their launcher"
    assert time.monotonic() - started < 30
    import fcntl

    with (tmp_path / "run" / ".fsdp2kit.lock").open("a") as lock:  # released: a new run could take it
        fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
