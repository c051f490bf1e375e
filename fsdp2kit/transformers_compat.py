"""The transformers releases fsdp2kit runs on (5.2, ROLL's pin, to the newest 5.x; verl pins 5.10) differ in a few
pieces that no public API gives: how a chat template's inputs are prepared, and which weight-conversion classes
exist. Each is found here by feature, once, so that the rest of fsdp2kit reads one interface whatever the release
(`distributed.py:require_supported_versions` refuses a release older than the suite runs on)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any


def _chat_step(name: str) -> Callable[[Any], Any]:
    """A step `tokenizer.apply_chat_template` applies to what a template sees, where the installed transformers has
    it; a release without it hands the value to the template as it is (5.2 and 5.10 deep-copy the messages only)."""
    from transformers.utils import chat_template_utils

    return getattr(chat_template_utils, name, lambda value: value)


def chat_template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the installed transformers' `apply_chat_template` passes them to the template: the newest
    drops their None values, rebuilds them from plain JSON types and copies reasoning under the names templates read
    (`_normalize_chat_messages`, `_plain_template_data`, `_alias_reasoning_fields`); older releases do none of it."""
    normalized = _chat_step("_normalize_chat_messages")(messages)
    return _chat_step("_alias_reasoning_fields")(_chat_step("_plain_template_data")(normalized))


def chat_template_value(value: Any) -> Any:
    """Tools or a template variable as the installed transformers passes them to the template (plain JSON types
    where it rebuilds them, `_plain_template_data`)."""
    return _chat_step("_plain_template_data")(value)


def chat_template_environment() -> Any:
    """The Jinja environment transformers compiles chat templates in (its sandbox options, extensions, filters,
    tests and globals), from `_compile_jinja_template`, which every supported release has."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def is_prefix_change(transform: Any) -> bool:
    """Whether a weight transform is a `PrefixChange` (5.10 and later; 5.2 has none): a renaming whose reverse depends
    on what `from_pretrained` loaded, left out for a model built otherwise."""
    from transformers import core_model_loading

    prefix_change = getattr(core_model_loading, "PrefixChange", None)
    return prefix_change is not None and isinstance(transform, prefix_change)


def within_row_operations() -> tuple[type[Any], ...]:
    """The conversion operations that, on a dimension other than 0, work within each row of a stacked tensor:
    `Concatenate` and `Chunk`, and `Interleave` where the release has it (after 5.10)."""
    from transformers import core_model_loading

    names = ("Concatenate", "Chunk", "Interleave")
    return tuple(getattr(core_model_loading, name) for name in names if hasattr(core_model_loading, name))


def mask_interface_function(build: Callable[..., Any]) -> Callable[..., Any]:
    """`build(batch_size, q_length, kv_length, q_offset=, kv_offset=, mask_function=, attention_mask=, device=, ...)`
    as the installed transformers calls a function registered with `AttentionMaskInterface`: with `q_length`,
    `q_offset` and `device` (5.10 and later), or with `cache_position`, the queries' positions (5.2)."""

    def mask(*args: Any, **kwargs: Any) -> Any:
        if "q_length" not in kwargs and "cache_position" in kwargs:
            positions = kwargs.pop("cache_position")
            kwargs.update(q_length=positions.shape[0], q_offset=positions[0], device=positions.device)
        return build(*args, **kwargs)

    return mask


def configs_check_types() -> bool:
    """Whether the installed transformers' configs check their fields' types when built: huggingface_hub strict
    dataclasses (5.10 and 5.24); 5.2's are plain classes, and a field of the wrong type fails in the model's build."""
    from transformers import PretrainedConfig

    return dataclasses.is_dataclass(PretrainedConfig)
