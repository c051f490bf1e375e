"""Foreign config dialects mapped onto the native schema: ROLL role files, MindSpeed-MM fsdp2_config.yaml,
Accelerate config files and the Trainer's `fsdp`/`fsdp_config` (see docs/dialects.md).

`read_config` turns whatever the user gave into one native dict, in this order:
1. `${...}` interpolations resolved (Hydra/OmegaConf, as ROLL writes them);
2. a ROLL file becomes its chosen role, a MindSpeed-MM native trainer file (`parallel:`, `features:` ...) its
   native mapping (`--set` items naming that file's own keys change it first); a native file stays as it is;
3. `--set` overrides (and what a foreign key implied through an overridden key is taken back);
4. a strategy file (`--fsdp-config`, or `strategy_args.strategy_config_path` relative to the config's folder)
   replaces strategy_config, and `--set` is applied again so the command line wins over that file too;
5. the Trainer's `fsdp`/`fsdp_config` keys inside strategy_config become native keys.
Every step records where each native key came from (for error messages) and what it mapped or ignored (notes).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fsdp2kit.config.dialects import accelerate, mindspeed, mindspeed_native, roll
from fsdp2kit.config.dialects.translation import STRATEGY_CONFIG, Translation, Written
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.config.yaml_io import apply_overrides, read_yaml
from fsdp2kit.errors import UserError

__all__ = ["Translation", "Written", "read_config"]


def read_config(
    path: str | Path,
    overrides: list[str],
    role: str | None = None,
    strategy_file: str | None = None,
    written: dict[str, Any] | None = None,
) -> Translation:
    """`written`: the file's contents read already (a framework's configuration it holds in memory, `path` naming
    it in messages); else the file at `path` is read."""
    source = str(path)
    written = read_yaml(path) if written is None else written
    _refuse_hydra_defaults(written, source)
    raw = _resolve_interpolations(written, source)
    if roll.is_roll_file(raw):
        raw, overrides = roll.file_overrides(raw, overrides)  # the file's own keys change it first
        translation = roll.translate(raw, source, role)
    elif mindspeed_native.is_native_file(raw) and role is None:
        raw, overrides = mindspeed_native.file_overrides(raw, overrides)
        translation = mindspeed_native.translate(raw, source)
    elif role is not None:
        raise UserError(
            f"--role {role}: '{source}' is a native fsdp2kit config, which has no roles "
            "(--role picks a role of a ROLL file)"
        )
    else:
        _refuse_strategy_file(raw, source)
        translation = Translation(source, raw)
    apply_overrides(translation.config, overrides)
    strategy_path = _strategy_file(translation, strategy_file)
    if strategy_path is not None:
        _read_strategy_file(translation, strategy_path)
        apply_overrides(translation.config, overrides)
    overridden = {item.split("=", 1)[0].strip() for item in overrides}
    translation.drop_implied(overridden)
    for key in overridden:  # an error in an overridden key names it as given to --set
        translation.replace_origin(key, Written(source, key))
    accelerate.translate_trainer_keys(translation)
    if raw is not written:
        translation.interpolated = _interpolated_keys(translation, written, source, overridden)
    return translation


def _refuse_hydra_defaults(raw: dict[str, Any], source: str) -> None:
    """A Hydra defaults list names other files that Hydra merges in before ROLL reads the result."""
    if isinstance(raw.get("defaults"), list):
        named = ", ".join(str(entry) for entry in raw["defaults"])
        raise UserError(
            f"{source}: 'defaults' is a Hydra defaults list ({named}), which Hydra composes with the files it names "
            "before ROLL reads them; fsdp2kit reads one composed file: compose it first (hydra.compose, then "
            "OmegaConf.save) and give that file"
        )


def _refuse_strategy_file(raw: dict[str, Any], source: str) -> None:
    """A strategy file given where the job config goes: say where it belongs instead of 'unknown key'."""
    if raw.keys() & set(JobConfig.model_fields):
        return
    for kind, matches in (
        ("an Accelerate config", accelerate.is_accelerate_config),
        ("a Trainer fsdp_config", accelerate.is_trainer_fsdp_config),
        ("a MindSpeed-MM fsdp2_config", mindspeed.is_mindspeed_config),
    ):
        if matches(raw):
            raise UserError(
                f"'{source}' is {kind} (FSDP settings only), not a job config: give it with --fsdp-config "
                f"{source} beside a job config such as examples/demo.yaml"
            )


def _leaves(node: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def _interpolated_keys(
    translation: Translation, written: dict[str, Any], source: str, overridden: set[str]
) -> dict[str, Any]:
    """Native keys whose value came from a `${...}` in the config file, with the text as written there."""
    found = {}
    for key in _leaves(translation.config):
        origin = translation.written_as(key)
        if origin.file != source or any(key == o or key.startswith(o + ".") for o in overridden):
            continue
        node: Any = written
        for part in origin.path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if _has_interpolation(node):
            found[key] = node
    return found


def _has_interpolation(node: Any) -> bool:
    if isinstance(node, dict):
        return any(_has_interpolation(value) for value in node.values())
    if isinstance(node, list):
        return any(_has_interpolation(value) for value in node)
    return isinstance(node, str) and "${" in node


def _resolve_interpolations(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """`${key}` references resolved as Hydra/OmegaConf would. The `hydra:` section is left as written: its
    resolvers (`${now:...}`, `${hydra:...}`) exist only inside a Hydra run, and no key of ours reads it."""
    body = {key: value for key, value in raw.items() if key != "hydra"}
    if not _has_interpolation(body):
        return raw
    try:
        resolved = cast(dict[str, Any], OmegaConf.to_container(OmegaConf.create(body), resolve=True))
    except OmegaConfBaseException as exc:
        reason = str(exc.msg).splitlines()[0] if getattr(exc, "msg", None) else str(exc).splitlines()[0]
        where = f"'{exc.full_key}'" if getattr(exc, "full_key", None) else "an interpolation"
        raise UserError(f"{source}: cannot resolve {where}: {reason}") from None
    return {**resolved, **({"hydra": raw["hydra"]} if "hydra" in raw else {})}


def _strategy_file(translation: Translation, from_command_line: str | None) -> Path | None:
    """`--fsdp-config` is relative to the working directory; a path named in the config, to the config's folder."""
    if from_command_line is not None:
        return Path(from_command_line)
    named = translation.get("strategy_args.strategy_config_path")
    if named is None:
        return None
    return Path(translation.written_as("strategy_args.strategy_config_path").file).parent / str(named)


