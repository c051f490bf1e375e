"""Load a job's config: its file in any dialect (with `--set` overrides) as a native dict, validated, with pydantic
errors turned into one clear sentence naming the key as the user wrote it."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

from fsdp2kit.config import dialects
from fsdp2kit.config.dialects.translation import FILE_RUNS_NO_CODE
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.errors import UserError, unknown_key_message

# Where a native key was written, as (file, key in that file), so errors name a foreign dialect's keys as written.
WrittenAs = Callable[[str], tuple[str, str]]


def validate(raw: dict[str, Any], source: str = "config", written_as: WrittenAs | None = None) -> JobConfig:
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as exc:
        raise UserError(describe_validation_error(exc, raw, source, written_as)) from None


def load_config(
    path: str | Path,
    overrides: list[str] | None = None,
    role: str | None = None,
    strategy_file: str | None = None,
    trust_remote_code: bool = False,
    written: dict[str, Any] | None = None,
) -> JobConfig:
    """`trust_remote_code` is the user's own switch (--trust-remote-code): a file's never turns code execution on.
    `written`: the file's contents held in memory already (see dialects.read_config)."""
    translation = dialects.read_config(path, list(overrides or []), role, strategy_file, written)
    cfg = validate(translation.config, str(path), translation.written_as)
    cfg.notes.extend(translation.notes)
    grant_remote_code(cfg, trust_remote_code)
    cfg._written_as = translation.written_as
    strategy_path = cfg.strategy_args.strategy_config_path
    cfg._given_files = [str(path), *([strategy_path] if strategy_path else [])]
    cfg._as_written = translation.interpolated
    return cfg


def grant_remote_code(cfg: JobConfig, granted: bool) -> None:
    """model.trust_remote_code becomes the caller's switch; what the config asked for is noted (docs/security.md)."""
    if cfg.model.trust_remote_code and not granted:
        cfg.notes.append(f"model.trust_remote_code=True: read, not applied: {FILE_RUNS_NO_CODE}")
    if granted:
        cfg.notes.append(
            "trust_remote_code: on from the caller (--trust-remote-code): transformers' remote-code path may import "
            "and run the Python files a model folder names in its auto_map"
        )
    cfg.model.trust_remote_code = granted


# Errors found after validation (the mesh, the plan) begin with the native key they are about.
_LEADING_KEY = re.compile(r"(strategy_config|model|data|training)\.([\w.]+)(?=:| =)")


def name_as_written(message: str, cfg: JobConfig) -> str:
    """The error with its leading native key named as the user wrote it, where a foreign file wrote it."""
    match = _LEADING_KEY.match(message)
    if match is None:
        return message
    section, key = match.groups()
    native_key = f"strategy_args.{section}.{key}" if section == "strategy_config" else f"{section}.{key}"
    written = cfg.written_as(native_key)
    if written is None or written[1] == native_key:
        return message
    return f"{written[0]}: '{written[1]}'{message[match.end() :]}"


def _section_at(model: type[BaseModel], loc: tuple) -> type[BaseModel] | None:
    """The pydantic model class that owns the key at `loc` (for 'did you mean' suggestions)."""
    for part in loc[:-1]:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return model


def _value_at(raw: Any, loc: tuple) -> Any:
    for part in loc:
        if isinstance(raw, dict) and part in raw:
            raw = raw[part]
        elif isinstance(raw, list) and isinstance(part, int) and part < len(raw):
            raw = raw[part]
        else:
            return None
    return raw


_EXPECTED = {
    "int_parsing": "an integer",
    "int_type": "an integer",
    "int_from_float": "an integer",
    "float_parsing": "a number",
    "float_type": "a number",
    "bool_parsing": "true or false",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a mapping",
    "model_type": "a mapping",
}


def _real_loc(raw: dict[str, Any], loc: tuple) -> tuple:
    """Pydantic adds union-member tags ('int', 'literal[...]') to locations; keep the part that names real keys."""
    real: tuple = ()
    for part in loc:
        if _value_at(raw, real + (part,)) is None and not (
            isinstance(part, str)
            and part.isidentifier()
            and "[" not in part
            and part not in ("int", "bool", "str", "float", "list", "dict")
        ):
            break
        real += (part,)
    return real


def _expectation(error: ErrorDetails) -> str:
    expected = error.get("ctx", {}).get("expected")
    if expected:
        return f"one of {expected}" if " or " in expected else expected
    if error["type"] in _EXPECTED:
        return _EXPECTED[error["type"]]
    message = error["msg"]
    for lead in ("Value error, ", "Input should be "):
        if message.startswith(lead):
            return message[len(lead) :]
    return message


# Keys other tools keep in their strategy's section that fsdp2kit keeps on the model (they change its attention).
_KEYS_ELSEWHERE = {
    "strategy_args.strategy_config.context_parallel_size": "model.context_parallel_size",
    "strategy_args.strategy_config.ulysses_size": "model.ulysses_size",
    "strategy_args.strategy_config.ulysses_sequence_parallel_size": "model.ulysses_size",
}


def describe_validation_error(
    exc: ValidationError, raw: dict[str, Any], source: str, written_as: WrittenAs | None = None
) -> str:
    """One sentence for the first error: the key, the bad value and what would be valid."""
    written_as = written_as or (lambda native_key: (source, native_key))
    errors = exc.errors()
    loc = _real_loc(raw, errors[0]["loc"])
    key = ".".join(str(p) for p in loc)
    file, written_key = written_as(key)
    if errors[0]["type"] == "extra_forbidden":
        if key in _KEYS_ELSEWHERE:
            return f"{file}: unknown key '{written_key}': it goes under model here, as '{_KEYS_ELSEWHERE[key]}'"
        owner = _section_at(JobConfig, loc)
        if owner is None:
            return f"{file}: unknown key '{written_key}'"
        prefix = ".".join(str(p) for p in loc[:-1])
        return unknown_key_message(
            file,
            written_key,
            str(loc[-1]),
            list(owner.model_fields) + list(getattr(owner, "ALIASES", {})),
            lambda close: written_as(f"{prefix}.{close}" if prefix else close)[1],
            listed=list(owner.model_fields),
        )
    # A union (e.g. `int | 'auto'`) fails once per member: name them all.
    same_key = [e for e in errors if _real_loc(raw, e["loc"]) == loc and e["type"] != "extra_forbidden"]
    expectations = list(dict.fromkeys(_expectation(e) for e in same_key))
    value = _value_at(raw, loc)
    where = f"'{written_key}'" if key else "the top level"
    return f"{file}: {where} = {value!r} is not valid: expected {' or '.join(expectations)}"
