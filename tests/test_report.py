"""`fsdp2kit report`: PNG plots and a text summary of real runs' metrics; a bad run folder is a one-line error."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_cli

from fsdp2kit.cli import main

PLOTS = ["grad_norm.png", "loss.png", "lr.png", "memory.png", "tokens_per_s.png"]


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("report") / "two_ranks"
    result = run_cli(
        "train",
        "examples/demo.yaml",
        "--nproc",
        "2",
        "--set",
        "model.config.num_hidden_layers=1",
        "--set",
        "data.seq_len=32",
        "--set",
        "data.max_samples=200",
        "--set",
        "training.max_steps=4",
        "--set",
        "training.export_hf=false",
        "--set",
        "training.report_to=[]",
        "--set",
        "training.per_device_train_batch_size=2",
        "--set",
        f"training.output_dir={run}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return run


def assert_real_png(path, width=700, height=400):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = matplotlib.image.imread(path)
    assert pixels.shape[:2] == (height, width)
    assert len({tuple(p) for p in pixels.reshape(-1, pixels.shape[-1])[::7]}) > 10  # axes, text and lines drawn


@pytest.mark.slow
def test_report_plots_and_summarises_runs(two_rank_run, tmp_path, capsys):
    records = read_metrics(two_rank_run)
    other = tmp_path / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text("".join(json.dumps(r | {"loss": r["loss"] * 0.9}) + "\n" for r in records))

    assert main(["report", str(two_rank_run), str(other)]) == 0
    out = capsys.readouterr().out.splitlines()
    report = two_rank_run / "report"
    assert sorted(p.name for p in report.iterdir()) == PLOTS
    for name in PLOTS:
        assert_real_png(report / name)
    mean_tps = sum(r["tokens_per_s"] for r in records) / len(records)
    peak = max(r["peak_mem_bytes"] for r in records) / 1024**3
    assert out[0] == (
        f"{two_rank_run}: 4 steps (last 4), loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f}, "
        f"mean {mean_tps:,.0f} tokens/s, peak memory {peak:.2f} GiB (cpu_max_rss)"
    )
    assert out[1].startswith(f"{other}: 4 steps (last 4), loss {records[0]['loss'] * 0.9:.4f} -> ")
    assert out[2] == f"plots: loss.png, lr.png, grad_norm.png, tokens_per_s.png, memory.png in {report}"


def test_bad_run_folders_exit_2_with_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "nope")]) == 2
    give = "give the training.output_dir of a run"
    assert capsys.readouterr().err == f"error: report: run folder '{tmp_path / 'nope'}' does not exist; {give}\n"
    (tmp_path / "a_file").write_text("")
    assert main(["report", str(tmp_path / "a_file")]) == 2
    assert (
        capsys.readouterr().err
        == f"error: report: run folder '{tmp_path / 'a_file'}' is a file, not a folder; {give}\n"
    )
    (tmp_path / "a_file").unlink()
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: report: '{tmp_path}' has no metrics.jsonl; give the training.output_dir of a run\n"
    )
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    assert main(["report", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"error: report: line 2 of '{tmp_path / 'metrics.jsonl'}' is not a step record (the file is damaged)\n"
    )
