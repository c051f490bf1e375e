"""A checkpoint that fails on one rank stops every rank with the error, promptly: before, the failing rank raised
and the other waited in DCP's collective until the job was killed (ROLL's per-rank folders did exactly that)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_faults import small_disk
from test_strategy import REPO, tiny_llama

from fsdp2kit.distributed import free_port


def save_on_two_ranks(tmp_path: Path, case: str, env: dict[str, str], out: Path | None = None) -> tuple[str, str]:
    """What each rank raised saving the tiny model's checkpoint under `out` (default: in tmp_path)."""
    out = out or tmp_path / "out"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    command += [str(free_port()), str(REPO / "tests" / "checkpoint_failure_worker.py")]
    command += [str(tiny_llama(tmp_path / "model", vocab=4096)), str(out), case]
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        command, env={**base, "OMP_NUM_THREADS": "1", **env}, capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return Path(f"{out}.rank0").read_text(), Path(f"{out}.rank1").read_text()


@pytest.mark.slow
def test_a_folder_per_rank_is_refused_on_every_rank(tmp_path):
    rank0, rank1 = save_on_two_ranks(tmp_path, "folders", {})
    for raised in (rank0, rank1):
        assert raised.startswith("UserError: save_checkpoint: every rank must give the same folder"), raised
        assert "rank 0: '" in raised and "rank-1/checkpoint-1'" in raised


@pytest.mark.slow
def test_a_full_disk_on_one_rank_stops_both(tmp_path):
    rank0, rank1 = save_on_two_ranks(tmp_path, "disk", {"FSDP2KIT_FAULT": "before_save:0:1:ENOSPC"})
    assert rank1.startswith("RunFault:") and "disk" in rank1.lower(), rank1
    assert rank0.startswith("RunFault: checkpoint checkpoint-1 failed on rank 1 (OSError: [Errno 28]"), rank0


@pytest.mark.slow
def test_a_full_disk_judged_by_a_slower_rank_is_the_same_fault_on_both(tmp_path):
    """A real 2 MB tmpfs: the config and tokenizer fit, the shards (2.4 MB) do not, and both ranks' DCP write fails
    with torch's 'unexpected pos' (no errno), so each judges by the space left. Rank 1 judges a second later than
    rank 0: before, rank 0 had removed the partial folder by then, rank 1 saw room and raised DCP's
    CheckpointException (a traceback at the command line). Now both judge before the folder goes: one fault."""
    with small_disk(tmp_path / "disk", "2m") as disk:
        rank0, rank1 = save_on_two_ranks(tmp_path, "late_verdict", {}, out=disk / "out")
        for raised in (rank0, rank1):
            assert raised.startswith(f"RunFault: no space left on device: checkpoint step_0 in '{disk / 'out.run'}'")
            assert raised.endswith("; no earlier checkpoint was written"), raised
        assert not (disk / "out.run" / ".tmp-checkpoint-1").exists()
