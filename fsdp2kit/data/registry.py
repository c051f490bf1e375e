"""LLaMA-Factory's dataset registry: a folder's `dataset_info.json` names datasets by key, each a file of that folder
and how its records are written (`formatting`, `columns`, `tags`). A named dataset is read by the common chat
readers (`data/chat.py`): its records are first rewritten into their canonical Alpaca or ShareGPT fields.

The defaults are LLaMA-Factory's own (hiyouga/LLaMA-Factory, src/llamafactory/data/parser.py `DatasetAttr`, commit
ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30): formatting alpaca; columns prompt=instruction, query=input,
response=output, messages=conversations, the others none; tags role_tag=from, content_tag=value, user_tag=human,
assistant_tag=gpt, observation_tag=observation, function_tag=function_call, system_tag=system. As there, an entry
that gives `columns` (or `tags`) replaces all of them: what it leaves out is none."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fsdp2kit.errors import UserError

REGISTRY_FILE = "dataset_info.json"
FORMATTINGS = ("alpaca", "sharegpt")
DEFAULT_COLUMNS = {
    "prompt": "instruction",
    "query": "input",
    "response": "output",
    "history": None,
    "messages": "conversations",
    "system": None,
    "tools": None,
    "images": None,
    "videos": None,
    "audios": None,
}
DEFAULT_TAGS = {
    "role_tag": "from",
    "content_tag": "value",
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
# Each column's canonical field in the chat readers' forms, and each tag's canonical ShareGPT speaker.
_ALPACA_FIELDS = {"prompt": "instruction", "query": "input", "response": "output", "system": "system"}
_SHAREGPT_SPEAKERS = {
    "user_tag": "human",
    "assistant_tag": "gpt",
    "observation_tag": "observation",
    "function_tag": "function_call",
    "system_tag": "system",
}
_REMOTE_KEYS = ("hf_hub_url", "ms_hub_url", "om_hub_url", "script_url", "cloud_file_name")
# The columns each formatting reads (LLaMA-Factory's converter.py): a named one that no record has is refused there.
_READ_COLUMNS = {
    "alpaca": ("prompt", "query", "response", "history", "system", "tools", "images", "videos", "audios"),
    "sharegpt": ("messages", "system", "tools", "images", "videos", "audios"),
}
# The tags a ShareGPT entry that gives `tags` must give: without them no turn can be read.
_REQUIRED_TAGS = ("role_tag", "content_tag", "user_tag", "assistant_tag")
_MAX_REGISTRY_BYTES = 16 << 20
_FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
# Attributes that would change which records are read, or how, beyond the chat forms: refused unless the default.
_UNREAD = {"ranking": False, "num_samples": None, "split": "train", "subset": None, "folder": None}
_UNREAD_WHY = {
    "ranking": "preference (chosen/rejected) data, which fsdp2kit does not train",
    "num_samples": "which fsdp2kit does not sample; use data.max_samples to read the first N records",
    "split": "a split of a hub dataset; a local file is its train split",
    "subset": "a subset of a hub dataset; fsdp2kit reads local files only",
    "folder": "a folder of a hub dataset; fsdp2kit reads local files only",
}


@dataclass(frozen=True)
class RegistryEntry:
    """One named dataset: its file, and how its records are written (`attrs`: the entry as written)."""

    name: str
    file: Path
    formatting: str
    columns: dict[str, str | None]
    tags: dict[str, str | None]
    attrs: dict
    registry: Path  # its dataset_info.json, as data.dataset_dir names it

    def check_columns(self, fields: Iterable[str], file: Path | str) -> None:
        """Every column the entry names for its formatting is a field of some record of `file` (`fields`: all of
        its records' fields); one that none has would read as empty turns, which LLaMA-Factory refuses too."""
        present = set(fields)
        given = self.attrs.get("columns") or {}
        for column in _READ_COLUMNS[self.formatting]:
            name = given.get(column)
            if name and name not in present:
                raise UserError(
                    f"data.source: dataset '{self.name}' of '{self.registry}' maps column {column} to '{name}', "
                    f"which no record of '{file}' has; its records' fields: {', '.join(sorted(present)[:20])}"
                )

    def canonical(self, record: dict, where: str) -> dict:
        """The record in the chat readers' canonical fields of its formatting."""
        if self.formatting == "alpaca":
            return self._alpaca(record)
        return self._sharegpt(record, where)

    def _field(self, record: dict, column: str) -> Any:
        name = self.columns.get(column)
        return record.get(name) if name else None

    def _alpaca(self, record: dict) -> dict:
        canonical = {field: self._field(record, column) for column, field in _ALPACA_FIELDS.items()}
        history = self._field(record, "history")
        return {**canonical, "history": history if isinstance(history, list) else None, **self._media(record)}

    def _sharegpt(self, record: dict, where: str) -> dict:
        turns = self._field(record, "messages")
        if not isinstance(turns, list):
            raise UserError(
                f"data.source: {where} has no '{self.columns['messages']}' list, which {REGISTRY_FILE} entry "
                f"'{self.name}' names as its messages"
            )
        speakers = {self.tags[tag]: speaker for tag, speaker in _SHAREGPT_SPEAKERS.items() if self.tags.get(tag)}
        conversation = [self._turn(turn, speakers, where) for turn in turns]
        system = self._field(record, "system")
        if conversation and conversation[0]["from"] == "system":  # LLaMA-Factory: a first system turn wins
            system = None
        tools = self._field(record, "tools")
        return {"conversations": conversation, "system": system, "tools": tools, **self._media(record)}

    def _turn(self, turn: Any, speakers: dict, where: str) -> dict:
        if not isinstance(turn, dict):
            raise UserError(f"data.source: {where} has a turn that is not a JSON object")
        role = turn.get(self.tags["role_tag"] or "")
        if role not in speakers:
            raise UserError(
                f"data.source: {where} has a turn whose '{self.tags['role_tag']}' is {role!r}; {REGISTRY_FILE} entry "
                f"'{self.name}' tags: {', '.join(map(str, speakers))}"
            )
        return {"from": speakers[role], "value": turn.get(self.tags["content_tag"] or "")}

    def _media(self, record: dict) -> dict:
        """Media the entry's columns name, under the field names the text reader refuses them by."""
        media = {kind: self._field(record, kind) for kind in ("images", "videos", "audios")}
        return {kind: value for kind, value in media.items() if value}


def registry_path(dataset_dir: str) -> Path:
    """The registry file of `data.dataset_dir`."""
    path = Path(dataset_dir).expanduser() / REGISTRY_FILE
    if not path.is_file():
        raise UserError(
            f"data.dataset_dir: '{dataset_dir}' holds no {REGISTRY_FILE} (LLaMA-Factory's dataset registry)"
        )
    return path


def _registry(dataset_dir: str) -> dict:
    path = registry_path(dataset_dir)
    if path.stat().st_size > _MAX_REGISTRY_BYTES:
        raise UserError(f"data.dataset_dir: '{path}' is larger than {_MAX_REGISTRY_BYTES >> 20} MiB")
    try:
        registry = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as exc:
        raise UserError(f"data.dataset_dir: '{path}' is not JSON ({str(exc)[:200]})") from None
    if not isinstance(registry, dict) or not all(isinstance(v, dict) for v in registry.values()):
        raise UserError(f"data.dataset_dir: '{path}' must map dataset names to their attributes (JSON objects)")
    return registry


def dataset_names(source: str | list[str]) -> list[str]:
    """The dataset names a source gives: a name, names separated by commas (LLaMA-Factory's `dataset: a,b`) or a
    list of names."""
    given = source.split(",") if isinstance(source, str) else source
    return [name.strip() for name in given if name.strip()]


def registry_entry(dataset_dir: str, name: str) -> RegistryEntry:
    """The entry `name` of the registry in `dataset_dir`, its file checked to be one of that folder's data files."""
    registry = _registry(dataset_dir)
    where = f"data.source: dataset '{name}' of '{registry_path(dataset_dir)}'"
    if name not in registry:
        raise UserError(
            f"data.source: '{name}' is not a dataset of '{registry_path(dataset_dir)}'; valid: "
            + ", ".join(list(registry)[:20])
        )
    attrs = registry[name]
    remote = [key for key in _REMOTE_KEYS if key in attrs]
    if remote:
        raise UserError(f"{where} is read from {remote[0]} (a hub, script or cloud); fsdp2kit reads local files only")
    formatting = attrs.get("formatting", "alpaca")
    if formatting not in FORMATTINGS:
        raise UserError(f"{where} has formatting {formatting!r}; valid: {', '.join(FORMATTINGS)}")
    unread = [key for key, default in _UNREAD.items() if attrs.get(key, default) != default]
    if unread:
        raise UserError(f"{where} sets {unread[0]}: {attrs[unread[0]]!r}, {_UNREAD_WHY[unread[0]]}")
    columns, tags = _reading(attrs, formatting, where)
    file = _entry_file(dataset_dir, attrs, where)
    return RegistryEntry(name, file, formatting, columns, tags, attrs, registry_path(dataset_dir))


def _entry_file(dataset_dir: str, attrs: dict, where: str) -> Path:
    """The entry's `file_name`, a file inside the registry's folder other than the registry itself."""
    given = attrs.get("file_name")
    if not isinstance(given, str) or not given:
        raise UserError(f"{where} has no file_name")
    folder = Path(dataset_dir).expanduser().resolve()
    file = (folder / given).resolve()
    if not file.is_relative_to(folder):
        raise UserError(f"{where} names file_name '{given}', outside the folder '{dataset_dir}'")
    if file == folder / REGISTRY_FILE:
        raise UserError(f"{where} names the registry {REGISTRY_FILE} itself as its file_name")
    if not file.is_file():
        raise UserError(f"{where} names file_name '{given}', which is not a file in '{dataset_dir}'")
    if file.suffix not in _FILE_SUFFIXES:
        raise UserError(f"{where} names file_name '{given}'; fsdp2kit reads {', '.join(_FILE_SUFFIXES)} files")
    return file


def _reading(attrs: dict, formatting: str, where: str) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """The entry's columns and tags: LLaMA-Factory's defaults, or all of what it gives (left out: none); ShareGPT
    tags that leave out a tag no turn can be read without are refused."""
    readings = []
    for key, defaults in (("columns", DEFAULT_COLUMNS), ("tags", DEFAULT_TAGS)):
        given = attrs.get(key)
        if given is None:
            readings.append(dict(defaults))
            continue
        if not isinstance(given, dict) or not all(isinstance(v, str | None) for v in given.values()):
            raise UserError(f"{where} has {key} that are not a mapping of names to field names")
        preference = [name for name in ("chosen", "rejected", "kto_tag") if given.get(name)]
        if key == "columns" and preference:
            raise UserError(f"{where} has the column {preference[0]} of preference data, which fsdp2kit does not train")
        readings.append({name: given.get(name) for name in defaults})
    tags = readings[1]
    missing = [tag for tag in _REQUIRED_TAGS if not tags[tag]]
    if formatting == "sharegpt" and missing:
        usual = ", ".join(f"{tag}: {DEFAULT_TAGS[tag]}" for tag in _REQUIRED_TAGS)
        raise UserError(
            f"{where} has tags without {missing[0]}; an entry's tags replace all of LLaMA-Factory's defaults, so "
            f"give {', '.join(_REQUIRED_TAGS)} (the defaults: {usual})"
        )
    return readings[0], tags
