"""The verl and ROLL adapters at two data-parallel ranks (one launch runs both): each rank replays the framework's
worker calls on its share of every batch, and the run equals the plain PyTorch reference over the global batches —
verl's global loss-mask token count and dp_size, ROLL's loss scale over ranks and its global token counts; and ROLL's
with the two ranks as one Ulysses group (whole sequences gathered for its functions, the counts not divided)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO
from test_integration_roll import assert_same_as_plain as assert_roll_as_plain
from test_integration_roll import reference as roll_reference
from test_integration_verl import assert_same_as_plain as assert_verl_as_plain
from test_integration_verl import reference as verl_reference
from test_strategy import tiny_llama

from fsdp2kit.distributed import free_port


@pytest.mark.slow
def test_both_adapters_at_two_ranks_equal_plain_pytorch(tmp_path):
    model_dir = tiny_llama(tmp_path / "model")
    out = tmp_path / "out.pt"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    command += [str(free_port()), str(REPO / "tests" / "integration_worker.py"), str(model_dir), str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert got["verl"]["dp"] == (0, 2)
    assert_verl_as_plain(got["verl"], verl_reference(model_dir))
    assert_roll_as_plain(got["roll"], roll_reference(model_dir, ranks=2), slice(0, 2))  # rank 0's rows
    assert_roll_as_plain(got["roll_ulysses"], roll_reference(model_dir), slice(None))
