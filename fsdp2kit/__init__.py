"""fsdp2kit: train and serve transformer models with PyTorch FSDP2, driven by one YAML file.

`fsdp2kit.Strategy` is the back-end API (fsdp2kit/strategy.py); it is imported on first use, so that the command
line and the lower layers do not pay for torch and transformers when they only need a leaf module."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["Strategy", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "Strategy":
        from fsdp2kit.strategy import Strategy

        return Strategy
    raise AttributeError(f"module 'fsdp2kit' has no attribute {name!r}")
