"""What a new user meets first: the long-context and Muon examples train as their comments say and `plan` reads
them, every run says its layout at its start, and the small messages point at the fix."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from fsdp2kit.distributed import OLDEST_TORCH
from fsdp2kit.errors import UserError

LONG = "examples/long_context.yaml"
MUON = "examples/muon.yaml"

# The example runs the README's next steps name: config, --nproc, --set overrides, words their layout lines hold.
TRAINED = [
    (LONG, 2, [], ["mesh fsdp 2 (2 ranks)", "context parallel 2", "1/2 of every row: chunks r and 3-r of 4"]),
    (LONG, 4, ["model.ulysses_size=2"], ["mesh fsdp 4 (4 ranks)", "ulysses 2 x context parallel 2", "1/4 of"]),
    (MUON, 2, [], ["mesh fsdp 2 (2 ranks)", "whole rows", "optimizer muon (hidden_matrices): 28 matrices Muon"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("config, nproc, extra, expected", TRAINED, ids=["cp2", "ulysses2xcp2", "muon"])
def test_an_example_trains_two_steps_and_says_its_layout_once(tmp_path, config, nproc, extra, expected):
    overrides = [f"training.output_dir={tmp_path}", "training.max_steps=2", "training.export_hf=false", *extra]
    result = run_cli("train", config, "--nproc", str(nproc), *[a for o in overrides for a in ("--set", o)])
    assert result.returncode == 0, result.stderr[-3000:]
    layout = [line for line in result.stdout.splitlines() if line.startswith("layout: ")]
    assert len(layout) == 2, result.stdout  # once, by rank 0 only
    for words in expected:
        assert words in " ".join(layout), layout
    assert "done: 2 steps" in result.stdout


def _readme_next_steps() -> list[list[str]]:
    """The `fsdp2kit` lines of the README's block that follows `make train`, split as a shell splits them."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("Next steps after `make train`", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.startswith("source .venv/bin/activate\n")
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("fsdp2kit ")]


def test_the_readme_next_steps_parse_and_train_what_the_tests_train():
    from fsdp2kit.cli import _parser

    lines = _readme_next_steps()
    trained = []
    for argv in lines:
        args = _parser().parse_args(argv)  # an unknown option exits here
        if args.command == "train":
            assert (REPO / args.config).is_file()
            trained.append((args.config, args.nproc, args.overrides))
    assert sorted(trained) == sorted((config, nproc, extra) for config, nproc, extra, _ in TRAINED)
    assert ["report", "runs/demo"] in lines


def test_plan_reads_the_examples(run_main):
    # The README's two plan lines; Ulysses 2 x CP 2 holds a quarter of the rows CP 2 holds half of (one plan each).
    for config, args in [(LONG, ["--nproc", "2"]), (MUON, ["--nproc", "2"])]:
        result = run_main("plan", config, *args)
        assert result.returncode == 0, result.stderr
        assert "GiB" in result.stdout or "MiB" in result.stdout


def test_the_plain_demo_says_its_layout(run_main):
    from conftest import process_group

    from fsdp2kit.config.load import load_config
    from fsdp2kit.models.sharded import build_sharded_model
    from fsdp2kit.train.run_layout import run_layout

    cfg = load_config("examples/demo.yaml", ["training.max_steps=1"])
    with process_group() as runtime:
        sharded = build_sharded_model(
            cfg.model, cfg.strategy_args.strategy_config, cfg.data, runtime, training=True, seed=1, materialize=False
        )
        lines = run_layout(sharded, cfg.model, cfg.data, cfg.training, runtime.device)
    assert lines[0] == "layout: mesh fsdp 1 (1 rank); data-parallel 1; each rank holds whole rows"
    assert "attention document_sdpa; packed documents: sdpa by documents" in lines[1]
    assert "optimizer adamw: every trainable parameter" in lines[1]


def test_context_parallel_size_under_strategy_config_is_answered_with_its_key(run_main):
    result = run_main("check", "examples/demo.yaml", "--set", "strategy_args.strategy_config.context_parallel_size=2")
    assert result.returncode == 2
    assert "as 'model.context_parallel_size'" in result.stderr
    assert "did you mean" not in result.stderr


def test_a_layout_that_needs_more_ranks_says_how_many_to_launch():
    from fsdp2kit.config.schema import StrategyConfig
    from fsdp2kit.parallel.mesh import mesh_layout

    with pytest.raises(UserError, match=r"launch with --nproc 4 \(or a multiple of it\)"):
        mesh_layout(2, StrategyConfig(), ulysses_size=2, context_parallel_size=2)
    with pytest.raises(UserError, match=r"launch with --nproc 2 "):
        mesh_layout(1, StrategyConfig(), ulysses_size=1, context_parallel_size=2)


def test_train_help_describes_nproc_as_a_launch(run_main, capsys):
    with pytest.raises(SystemExit):
        run_main("train", "--help")
    train_help = " ".join(capsys.readouterr().out.split())
    assert "--nproc NPROC launch this many local ranks" in train_help
    assert "plan for" not in train_help
    with pytest.raises(SystemExit):
        run_main("plan", "--help")
    assert "the world size to plan for" in " ".join(capsys.readouterr().out.split())


def test_pyproject_asks_for_the_oldest_torch_fsdp2kit_accepts():
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_floor = next(d for d in dependencies if re.match(r"torch\b", d))
    assert torch_floor == "torch>={}.{}".format(*OLDEST_TORCH)
    assert "torch==2.13.0" in (REPO / "Makefile").read_text()


def test_check_prints_notes_as_written_not_escaped(run_main, tmp_path):
    result = run_main(
        "check", "examples/roll_rlvr.yaml", "--set", "device_mapping=[0]", "--set", f"training.output_dir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr
    assert "→" in result.stdout
    assert "\\u2192" not in result.stdout


def test_no_document_cites_a_specification_the_repository_lacks():
    documents = [REPO / "README.md", REPO / "fsdp2kit" / "cli.py", *sorted((REPO / "docs").glob("*.md"))]
    cited = [p.name for p in documents if "SPEC §" in Path(p).read_text()]
    assert not cited
