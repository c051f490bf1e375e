"""What every dialect produces: a native config dict, where each native key came from, and notes for the user.

A dialect is written as tables of rules, one table per section of the foreign file: each foreign key names a
`Rule` that maps it onto a native key (`to`), notes it as meaningless for FSDP2 (`ignored`), or refuses a value
that fsdp2kit cannot honour (`unsupported`). A key with no rule is an error, so a typo is never dropped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

from fsdp2kit.config.yaml_io import apply_overrides
from fsdp2kit.errors import UserError, unknown_key_message

NO_FSDP2_MEANING = "no FSDP2 meaning"
STRATEGY_CONFIG = "strategy_args.strategy_config"  # the native section most foreign keys land in


class Written(NamedTuple):
    """A key as the user wrote it: the file and the dotted path inside it ('' is the file's top level)."""

    file: str
    path: str

    def child(self, key: str) -> Written:
        return Written(self.file, f"{self.path}.{key}" if self.path else key)

    def __str__(self) -> str:
        return self.path


class Translation:
    """A native config under construction from a foreign one (`config`), plus the notes `fsdp2kit check` prints."""

    def __init__(self, source: str, config: dict[str, Any] | None = None) -> None:
        self.source = source
        self.config: dict[str, Any] = config if config is not None else {}
        self._origins: dict[str, Written] = {}  # native dotted key (or section) -> where its value was written
        self._notes: list[str] = []
        self._ignored: dict[str, list[str]] = {}  # reason -> keys, so one note lists all keys ignored for a reason
        self.interpolated: dict[str, Any] = {}  # native key -> its `${...}` text in the config file
        self._implied: dict[str, tuple[str, Any]] = {}  # native key -> (native key implying it, that key's value)

    def set(self, native_key: str, value: Any, origin: Written) -> None:
        """Set a native key. Two foreign keys that give it different values contradict each other: an error."""
        section, leaf = self._section_of(native_key, origin)
        if isinstance(value, dict) and isinstance(section.get(leaf), dict):  # a section some keys already went into
            for key, item in value.items():
                self.set(f"{native_key}.{key}", item, origin.child(key))
            return
        if leaf in section and section[leaf] != value:
            earlier = self.written_as(native_key)
            raise UserError(
                f"{origin.file}: '{origin}' = {value!r} contradicts {earlier.file}: '{earlier.path}' = "
                f"{section[leaf]!r} (both set {native_key}); give only one of them"
            )
        section[leaf] = value
        self.replace_origin(native_key, origin)

    def imply(self, native_key: str, value: Any, origin: Written, cause: str) -> None:
        """Set a native key that the foreign key at `origin` implies through the native key `cause` (ROLL's
        offload_policy: true pins host memory): a `--set` that changes `cause` takes the implication back."""
        self.set(native_key, value, origin)
        self._implied[native_key] = (cause, self.get(cause))
        self.note(f"mapped {origin}={self.get(cause)!r} → {native_key}={value!r} as well")

    def drop_implied(self, overridden: Collection[str]) -> None:
        """Implied keys whose cause `--set` changed (and that `--set` did not set itself) go back to their default."""
        for native_key, (cause, value) in list(self._implied.items()):
            if cause in overridden and native_key not in overridden and self.get(cause) != value:
                section, leaf = self._section_of(native_key, self.written_as(native_key))
                section.pop(leaf, None)
                del self._implied[native_key]
                self.note(f"--set {cause}={self.get(cause)!r}: {native_key} no longer implied ({value!r} before)")

    def replace(self, native_key: str, value: Any, origin: Written) -> None:
        """Set a native key or section, discarding what was there (a strategy file replaces strategy_config)."""
        section, leaf = self._section_of(native_key, origin)
        section[leaf] = value
        self.replace_origin(native_key, origin)

    def replace_origin(self, native_key: str, origin: Written) -> None:
        """From now on errors in `native_key` (and under it) name `origin`: e.g. after a `--set` override."""
        self._origins = {
            key: where
            for key, where in self._origins.items()
            if key != native_key and not key.startswith(native_key + ".")
        }
        self._origins[native_key] = origin

    def section_origin(self, native_key: str, origin: Written) -> None:
        """Errors in the section `native_key` name `origin`, except for its keys written elsewhere (ROLL's
        model_args key that lands in strategy_config keeps its own)."""
        self._origins[native_key] = origin

    def get(self, native_key: str) -> Any:
        """The value at a dotted native key, or None where the path is missing or not a mapping."""
        node: Any = self.config
        for part in native_key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    def written_as(self, native_key: str) -> Written:
        """Where the value of a native key was written, for error messages; native files spell it natively."""
        for prefix in sorted(self._origins, key=len, reverse=True):
            if native_key == prefix or native_key.startswith(prefix + "."):
                origin = self._origins[prefix]
                return Written(origin.file, ".".join(p for p in (origin.path, native_key[len(prefix) + 1 :]) if p))
        return Written(self.source, native_key)

    def written_keys(self) -> frozenset[str]:
        """The foreign keys whose values went into native keys (as written, dotted)."""
        return frozenset(origin.path for origin in self._origins.values())

    def note(self, text: str) -> None:
        self._notes.append(text)

    def ignore(self, key: Written | str, reason: str = NO_FSDP2_MEANING) -> None:
        self._ignored.setdefault(reason, []).append(str(key))

    @property
    def notes(self) -> list[str]:
        return self._notes + [f"ignored ({reason}): {', '.join(keys)}" for reason, keys in self._ignored.items()]

    def _section_of(self, native_key: str, origin: Written) -> tuple[dict[str, Any], str]:
        *parents, leaf = native_key.split(".")
        section = self.config
        for i, part in enumerate(parents):
            if section.get(part) is None:
                section[part] = {}
            if not isinstance(section[part], dict):
                where = self.written_as(".".join(parents[: i + 1]))
                raise UserError(
                    f"{where.file}: '{where.path}' must be a mapping of keys to hold {origin.path}, "
                    f"not {section[part]!r}"
                )
            section = section[part]
        return section, leaf


Rule = Callable[[Translation, Written, Any], None]


def file_overrides(
    raw: dict[str, Any], overrides: list[str], own: Callable[[list[str]], bool]
) -> tuple[dict[str, Any], list[str]]:
    """Split `--set` items: those whose dotted path `own` says is a key of the foreign file itself change (a copy
    of) the file before it is read, as if the file had said so; the others set native keys afterwards."""
    mine = [item for item in overrides if own(item.split("=", 1)[0].strip().split("."))]
    if not mine:
        return raw, overrides
    return apply_overrides(copy.deepcopy(raw), mine), [item for item in overrides if item not in mine]


def apply_rules(
    translation: Translation, values: Any, rules: Mapping[str, Rule], where: Written, otherwise: Rule | None = None
) -> None:
    """Run each key of a foreign section through its rule. A key set to null (~) counts as not written.
    A key without a rule goes to `otherwise`, or is an error with a 'did you mean'."""
    if values is None:
        return
    if not isinstance(values, Mapping):
        raise UserError(f"{where.file}: '{where.path}' must be a mapping of keys, not {values!r}")
    for key, value in values.items():
        if value is None:
            continue
        rule = rules.get(key, otherwise)
        if rule is None:
            raise UserError(unknown_key(where.child(str(key)), list(rules)))
        rule(translation, where.child(str(key)), value)


def unknown_key(key: Written, valid: list[str]) -> str:
    leaf = key.path.rsplit(".", 1)[-1]
    return unknown_key_message(key.file, key.path, leaf, valid, lambda close: key.path[: -len(leaf)] + close)


def mapped_note(key: Written, value: Any, native_key: str, new_value: Any) -> str:
    if not _changed(value, new_value):
        return f"mapped {key} → {native_key}"
    return f"mapped {key}={value!r} → {native_key}={new_value!r}"


def _changed(value: Any, new_value: Any) -> bool:
    return type(value) is not type(new_value) or value != new_value  # True == 1, but true -> 1 is a change


def to(native_key: str, convert: Callable[[Any], Any] | None = None) -> Rule:
    """Copy the value to `native_key`, through `convert` (which raises ValueError('expected ...') on a bad value).
    The mapping is noted when the key's name or its value changes on the way."""

    def rule(translation: Translation, key: Written, value: Any) -> None:
        new_value = converted(key, value, convert) if convert else value
        translation.set(native_key, new_value, key)
        if native_key.rsplit(".", 1)[-1] != key.path.rsplit(".", 1)[-1] or _changed(value, new_value):
            translation.note(mapped_note(key, value, native_key, new_value))

    return rule


def converted(key: Written, value: Any, convert: Callable[[Any], Any]) -> Any:
    try:
        return convert(value)
    except (ValueError, TypeError, KeyError) as exc:
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: {exc.args[0] if exc.args else exc}") from None


def whole_ranks(value: Any) -> int:
    """A parallel degree as the tools write it: a whole number of ranks (a `convert` for `to`)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected a whole number of ranks (1 or more)")
    return value


def ignored(reason: str = NO_FSDP2_MEANING) -> Rule:
    def rule(translation: Translation, key: Written, value: Any) -> None:
        translation.ignore(key, reason)

    return rule


def unsupported(reason: str, harmless: tuple[Any, ...] = ()) -> Rule:
    """A setting fsdp2kit cannot honour: values in `harmless` change nothing and are noted; others are refused."""

    def rule(translation: Translation, key: Written, value: Any) -> None:
        if any(value == ok and type(value) is type(ok) for ok in harmless):
            translation.ignore(key)
            return
        raise UserError(f"{key.file}: '{key}' = {value!r} is not supported: {reason}")

    return rule


def section(rules: Mapping[str, Rule]) -> Rule:
    """A nested mapping whose keys have their own table."""

    def rule(translation: Translation, key: Written, value: Any) -> None:
        apply_rules(translation, value, rules, key)

    return rule


def already_read(translation: Translation, key: Written, value: Any) -> None:
    """The key was read together with related keys before its table ran (its entry names it as valid)."""


FILE_RUNS_NO_CODE = (
    "a config file never turns on code execution: a model folder's own code runs only with --trust-remote-code on "
    "the command line (trust_remote_code=True to Strategy.from_config)"
)


def file_trust_remote_code(translation: Translation, key: Written, value: Any) -> None:
    """`trust_remote_code` as MindSpeed-MM and ROLL files write it (for the model, its tokenizer or processor): read
    and noted, never applied (docs/security.md)."""
    if not isinstance(value, bool):
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected true or false")
    translation.note(f"{key}={value!r}: read; {FILE_RUNS_NO_CODE}")


def comma_list(value: Any) -> list[str]:
    """'A, B' or ['A', 'B'] -> ['A', 'B'] (ROLL and Accelerate both write class and prefix lists as one string)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
        raise ValueError("expected a comma-separated string or a list of names")
    return [i.strip() for i in items if i.strip()]


def chat_template_name(translation: Translation, key: Written, value: Any) -> None:
    """ROLL's and MindSpeed-MM's `template:` (qwen2_5, qwen3, ...): conversations are rendered with the model's own
    chat template, which the name must be of (checked against the model's family when conversations are read)."""
    if not isinstance(value, str) or not value:
        raise UserError(f"{key.file}: '{key}' = {value!r} is not valid: expected a template name such as qwen2_5")
    translation.set("data.template", value, key)
    translation.note(
        f"{key} = {value!r} read as data.template: conversations are rendered with the model's own chat template, "
        "which this name must be of"
    )


def transformers_schedule(translation: Translation, origin: Written, arguments: str) -> None:
    """A config read from `arguments` that transformers' schedulers serve (HF Trainer, Accelerate, ROLL) warms up as
    they do: the first step at learning rate 0 (training.warmup_from_zero), unless the config sets it itself."""
    if translation.get("training.warmup_from_zero") is None:
        translation.set("training.warmup_from_zero", True, origin)
        translation.note(
            f"training.warmup_from_zero=True: as in {arguments} (transformers' get_*_schedule_with_warmup), the "
            "first warmup step has learning rate 0"
        )
