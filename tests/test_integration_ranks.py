"""The verl and ROLL adapters at two data-parallel ranks (one launch runs both): each rank replays the framework's
worker calls on its share of every batch, and the run equals the plain PyTorch reference over the global batches —
verl's global loss-mask token count and dp_size, ROLL's loss scale over ranks and its global token counts; and ROLL's
with the two ranks as one Ulysses group (whole sequences gathered for its functions, the counts not divided)."""

from __future__ import annotations

import pytest
import torch
from conftest import launch_two_ranks
from test_integration_roll import assert_same_as_plain as assert_roll_as_plain
from test_integration_roll import reference as roll_reference
from test_integration_verl import assert_same_as_plain as assert_verl_as_plain
from test_integration_verl import reference as verl_reference
from test_strategy import tiny_llama


@pytest.mark.slow
def test_both_adapters_at_two_ranks_equal_plain_pytorch(tmp_path):
    model_dir = tiny_llama(tmp_path / "model")
    out = tmp_path / "out.pt"
    launch_two_ranks("integration_worker.py", model_dir, out, timeout=300)
    got = torch.load(out, weights_only=False)
    assert got["verl"]["dp"] == (0, 2)
    assert_verl_as_plain(got["verl"], verl_reference(model_dir))
    assert_roll_as_plain(got["roll"], roll_reference(model_dir, ranks=2), slice(0, 2))  # rank 0's rows
    assert_roll_as_plain(got["roll_ulysses"], roll_reference(model_dir), slice(None))
