"""Weight sync in one process: the sharded export assembles into `full_weights` on every model kind; a delta sync
leaves the receiver bitwise equal to the trainer's weights cast to the rollout dtype, moving only what changed; a
damaged, lost or out-of-order message is caught and healed by a full sync; adapter-only sync drives a peft model; a
background sync sends the version it was started at while the next step runs (docs/weight_sync.md)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

import fsdp2kit
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.weight_sync import CorruptMessage, WeightMessage, WeightReceiver

MODELS = {
    "dense": {"name_or_path": "builtin:tiny-llama"},
    "tied": {"name_or_path": "builtin:tiny-qwen3"},
    "moe": {"name_or_path": "builtin:tiny-qwen3-moe"},
    "vl": {"name_or_path": "builtin:tiny-qwen2.5-vl"},
    "lora": {"name_or_path": "builtin:tiny-llama", "lora": {"rank": 4, "init_lora_weights": "gaussian"}},
}


@contextmanager
def strategy(model: dict, learning_rate: float = 1e-3) -> Iterator[fsdp2kit.Strategy]:
    config = {"model": model, "training": {"max_steps": 20, "learning_rate": learning_rate, "warmup_steps": 0}}
    try:
        yield fsdp2kit.Strategy.from_config(config)
    finally:
        shutdown()


def train_once(s: fsdp2kit.Strategy, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 200, (2, 12), generator=generator)
    s.train_step([{"input_ids": ids, "labels": ids}])


def assembled(shards: Iterator) -> dict[str, torch.Tensor]:
    """Whole tensors put together from the blocks the contributing ranks send."""
    whole: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not shard.contributes:
            continue
        tensor = whole.setdefault(shard.name, torch.full(shard.full_shape, float("nan"), dtype=shard.local.dtype))
        index = tuple(slice(o, o + n) for o, n in zip(shard.offset, shard.local.shape, strict=True))
        tensor[index] = shard.local
    return whole


def expected_weights(s: fsdp2kit.Strategy, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in s.full_weights(dtype=dtype)}


def assert_bitwise(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name].view(torch.int16), tensor.view(torch.int16)), name


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_the_sharded_export_assembles_into_full_weights(kind):
    with strategy(MODELS[kind]) as s:
        train_once(s, 0)
        assert_bitwise(assembled(s.sharded_weights(torch.bfloat16)), expected_weights(s, torch.bfloat16))


def rollout_receiver(s: fsdp2kit.Strategy) -> WeightReceiver:
    """A receiver over a bf16 transformers model of the trainer's architecture (the rollout engine's copy)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(s.sharded.source.hf_config, dtype=torch.bfloat16)
    return WeightReceiver.for_model(model)


def through_bytes(receiver: WeightReceiver, sent: list[bytes]):
    return lambda message: sent.append(message.to_bytes())


def deliver(receiver: WeightReceiver, sent: list[bytes]) -> int | None:
    versions = [receiver.receive(data) for data in sent]
    sent.clear()
    return next((v for v in reversed(versions) if v is not None), None)


def test_delta_sync_keeps_the_receiver_bitwise_equal_and_moves_what_changed():
    """fp32 master weights, bf16 rollout: after each step the receiver holds the trainer's weights cast to bf16, bit
    for bit, the first sync whole and the next ones as changes only (at a small learning rate, a fraction)."""
    with strategy(MODELS["dense"], learning_rate=1e-6) as s:
        receiver = rollout_receiver(s)
        sender = s.weight_sender(dtype=torch.bfloat16, bucket_bytes=1 << 16)
        sent: list[bytes] = []
        first = sender.sync(receiver.version, through_bytes(receiver, sent))
        assert first.full and first.messages > 1  # buckets of 64 KiB
        assert deliver(receiver, sent) == 0
        assert_bitwise(
            {n: receiver.tensors[n] for n in expected_weights(s, torch.bfloat16)}, expected_weights(s, torch.bfloat16)
        )
        for step in range(1, 4):
            train_once(s, step)
            stats = sender.sync(receiver.version, through_bytes(receiver, sent))
            assert not stats.full and stats.bytes < first.bytes / 2, stats
            assert 0 < stats.changed_fraction < 0.5
            assert deliver(receiver, sent) == step
            assert_bitwise(
                {n: receiver.tensors[n] for n in expected_weights(s, torch.bfloat16)},
                expected_weights(s, torch.bfloat16),
            )
        assert sender.base_bytes == sum(t.numel() * 2 for t in expected_weights(s, torch.bfloat16).values())
