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
from torch.distributed.tensor import DTensor

import fsdp2kit
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.models.shards import WeightShard
from fsdp2kit.weight_sync import Block, CorruptMessage, WeightMessage, WeightReceiver

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


def assert_received(receiver: WeightReceiver, s: fsdp2kit.Strategy) -> None:
    want = expected_weights(s, torch.bfloat16)
    assert_bitwise({name: receiver.tensors[name] for name in want}, want)
    assert sorted(receiver.tensors) == sorted(want)


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


@pytest.mark.parametrize("fault", ["flipped byte", "dropped message", "receiver restarted"])
def test_a_damaged_or_lost_sync_is_caught_and_healed_by_a_full_one(fault, caplog):
    """The receiver never applies a sync it did not get whole and intact, and says so in one line; it stays at its
    version, which the next sync sees: that one goes whole (one line on the sender) and the receiver is equal again."""
    with strategy(MODELS["dense"], learning_rate=1e-5) as s:
        receiver = rollout_receiver(s)
        sender = s.weight_sender(dtype=torch.bfloat16, bucket_bytes=1 << 16)
        sent: list[bytes] = []
        sender.sync(receiver.version, through_bytes(receiver, sent))
        deliver(receiver, sent)
        train_once(s, 1)
        sender.sync(receiver.version, through_bytes(receiver, sent))
        before = {name: tensor.clone() for name, tensor in receiver.tensors.items()}
        if fault == "flipped byte":
            damaged = bytearray(sent[1])
            damaged[len(damaged) // 2] ^= 0x10
            sent[1] = bytes(damaged)
        elif fault == "dropped message":
            del sent[1]
        else:  # a new rollout process: the rest of the delta reaches a receiver at no version
            receiver = rollout_receiver(s)
            before = {name: tensor.clone() for name, tensor in receiver.tensors.items()}
            del sent[0]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp2kit.weight_sync"):
            assert deliver(receiver, sent) is None
        assert all(torch.equal(receiver.tensors[name], tensor) for name, tensor in before.items())  # untouched
        assert len(caplog.records) == (fault == "flipped byte"), caplog.text  # a lost message leaves no sync whole
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fsdp2kit.weight_sync"):
            healed = sender.sync(receiver.version, through_bytes(receiver, sent))
        assert healed.full
        assert [r.getMessage() for r in caplog.records] == [
            f"weight sync: version 1 did not reach the receiver whole (it holds version {receiver.version}): sending "
            "version 1 whole"
        ]
        assert deliver(receiver, sent) == 1
        assert_received(receiver, s)


def dense_block() -> Block:
    return Block("w", (4, 3), (2, 0), (2, 3), torch.arange(6, dtype=torch.bfloat16))


def sparse_block() -> Block:
    """Three changes in the 3 x 3 block at column 2 of a 3 x 5 tensor, at the block's flat positions 1, 4 and 8."""
    values = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    return Block("v", (3, 5), (0, 2), (3, 3), values, torch.tensor([0, 3, 4], dtype=torch.uint8), start=1)


def test_changes_land_where_their_block_sits():
    """A full sync, then changes to a block cut along columns (not one flat range): each value at its place."""
    receiver = WeightReceiver({"v": torch.zeros(3, 5, dtype=torch.bfloat16)})
    whole = Block("v", (3, 5), (0, 0), (3, 5), torch.zeros(15, dtype=torch.bfloat16))
    assert receiver.receive(WeightMessage(0, 6, None, "model", 0, 1, 0, 1, [whole]).seal().to_bytes()) == 6
    assert receiver.receive(WeightMessage(1, 7, 6, "model", 0, 1, 0, 1, [sparse_block()]).seal().to_bytes()) == 7
    expected = torch.zeros(3, 5, dtype=torch.bfloat16)
    expected[0, 3], expected[1, 3], expected[2, 4] = 1.0, 2.0, 3.0
    assert torch.equal(receiver.tensors["v"], expected)


def test_a_message_is_checked_before_anything_in_it_is_believed():
    """Every byte flipped in turn, and every truncation, of a small message: each is refused as corrupt or read back
    as the same message (a flip in the safetensors header's padding), never as another tensor; bounded work."""
    message = WeightMessage(3, 7, 6, "model", 0, 1, 0, 1, [dense_block(), sparse_block()]).seal()
    data = message.to_bytes()
    assert WeightMessage.from_bytes(data).header() == message.header()
    for cut in range(len(data)):
        with pytest.raises(CorruptMessage):
            WeightMessage.from_bytes(data[:cut])
    for i in range(len(data)):
        flipped = bytearray(data)
        flipped[i] ^= 0x01
        try:
            read = WeightMessage.from_bytes(bytes(flipped))
        except CorruptMessage:
            continue
        assert read.header() == message.header(), i
        for got, sent in zip(read.blocks, message.blocks, strict=True):
            assert torch.equal(got.values, sent.values) and torch.equal(got.positions(), sent.positions()), i


def test_a_sync_that_does_not_fit_the_receiver_is_refused_in_one_line():
    """Not corruption (the checksum holds) but another model: a crash naming the tensor, never a partial apply."""
    receiver = WeightReceiver({"w": torch.zeros(4, 3, dtype=torch.bfloat16)})
    wrong_shape = WeightMessage(
        0, 0, None, "model", 0, 1, 0, 1, [Block("w", (3, 4), (0, 0), (3, 4), torch.ones(12, dtype=torch.bfloat16))]
    )
    with pytest.raises(ValueError, match=r"'w' is torch.bfloat16 \[3, 4\] in the sync, torch.bfloat16 \[4, 3\] here"):
        receiver.receive(wrong_shape.seal())
    half = WeightMessage(
        1, 0, None, "model", 0, 1, 0, 1, [Block("w", (4, 3), (0, 0), (2, 3), torch.ones(6, dtype=torch.bfloat16))]
    )
    with pytest.raises(ValueError, match="a full sync that does not cover 'w' \\(6 of 12 elements"):
        receiver.receive(half.seal())
    twice = [Block("w", (4, 3), (0, 0), (2, 3), torch.ones(6, dtype=torch.bfloat16)) for _ in range(2)]
    with pytest.raises(ValueError, match="a full sync with overlapping blocks of 'w'"):
        receiver.receive(WeightMessage(2, 0, None, "model", 0, 1, 0, 1, twice).seal())
    assert receiver.version is None and not receiver.tensors["w"].any()


def replace_local(shard: WeightShard, live: torch.Tensor) -> WeightShard:
    local = (live.to_local() if isinstance(live, DTensor) else live).to(torch.bfloat16)
    return WeightShard(shard.name, local, shard.full_shape, shard.offset, shard.contributes)


class SkippingSnapshot(fsdp2kit.weight_sync.WeightSender):
    """A background sync that reads the weights on its thread instead of copying them first (what the snapshot
    prevents): the check below must catch it."""

    def start(self, receiver_version, send):
        self.wait()
        version = self.current_version()
        full = self._begin(version, receiver_version)
        shards = list(self.shards())  # the stream is read here, but the blocks are taken from the live weights later
        live = dict(self._live)
        blocks = self._blocks((replace_local(shard, live[shard.name]) for shard in shards), full)
        self.running = fsdp2kit.weight_sync.sender._Background(lambda: self._send(blocks, version, full, send))
        return self.running


def background_sync_holds_its_version(sender_class) -> bool:
    """Start a background sync, step the model while its messages wait to be sent, then deliver: does the receiver
    hold the weights of the version the sync was started at?"""
    with strategy(MODELS["dense"], learning_rate=1e-3) as s:
        receiver = rollout_receiver(s)
        sender = s.weight_sender(dtype=torch.bfloat16, bucket_bytes=1 << 16)
        sender.__class__ = sender_class
        sender._live = {name: p.detach() for name, p in s.model.named_parameters()}
        sent: list[bytes] = []
        stepped = threading.Event()

        def after_the_step(message):
            stepped.wait(timeout=60)
            sent.append(message.to_bytes())

        sender.sync(receiver.version, through_bytes(receiver, sent))
        deliver(receiver, sent)
        train_once(s, 1)
        version_one = expected_weights(s, torch.bfloat16)
        sender.start(receiver.version, after_the_step)
        train_once(s, 2)  # the next step runs while the sync of version 1 is in flight
        stepped.set()
        stats = sender.wait()
        assert stats is not None and stats.version == 1 and deliver(receiver, sent) == 1
        return all(torch.equal(receiver.tensors[name], tensor) for name, tensor in version_one.items())


def test_a_background_sync_sends_the_version_it_started_at():
    assert background_sync_holds_its_version(fsdp2kit.weight_sync.WeightSender)
    assert not background_sync_holds_its_version(SkippingSnapshot)


def peft_rollout(base_folder, adapter_config: dict) -> torch.nn.Module:
    """The rollout side of an adapter-only sync: the base model from its folder, the adapters the config names."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_folder, dtype=torch.float32)
    settings = {k: v for k, v in adapter_config.items() if k in LoraConfig.__dataclass_fields__}
    return get_peft_model(base, LoraConfig(**settings)).eval()


def test_adapter_only_sync_drives_a_peft_model_to_the_trainer_s_log_probs(tmp_path):
    """A LoRA run sends only its adapters (peft's file names, with their adapter_config): the first sync whole,
    then changes; a peft model over the same base then gives the trainer's log-probs."""
    from conftest import make_hf_folder

    make_hf_folder(tmp_path / "base", "tiny-llama", hidden_size=64, intermediate_size=128, num_attention_heads=4)
    model = {
        "name_or_path": str(tmp_path / "base"),
        "dtype": "fp32",
        "lora": {"rank": 4, "target_modules": "all-linear"},
    }
    with strategy(model, learning_rate=1e-2) as s:
        assert s.weight_parts == ["model", "adapter"]
        sender = s.weight_sender(part="adapter")
        messages: list[WeightMessage] = []
        first = sender.sync(None, messages.append)
        assert first.full and messages[0].config["r"] == 4
        rollout = peft_rollout(tmp_path / "base", messages[0].config)
        receiver = WeightReceiver.for_adapter(rollout)
        assert all(receiver.receive(m.to_bytes()) in (None, 0) for m in messages) and receiver.version == 0
        ids = torch.randint(3, 200, (2, 16), generator=torch.Generator().manual_seed(5))
        for step in range(1, 3):
            train_once(s, step)
            messages.clear()
            stats = sender.sync(receiver.version, messages.append)
            assert not stats.full and stats.bytes <= first.bytes  # fp32 adapters: every value moves, sent whole
            assert [receiver.receive(m) for m in messages][-1] == step
            want = s.forward_step({"input_ids": ids})["log_probs"]
            with torch.no_grad():
                logits = rollout(input_ids=ids).logits.float()
            got = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_adapter_only_sync_of_a_model_without_adapters_is_refused():
    with strategy(MODELS["dense"]) as s:
        assert s.weight_parts == ["model"]
        with pytest.raises(UserError, match="weight_sender: part='adapter' is not a part of this model's weights"):
            s.weight_sender(part="adapter")


def test_plan_counts_the_host_copy_a_delta_sync_keeps():
    """`plan`'s weight_sync_host_bf16 is what the sender's diff base holds after a sync (one bf16 copy of the
    rank's shards)."""
    from conftest import REPO

    from fsdp2kit.memory_plan import ConfigSource, predict

    source = ConfigSource(str(REPO / "examples/demo.yaml"), ["model.name_or_path=builtin:tiny-qwen3"], None, None)
    planned = predict(source, 1)["computed"]["weight_sync_host_bf16"]
    with strategy(MODELS["tied"]) as s:
        sender = s.weight_sender(dtype=torch.bfloat16)
        sender.sync(None, lambda message: None)
        assert sender.base_bytes == planned > 0


def test_full_every_sends_every_nth_version_whole():
    with strategy(MODELS["dense"], learning_rate=1e-6) as s:
        receiver = rollout_receiver(s)
        sender = s.weight_sender(dtype=torch.bfloat16, full_every=2)
        whole = []
        for step in range(5):
            if step:
                train_once(s, step)
            whole.append(sender.sync(receiver.version, receiver.receive).full)
            assert receiver.version == step
        assert whole == [True, False, True, False, True]
        assert_received(receiver, s)
    with pytest.raises(UserError, match="full_every=0; give a number of versions >= 1"):
        fsdp2kit.weight_sync.WeightSender(iter, "model", int, full_every=0)
