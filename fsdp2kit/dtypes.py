"""The one table of floating-point dtypes: every name a config may write, the short name fsdp2kit uses, and the
torch dtype behind it. A leaf module that imports torch only when a torch dtype is asked for, so the config layer
stays light (a config mistake is reported before torch loads)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, overload

if TYPE_CHECKING:
    import torch

# Short name (what configs, plans and `check` write) -> torch's name for it (torch.bfloat16, ...).
TORCH_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Every spelling a config may use (HF, PyTorch, Accelerate, ROLL) -> its short name.
ALIASES = {**{s: s for s in TORCH_NAMES}, **{t: s for s, t in TORCH_NAMES.items()}, "half": "fp16", "float": "fp32"}


def short_name(value: Any) -> Any:
    """A config value as a short dtype name ('none' as None); anything else as it is, for pydantic to refuse."""
    if isinstance(value, str) and value.lower() in ALIASES:
        return ALIASES[value.lower()]
    if isinstance(value, str) and value.lower() == "none":
        return None
    return value


@overload
def torch_dtype(name: str) -> torch.dtype: ...
@overload
def torch_dtype(name: None) -> None: ...
def torch_dtype(name: str | None) -> torch.dtype | None:
    """The torch dtype of a short name (None, "not set", stays None)."""
    import torch

    return None if name is None else getattr(torch, TORCH_NAMES[name])


def torch_name(name: str | None) -> str | None:
    """'bfloat16' for 'bf16': the name torch and `check` print."""
    return None if name is None else TORCH_NAMES[name]
