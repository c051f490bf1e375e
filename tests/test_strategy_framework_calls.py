"""The calls of `fsdp2kit.Strategy` that RL frameworks' engines make besides a step (verl's engine interface, ROLL's
strategies): the learning-rate schedule stepped apart from the optimizer, the data-parallel rank/size/group, and
offload/load of named states."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from strategy_case import global_micro_batches, policy_loss, strategy_config
from test_strategy import strategy, tiny_llama
from torch.distributed.tensor import DTensor

from fsdp2kit.errors import UserError
from fsdp2kit.parallel.mesh import MeshLayout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("calls") / "model")


def test_the_schedule_holds_until_scheduler_step(model_dir, tmp_path):
    """verl steps the schedule once per RL step, after several optimizer steps: the steps taken with
    step_scheduler=False all use the same rate, scheduler_step moves it as the schedule says."""
    config = strategy_config(str(model_dir), str(tmp_path), 4)
    config["training"]["lr_scheduler_type"] = "linear"
    with strategy(config) as s:
        first = s.train_step(global_micro_batches(0, 1), policy_loss, step_scheduler=False)["lr"]
        second = s.train_step(global_micro_batches(1, 1), policy_loss, step_scheduler=False)["lr"]
        stepped = s.scheduler_step()
        third = s.train_step(global_micro_batches(2, 1), policy_loss)["lr"]
        after = s.optimizer.param_groups[0]["lr"]
    assert first == second == pytest.approx(1e-3)
    assert stepped == third == pytest.approx(1e-3 * 3 / 4)  # linear decay over 4 steps, one step taken
    assert after == pytest.approx(1e-3 * 2 / 4)  # a default train_step steps the schedule itself


def test_data_parallel_rank_size_and_group_at_one_rank(model_dir, tmp_path):
    with strategy(strategy_config(str(model_dir), str(tmp_path), 1)) as s:
        assert (s.data_parallel_rank(), s.data_parallel_size()) == (0, 1)
        assert s.data_parallel_group() is dist.group.WORLD


def test_data_parallel_groups_take_one_rank_of_each_ulysses_group():
    layout = MeshLayout((4,), ("fsdp",), ulysses_size=2)
    assert layout.sequence_parallel_groups() == [[0, 1], [2, 3]]
    assert layout.data_parallel_groups() == [[0, 2], [1, 3]]
    assert [layout.data_parallel_rank(rank) for rank in range(4)] == [0, 0, 1, 1]


def test_offload_names_are_roll_s_and_checked(model_dir, tmp_path):
    with strategy(strategy_config(str(model_dir), str(tmp_path), 1)) as s:
        s.offload_states(include=["optimizer_states"], non_blocking=True)
        s.load_states(include=["model_params", "optimizer_states"])
        with pytest.raises(UserError, match="grads is not one of model_params, optimizer_states"):
            s.offload_states(include=["grads"])


@pytest.mark.cuda
def test_offload_moves_only_the_named_states(model_dir, tmp_path):
    config = strategy_config(str(model_dir), str(tmp_path), 2)
    with strategy(config) as s:
        s.train_step(global_micro_batches(0, 1), policy_loss)
        moments = [state["exp_avg"] for state in s.optimizer.state.values()]
        assert moments and all(m.is_cuda for m in moments)
        # A moved tensor keeps its identity; its device memory is freed (its bytes wait in host buffers).
        s.offload_states(include=["optimizer_states"])
        assert all(_device_bytes(state["exp_avg"]) == 0 for state in s.optimizer.state.values())
        assert all(_device_bytes(p) > 0 for p in s.model.parameters())
        s.offload_states(include=["model_params"], non_blocking=True)
        torch.cuda.synchronize()
        assert all(_device_bytes(p) == 0 for p in s.model.parameters())
        s.load_states()
        assert all(_device_bytes(p) > 0 for p in s.model.parameters())
        assert all(_device_bytes(state["exp_avg"]) > 0 for state in s.optimizer.state.values())
        s.train_step(global_micro_batches(1, 1), policy_loss)


def _device_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().nbytes()
