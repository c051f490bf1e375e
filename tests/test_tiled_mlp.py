"""SPEC §3 apply_tiled_mlp / tiled_num_shards: the MLPs run over sequence tiles and are recomputed tile by tile in
backward. Same losses and gradients as the plain MLP (one rank in this process, and 2 FSDP ranks with
reshard_after_forward), and measurably fewer activation bytes kept for backward at a long sequence."""

from __future__ import annotations

import pytest
import torch
from conftest import process_group, read_metrics, run_cli, set_args, sharded_model, token_batch
from torch.distributed.tensor import DTensor

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.errors import UserError
from fsdp2kit.models.builtin import BUILTIN_MODELS
from fsdp2kit.train.step import token_loss_sum

LAYERS = 2


def job(strategy: dict, name: str = "builtin:tiny-llama") -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"name_or_path": name, "config": {"num_hidden_layers": LAYERS}},
            "strategy_args": {"strategy_config": strategy},
        }
    )


def loss_and_gradients(strategy: dict) -> tuple[float, dict[str, torch.Tensor]]:
    with process_group() as runtime:
        model = sharded_model(job(strategy), runtime, training=True).model
        loss = token_loss_sum(model, token_batch(2, 37))  # 74 tokens: tiles of unequal size
        loss.backward()
        grads = {
            name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone()
            for name, p in model.named_parameters()
        }
    return loss.item(), grads


@pytest.mark.parametrize("num_shards", [1, 3])
def test_same_loss_and_gradients_as_the_plain_mlp(num_shards):
    plain_loss, plain = loss_and_gradients({})
    tiled_loss, tiled = loss_and_gradients({"apply_tiled_mlp": True, "tiled_num_shards": num_shards})
    assert tiled_loss == pytest.approx(plain_loss, rel=1e-6)
    for name, grad in plain.items():
        scale = grad.abs().max().item()
        assert (tiled[name] - grad).abs().max().item() <= 1e-5 * scale, name
    assert any("mlp" in name and grad.abs().sum() > 0 for name, grad in tiled.items())


def saved_activation_bytes(strategy: dict, seq_len: int) -> int:
    """Bytes of the distinct tensors autograd keeps for backward during one forward (parameters not counted)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with process_group() as runtime:
        model = sharded_model(job(strategy), runtime, training=True).model
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = token_loss_sum(model, token_batch(1, seq_len))
        loss.backward()  # the recomputation in backward runs, outside the accounting
    return sum(storages.values())


def test_saves_the_mlp_activations_at_a_long_sequence():
    seq_len = 2048
    plain = saved_activation_bytes({}, seq_len)
    tiled = saved_activation_bytes({"apply_tiled_mlp": True, "tiled_num_shards": 4}, seq_len)
    # What a plain MLP keeps per token: gate and up projections, the activation and their product, each of
    # intermediate_size fp32 values; TiledMLP keeps only its input, which the layer keeps anyway.
    intermediates = 4 * BUILTIN_MODELS["tiny-llama"]["intermediate_size"] * 4 * seq_len * LAYERS
    mib = 2**20
    print(
        f"\nsaved activations at {seq_len} tokens, {LAYERS} layers: plain {plain / mib:.1f} MiB, tiled "
        f"{tiled / mib:.1f} MiB (-{(plain - tiled) / mib:.1f} MiB, {1 - tiled / plain:.0%}; "
        f"MLP intermediates {intermediates / mib:.1f} MiB)"
    )
    assert plain - tiled >= intermediates


def test_moe_blocks_are_left_whole_and_a_dense_model_is_needed():
    with process_group() as runtime:
        with pytest.raises(UserError, match="no dense `mlp` module to tile"):
            sharded_model(
                job({"apply_tiled_mlp": True}, "builtin:tiny-qwen3-moe"), runtime, training=True, materialize=False
            )


def test_a_shard_group_inside_a_tiled_mlp_is_refused():
    with process_group() as runtime:
        with pytest.raises(UserError, match="'model.layers.0.mlp.gate_proj' is a shard group inside the tiled MLP"):
            sharded_model(
                job({"apply_tiled_mlp": True, "sub_modules_to_wrap": ["model.layers.{*}.mlp.gate_proj"]}),
                runtime,
                training=True,
                materialize=False,
            )


@pytest.mark.slow
def test_two_fsdp_ranks_train_the_same_with_and_without_tiles(tmp_path):
    """reshard_after_forward: true frees each layer's parameters after forward; the tiles' recomputation in backward
    must see them all-gathered again, and the summed tile gradients must reduce-scatter like the plain ones."""

    def train(name: str, strategy: dict) -> list[dict]:
        settings = {
            "model.name_or_path": "builtin:tiny-llama",
            "model.config.num_hidden_layers": LAYERS,
            "data.seq_len": 64,
            "training.max_steps": 3,
            "training.gradient_accumulation_steps": 2,
            "training.save_steps": 0,
            "training.export_hf": False,
            "training.output_dir": str(tmp_path / name),
            "strategy_args.strategy_config.reshard_after_forward": True,
        }
        settings |= {f"strategy_args.strategy_config.{key}": value for key, value in strategy.items()}
        result = run_cli("train", "examples/demo.yaml", "--nproc", "2", *set_args(settings), timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        return read_metrics(tmp_path / name)

    plain = train("plain", {})
    tiled = train("tiled", {"apply_tiled_mlp": True, "tiled_num_shards": 3})
    for a, b in zip(plain, tiled, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
