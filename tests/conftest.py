"""Shared test helpers: run the real command line in a subprocess, read a run's metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fsdp2kit ARGS` from the repo root, capturing text output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "fsdp2kit", *map(str, args)], cwd=REPO, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture
def small_run(tmp_path):
    """--set overrides for a fast run of the built-in tiny Llama: 2 layers, 64-token samples, no checkpoints."""
    return ["--set", "model.config.num_hidden_layers=2", "--set", "data.seq_len=64",
            "--set", f"training.output_dir={tmp_path / 'run'}", "--set", "training.export_hf=false"]
