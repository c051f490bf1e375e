"""Shared test helpers: run the real command line in a subprocess, read a run's metrics, a process group in this
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fsdp2kit ARGS` from the repo root, capturing text output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, "-m", "fsdp2kit", *map(str, args)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextmanager
def process_group(size: int = 1, rank: int = 0):
    """A process group in this process, yielding its Runtime: real gloo for one rank, torch's fake backend
    (collectives do nothing) to be rank `rank` of a larger world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp2kit.distributed import Runtime

    if size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield Runtime(rank, size, 0, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def token_batch(rows: int, length: int) -> dict[str, torch.Tensor]:
    """A training batch of seeded random tokens of the built-in vocabulary, every position a target."""
    from fsdp2kit.data.builtin import VOCAB_SIZE

    tokens = torch.randint(0, VOCAB_SIZE, (rows, length + 1), generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": tokens[:, :-1],
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": tokens[:, 1:],
    }


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


@pytest.fixture
def small_run(tmp_path):
    """--set overrides for a fast run of the built-in tiny Llama: 2 layers, 64-token samples, no checkpoints."""
    return [
        "--set",
        "model.config.num_hidden_layers=2",
        "--set",
        "data.seq_len=64",
        "--set",
        f"training.output_dir={tmp_path / 'run'}",
        "--set",
        "training.export_hf=false",
    ]
