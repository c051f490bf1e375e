"""NO_SHARD on the CPU reduces like DistributedDataParallel: each shard group's gradient all-reduce is issued
without waiting and overlaps the rest of backward (parallel/replica_reduce.py), and training equals torch's DDP."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_two_ranks
from test_strategy import tiny_llama


@pytest.mark.slow
def test_no_shard_overlaps_its_all_reduces_and_trains_as_ddp(tmp_path):
    out = tmp_path / "runs.pt"
    launch_two_ranks("replica_reduce_worker.py", tiny_llama(tmp_path / "model"), out)
    runs = torch.load(out)
    ddp = runs["ddp"]
    assert ddp["losses"][0] != ddp["losses"][-1]  # it trained
    # Within what fsdp2kit's loss arithmetic differs from this loop's (as tests/test_strategy.py): the same before
    # the overlap, bit for bit.
    for name in ("overlapped", "sync_each_batch"):
        assert runs[name]["losses"] == pytest.approx(ddp["losses"], abs=1e-6), name
        for key, tensor in ddp["weights"].items():
            torch.testing.assert_close(runs[name]["weights"][key], tensor, rtol=0, atol=1e-5, msg=f"{name}: {key}")
    # One wait per step, at the end of the last micro-batch's backward, with every group's all-reduce in flight
    # (tiny_llama: 2 decoder layers and the root) ...
    assert runs["in_flight"] == [3, 3]
    # ... except where FSDP adds the reduced buffer to a gradient already there: the first micro-batch overlaps,
    # the second waits for each group at once.
    assert runs["sync_each_batch_in_flight"] == [3, 3]
