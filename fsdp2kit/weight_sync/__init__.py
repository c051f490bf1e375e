"""Weight sync to a rollout engine at the cost of what changed: each trainer rank sends its own blocks (no gather),
then only the changed values; versions, checksums and a background sender (`sender.py`); the messages and their
bytes (`messages.py`); a receiver that applies them to a `transformers` or `peft` model (`receiver.py`)."""

from fsdp2kit.weight_sync.messages import Block, CorruptMessage, WeightMessage
from fsdp2kit.weight_sync.receiver import WeightReceiver
from fsdp2kit.weight_sync.sender import SyncStats, WeightSender

__all__ = ["Block", "CorruptMessage", "SyncStats", "WeightMessage", "WeightReceiver", "WeightSender"]
