"""A rollout engine in its own process for tests/weight_sync_worker.py: bf16 `transformers` models fed by weight
syncs through `WeightReceiver` (the channels: `full` from full_weights, `sharded`, `delta`; `adapter`, a peft model
over the fp32 base), sampling completions from the delta channel's model and scoring tokens with the peft model.

    python weight_sync_receiver.py BASE_FOLDER

Listens on a port of 127.0.0.1 the system picks, which it prints first, for the trainer's ranks (multiprocessing
connections, authkey b"weights"); each sends ("hello", rank, world) first. Requests: ("sync", channel, bytes),
("full", version, safetensors bytes), ("sent",) after a rank's syncs, ("status",) -> {channel: (version, {name:
crc32})} once every rank's "sent" is in, ("sample", prompts, seed, length) -> sequences, ("logprobs", ids) -> [B,
T-1], ("die", after): SIGKILL itself after that many more delta messages, ("bye",)."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import zlib
from multiprocessing.connection import Listener, wait
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from fsdp2kit.weight_sync import WeightReceiver

AUTHKEY = b"weights"


def put(connection: Any, item: Any) -> None:
    """Plain pickle (multiprocessing's would pass tensors as shared memory, which another process cannot open)."""
    connection.send_bytes(pickle.dumps(item))


def get(connection: Any) -> Any:
    return pickle.loads(connection.recv_bytes())


def crc(tensor: torch.Tensor) -> int:
    return zlib.crc32(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


class Rollout:
    def __init__(self, base: Path) -> None:
        self.base = base
        config = AutoConfig.from_pretrained(base)
        self.models = {
            name: AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
            for name in ("full", "sharded", "delta")
        }
        self.receivers = {name: WeightReceiver.for_model(model) for name, model in self.models.items()}
        self.full_version: int | None = None
        self.peft: Any = None
        self.die_after: int | None = None
        self.sent: set[int] = set()  # the ranks whose "sent" came since the last status

    def sync(self, channel: str, data: bytes) -> None:
        if channel == "adapter" and self.peft is None:
            self.peft = self._peft(data)
        if channel == "delta" and self.die_after is not None:
            self.die_after -= 1
            if self.die_after < 0:
                os.kill(os.getpid(), signal.SIGKILL)  # killed in the middle of a delta, as a crashed engine is
        self.receivers[channel].receive(data)

    def _peft(self, data: bytes) -> Any:
        """The peft model, made from the adapter_config the first (full) adapter sync carries."""
        from peft import LoraConfig, get_peft_model

        from fsdp2kit.weight_sync import WeightMessage

        config = WeightMessage.from_bytes(data).config
        assert config is not None, "the first adapter message carries no adapter_config"
        settings = {key: value for key, value in config.items() if key in LoraConfig.__dataclass_fields__}
        base = AutoModelForCausalLM.from_pretrained(self.base, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(**settings)).eval()
        self.receivers["adapter"] = WeightReceiver.for_adapter(model)
        return model

    def full(self, version: int, data: bytes) -> None:
        from safetensors.torch import load

        self.models["full"].load_state_dict(load(data), strict=False)
        self.full_version = version

    def status(self) -> dict[str, Any]:
        report = {}
        for channel, receiver in self.receivers.items():
            version = self.full_version if channel == "full" else receiver.version
            report[channel] = (version, {name: crc(t) for name, t in receiver.tensors.items()})
        return report

    @torch.no_grad()
    def sample(self, prompts: torch.Tensor, seed: int, length: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        sequences = prompts
        for _ in range(length):
            logits = self.models["delta"](input_ids=sequences).logits[:, -1].float()
            token = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            sequences = torch.cat([sequences, token], dim=1)
        return sequences

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor) -> torch.Tensor:
        logits = self.peft(input_ids=ids).logits.float()
        return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def serve(base: Path) -> None:
    rollout = Rollout(base)
    with Listener(("127.0.0.1", 0), authkey=AUTHKEY) as listener:
        print(listener.address[1], flush=True)
        first = listener.accept()
        _, rank, world = get(first)
        connections = {rank: first}
        while len(connections) < world:
            connection = listener.accept()
            connections[get(connection)[1]] = connection
        while connections:
            for connection in wait(list(connections.values())):
                if not handle(rollout, connection, connections):
                    connections = {r: c for r, c in connections.items() if c is not connection}


def handle(rollout: Rollout, connection: Any, connections: dict[int, Any]) -> bool:
    request = get(connection)
    kind = request[0]
    if kind == "sync":
        rollout.sync(request[1], request[2])
    elif kind == "full":
        rollout.full(request[1], request[2])
    elif kind == "sent":  # this rank's messages so far are all in: its line is first in, first out
        rollout.sent.add(next(rank for rank, line in connections.items() if line is connection))
    elif kind == "status":  # answered once every rank has said it sent all it had
        while len(rollout.sent) < len(connections):
            for other in wait([line for rank, line in connections.items() if rank not in rollout.sent]):
                handle(rollout, other, connections)
        rollout.sent.clear()
        put(connection, rollout.status())
    elif kind == "sample":
        put(connection, rollout.sample(*request[1:]))
    elif kind == "logprobs":
        put(connection, rollout.logprobs(request[1]))
    elif kind == "die":
        rollout.die_after = request[1]
    return kind != "bye"


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