def _read_strategy_file(translation: Translation, path: Path) -> None:
    """A MindSpeed-MM fsdp2_config.yaml or an Accelerate config, told apart by their keys, replaces strategy_config."""
    data = read_yaml(path)
    replaced = translation.get(STRATEGY_CONFIG)
    # Keys written outside the strategy section (ROLL's model_args.gradient_checkpointing_use_reentrant) say how
    # the model runs, not how it is sharded: they stay unless the strategy file sets them.
    kept: dict[str, tuple[Any, Written]] = {}
    if isinstance(replaced, dict) and replaced:
        where = translation.written_as(STRATEGY_CONFIG)
        origins = {key: translation.written_as(f"{STRATEGY_CONFIG}.{key}") for key in replaced}
        kept = {key: (replaced[key], o) for key, o in origins.items() if not o.path.startswith(where.path + ".")}
        if dropped := [key for key in replaced if key not in kept]:
            translation.note(f"{where.path} of {where.file} replaced by {path} (keys dropped: {', '.join(dropped)})")
    if accelerate.is_accelerate_config(data):
        accelerate.translate_file(translation, data, str(path))
    elif accelerate.is_trainer_fsdp_config(data):
        accelerate.translate_trainer_file(translation, data, str(path))
    else:
        mindspeed.translate_file(translation, data, str(path))
    for key, (value, origin) in kept.items():
        if translation.get(f"{STRATEGY_CONFIG}.{key}") is None:
            translation.set(f"{STRATEGY_CONFIG}.{key}", value, origin)
    translation.replace("strategy_args.strategy_config_path", str(path), Written(str(path), ""))
