"""The ROLL adapter at two data-parallel ranks: each rank replays ROLL's worker calls on its share of every batch,
and the run equals the plain PyTorch reference over the global batches (ROLL's loss scale over ranks and its global
token counts); and with the two ranks as one Ulysses group (whole sequences gathered for its functions, the counts
not divided). verl's adapter at two ranks is held to verl's own engine by tests_verl/ (`make test-verl`)."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_two_ranks
from test_integration_roll import assert_same_as_plain as assert_roll_as_plain
from test_integration_roll import reference as roll_reference
from test_strategy import tiny_llama


@pytest.mark.slow
def test_the_roll_adapter_at_two_ranks_equals_plain_pytorch(tmp_path):
    model_dir = tiny_llama(tmp_path / "model")
    out = tmp_path / "out.pt"
    launch_two_ranks("integration_worker.py", model_dir, out, timeout=300)
    got = torch.load(out, weights_only=False)
    assert_roll_as_plain(got["roll"], roll_reference(model_dir, ranks=2), slice(0, 2))  # rank 0's rows
    assert_roll_as_plain(got["roll_ulysses"], roll_reference(model_dir), slice(None))
