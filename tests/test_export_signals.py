"""A SIGTERM (or Ctrl-C) while the trained model is written out (issue 34's fourth pass: two SIGTERMs during export
were ignored): there is no step boundary left to stop at, so the export stops at once, in one line, and what is
intact (the last checkpoint; for `convert`, its source, with nothing left at the destination) is said."""

from __future__ import annotations

import json
import os
import signal

import torch
from conftest import make_hf_folder

from fsdp2kit.cli import main
from fsdp2kit.models import export

DEMO = "examples/demo.yaml"


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]


def test_a_sigterm_before_the_export_stops_the_run_with_its_checkpoint_intact(tmp_path, small_run, capsys, monkeypatch):
    monkeypatch.setenv("FSDP2KIT_FAULT", "before_export:1:0:SIGTERM")
    run = tmp_path / "run"
    argv = ["train", DEMO, *small_run, "--set", "training.max_steps=1", "--set", "training.export_hf=true"]
    assert main(argv) == 128 + signal.SIGTERM
    assert _errors(capsys) == [
        "error: interrupted by SIGTERM: the exports were not finished; checkpoint step_1 is intact"
    ]
    assert (run / "checkpoints" / "step_1" / "trainer_state.json").is_file() and not (run / "hf").exists()


def test_a_sigterm_during_convert_stops_it_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    make_hf_folder(tmp_path / "hf", "tiny-llama", layers=1)
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    close = export.SafetensorsWriter.close

    def interrupted(writer):
        close(writer)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(export.SafetensorsWriter, "close", interrupted)
    capsys.readouterr()
    dst = tmp_path / "out"
    assert main(["convert", str(tmp_path / "dcp"), str(dst), "--to", "hf"]) == 128 + signal.SIGTERM
    assert _errors(capsys) == [f"error: interrupted by SIGTERM: '{dst}' was not written"]
    assert not dst.exists()


def test_a_sigterm_while_the_hf_export_writes_leaves_no_partial_weights(tmp_path, small_run, capsys, monkeypatch):
    """A real SIGTERM to this process as the export has written a shard file and before it is named: its `.part-*`
    files were left in hf/. A later export of the run (resumed at its end) is not misled by the leftovers of one
    killed outright, where nothing could clean up: its parts, and an earlier sharded export's index and shards."""
    import safetensors.torch

    from fsdp2kit.models.build import safetensors_index

    save_file = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    run, argv = tmp_path / "run", ["train", DEMO, *small_run, "--set", "training.export_hf=true"]
    assert main([*argv, "--set", "training.max_steps=1"]) == 128 + signal.SIGTERM
    assert _errors(capsys) == [
        "error: interrupted by SIGTERM: the exports were not finished; checkpoint step_1 is intact"
    ]
    assert (run / "checkpoints" / "step_1" / "trainer_state.json").is_file() and not (run / "hf").exists()
    monkeypatch.undo()

    hf = run / "hf"
    hf.mkdir()
    save_file({"model.norm.weight": torch.zeros(64)}, str(hf / ".part-1.safetensors"))
    save_file({"lm_head.weight": torch.zeros(2, 64)}, str(hf / "model-00002-of-00002.safetensors"))
    weight_map = {
        "model.norm.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
    }
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert main([*argv, "--set", "training.max_steps=1"]) == 0
    assert sorted(p.name for p in hf.iterdir() if p.name.startswith(("model", ".part"))) == ["model.safetensors"]
    assert set(safetensors_index(hf).values()) == {hf / "model.safetensors"}


def test_a_sigterm_while_the_adapter_is_written_leaves_no_adapter_folder(tmp_path, small_run, capsys, monkeypatch):
    """A LoRA run's export stopped by a real SIGTERM once the adapter's weights were written: the folder held
    weights (or a config alone, when the config came first) that peft would try to load. Now nothing is left."""
    import safetensors.torch

    save_file = safetensors.torch.save_file

    def interrupted(tensors, filename, metadata=None):
        save_file(tensors, filename, metadata=metadata)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(safetensors.torch, "save_file", interrupted)
    run, lora = tmp_path / "run", "model.lora={rank: 4, alpha: 8, target_modules: all-linear}"
    argv = [
        "train",
        DEMO,
        *small_run,
        "--set",
        lora,
        "--set",
        "training.max_steps=1",
        "--set",
        "training.export_hf=true",
    ]
    assert main(argv) == 128 + signal.SIGTERM
    assert _errors(capsys) == [
        "error: interrupted by SIGTERM: the exports were not finished; checkpoint step_1 is intact"
    ]
    assert (run / "checkpoints" / "step_1" / "trainer_state.json").is_file() and not (run / "adapter").exists()
