"""CPU offload of the shards (`strategy_config.offload_policy`) and `Strategy.offload_states`' host buffers: what the
CPU can show. tests/test_cuda.py runs both on a GPU (training parity, GB/s)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import process_group, sharded_model
from strategy_case import global_micro_batches, policy_loss, strategy_config
from test_strategy import strategy, tiny_llama
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp2kit.models.sharded as sharded_module
import fsdp2kit.parallel.fsdp as fsdp_module
from fsdp2kit.config.load import validate
from fsdp2kit.errors import UserError
from fsdp2kit.train.host_states import HostStates, copy_plan, slab_sizes, state_tensors


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("offload") / "model")


def test_copy_plan_lays_storages_end_to_end_across_slabs():
    plan = copy_plan([100, 300, 0, 50], [256, 256])
    assert [(s.storage, s.start, s.slab, s.slab_start, s.nbytes) for s in plan] == [
        (0, 0, 0, 0, 100),
        (1, 0, 0, 100, 156),  # the rest of slab 0 ...
        (1, 156, 1, 0, 144),  # ... and the first part of slab 1
        (3, 0, 1, 144, 50),
    ]
    with pytest.raises(ValueError, match="do not fit"):
        copy_plan([600], [256, 256])
    # Full slabs, then the smallest power of two that holds the rest; slabs already held count.
    assert slab_sizes(1000, [], 256) == [256, 256, 256, 256]
    assert slab_sizes(600, [256, 256], 256) == [128]
    assert slab_sizes(500, [256, 256], 256) == []


def _snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]


def test_offloaded_states_come_back_bitwise_into_reused_host_buffers(model_dir, tmp_path):
    """The real objects of a trained Strategy (FSDP shards, their gradients, AdamW's moments and steps): offload
    frees every storage, load restores every byte into the same tensors, and a second round trip reuses the host
    slabs. Slabs of 4 KiB make most storages span several."""
    with strategy(strategy_config(str(model_dir), str(tmp_path), 3)) as s:
        s.train_step(global_micro_batches(0, 1), policy_loss)
        params = [p for p in s.model.parameters() if p.requires_grad]
        for param in params:  # gradients, as a step leaves them when the caller holds them
            param.grad = torch.full_like(param, 0.25)
        parked = {
            kind: HostStates(torch.device("cpu"), slab_bytes=4096) for kind in ("model_params", "optimizer_states")
        }
        tensors = {kind: state_tensors(s.model, s.optimizer, kind) for kind in parked}
        assert len(tensors["optimizer_states"]) == 3 * len(s.optimizer.state) > 0  # step, exp_avg, exp_avg_sq
        assert len(tensors["model_params"]) >= 2 * len(params)  # and buffers
        before = {kind: _snapshot(ts) for kind, ts in tensors.items()}
        slabs = []
        for _ in range(2):
            moved = {kind: parked[kind].offload(tensors[kind]) for kind in parked}
            assert all(t.untyped_storage().nbytes() == 0 for ts in tensors.values() for t in _locals(ts))
            assert parked["model_params"].offload(tensors["model_params"]) == 0  # already parked: nothing moves
            assert {kind: parked[kind].load() for kind in parked} == moved
            for kind, ts in tensors.items():
                assert all(torch.equal(a, b) for a, b in zip(_snapshot(ts), before[kind], strict=True))
            slabs.append([slab.data_ptr() for p in parked.values() for slab in p.slabs])
        assert slabs[0] == slabs[1] and len(slabs[0]) > 2
        for param in params:
            param.grad = None
        loss = s.train_step(global_micro_batches(1, 1), policy_loss)["loss"]
    with strategy(strategy_config(str(model_dir), str(tmp_path / "plain"), 3)) as s:
        s.train_step(global_micro_batches(0, 1), policy_loss)
        assert s.train_step(global_micro_batches(1, 1), policy_loss)["loss"] == loss


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def test_offload_policy_materialises_the_shards_on_the_host(model_dir, monkeypatch):
    """FSDP refuses CPU offload of shards materialised on the accelerator. The real build, with `meta` standing in
    for the accelerator (this machine has none): under offload_policy the shards land on the CPU, with the weights
    of a build without offload (read from the HF folder, and fresh); buffers go to the compute device; FSDP's own
    check passes."""
    monkeypatch.setattr(fsdp_module.torch.cuda, "is_available", lambda: True)  # apply_fsdp's refusal on CPU
    real_mesh = sharded_module.build_mesh
    monkeypatch.setattr(sharded_module, "build_mesh", lambda _device_type, layout: real_mesh("cpu", layout))
    for name_or_path in (str(model_dir), "builtin:tiny-llama"):
        weights = []
        for offload in (False, True):
            config = {
                "model": {"name_or_path": name_or_path, "config": {"num_hidden_layers": 2}},
                "strategy_args": {"strategy_config": {"offload_policy": offload}},
            }
            cfg = validate(config, "config")
            with process_group() as runtime:
                on_host = dataclasses.replace(runtime, device=torch.device("cpu"))
                accelerator = dataclasses.replace(runtime, device=torch.device("meta"))
                model = sharded_model(cfg, accelerator if offload else on_host, training=True).model
                shards = {n: p.to_local() for n, p in model.named_parameters()}
                if offload:
                    assert {t.device.type for t in shards.values()} == {"cpu"}
                    assert {b.device.type for b in model.buffers()} == {"meta"}
                    for module in model.modules():
                        if isinstance(module, FSDPModule):
                            module._get_fsdp_state()._fsdp_param_group._validate_cpu_offload_params()
                weights.append(shards)
        assert weights[0].keys() == weights[1].keys()
        assert all(torch.equal(weights[0][n], weights[1][n]) for n in weights[0]), name_or_path


def test_steps_refuse_offloaded_states_until_they_are_loaded(model_dir, tmp_path):
    """Offloaded tensors keep no device memory: a step on them would read freed memory. What a CUDA offload does,
    done here on the CPU through the same buffers: forward_step needs the parameters, train_step every state."""
    with strategy(strategy_config(str(model_dir), str(tmp_path), 3)) as s:
        batch = global_micro_batches(0, 1)
        s.train_step(batch, policy_loss)
        for kind in ("optimizer_states", "model_params"):
            s.parked[kind] = HostStates(torch.device("cpu"))
            s.parked[kind].offload(state_tensors(s.model, s.optimizer, kind))
        with pytest.raises(UserError, match=r"forward_step: model_params are in host memory .* load_states\(\)"):
            s.forward_step(batch[0])
        s.parked["model_params"].load()
        s.forward_step(batch[0])  # the optimizer's state is not needed for a forward
        with pytest.raises(UserError, match="train_step: optimizer_states are in host memory"):
            s.train_step(batch, policy_loss)
        s.parked["optimizer_states"].load()
        s.train_step(batch, policy_loss)
