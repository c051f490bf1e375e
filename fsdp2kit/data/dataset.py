"""A source's documents (files, an HF dataset folder or the built-in corpus) and how token samples become the
model's inputs. Tokenizing once lives in `store` (the token store), samples and their order in `samples`."""

from __future__ import annotations

import glob
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from fsdp2kit.config.schema import DataConfig, WeightedSource, is_mixture
from fsdp2kit.data.chat import MEDIA_FIELDS, Chat, record_format, to_chat, with_messages_key
from fsdp2kit.data.registry import RegistryEntry, dataset_names, registry_entry
from fsdp2kit.errors import UserError, why_not_a_file
from fsdp2kit.labels import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_FILE_KINDS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
_KINDS_NAMED = "*.jsonl, *.json, *.parquet or *.txt"  # what the refusals say a data file may be


class PromptResponse(NamedTuple):
    """An SFT example: the prompt is context only, the loss is on the response (and the EOS after it)."""

    prompt: str
    response: str


def single_source(source: str | list[str] | list[WeightedSource], key: str = "data.source") -> str | list[str]:
    """A source that is not a mixture, as it was given; a mixture is refused where only one source can be read."""
    if is_mixture(source):
        raise UserError(f"{key}: a weighted mixture ({{path, weight}} entries) is read only by `train` on text data")
    return source  # type: ignore[return-value]


def source_files(source: str | list[str] | list[WeightedSource], dataset_dir: str | None = None) -> list[Path]:
    """The files a `data.source` names (a glob or a list; for a saved HF dataset folder, every file in it; with
    `data.dataset_dir`, the files of the datasets it names), checked to exist and to be of one readable kind (the
    built-in corpus: its cached file); a mixture's entries' files, in turn. Cheap: no data file is read."""
    if is_mixture(source):
        return [file for entry in source for file in source_files(entry.path, dataset_dir)]  # type: ignore[union-attr]
    if dataset_dir is not None:
        return [registry_entry(dataset_dir, name).file for name in dataset_names(single_source(source))]
    return _files_of(single_source(source))


def named_dataset(cfg: DataConfig) -> tuple[DataConfig, RegistryEntry | None]:
    """With `data.dataset_dir`: the config of the one dataset its source names (source: the entry's file, format:
    the entry's formatting) and the entry; else the config as it is."""
    if cfg.dataset_dir is None:
        return cfg, None
    names = dataset_names(single_source(cfg.source))
    if len(names) != 1:
        raise UserError(
            f"data.source: '{cfg.source}' names {len(names)} datasets of data.dataset_dir where one is read here"
        )
    entry = registry_entry(cfg.dataset_dir, names[0])
    return cfg.model_copy(update={"source": str(entry.file), "format": entry.formatting, "dataset_dir": None}), entry


def _files_of(source: str | list[str]) -> list[Path]:
    if source == "builtin:corpus":
        from fsdp2kit.data.builtin import corpus_file

        return [corpus_file()]
    if isinstance(source, str) and source.startswith("builtin:"):
        raise UserError(f"data.source: unknown built-in dataset '{source}'; valid: builtin:corpus")
    if isinstance(source, list):
        files = source
    elif _saved_dataset(source):
        return sorted(f for f in Path(source).rglob("*") if f.is_file())
    elif Path(source).is_dir():
        _refuse_dataset_registry(Path(source))
        files = _folder_files(Path(source))
    else:
        files = sorted(glob.glob(source)) if any(c in source for c in "*?[") else [source]
    missing = [f for f in files if not Path(f).is_file()]
    if missing and Path(missing[0]).exists():  # a folder or a device (/dev/zero) in a list: it exists
        raise UserError(f"data.source: '{missing[0]}' {why_not_a_file(missing[0])}")
    if not files or missing:
        named = "an empty list names no file" if source == [] else f"no such file '{missing[0] if missing else source}'"
        raise UserError(f"data.source: {named}")
    kinds = {_FILE_KINDS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise UserError(f"data.source: '{source}' must be {_KINDS_NAMED} files of one kind")
    return [Path(f) for f in files]


def _saved_dataset(source: object) -> bool:
    """A folder written by `Dataset.save_to_disk` (read with load_from_disk), not a folder of data files: its
    dataset_info.json comes with a state.json (a DatasetDict's folder has dataset_dict.json)."""
    if not isinstance(source, str) or not Path(source).is_dir():
        return False
    folder = Path(source)
    return ((folder / "dataset_info.json").exists() and (folder / "state.json").exists()) or (
        folder / "dataset_dict.json"
    ).exists()


def _refuse_dataset_registry(folder: Path) -> None:
    """A LLaMA-Factory data folder given as data.source: its datasets are named through data.dataset_dir; read
    whole, the registry itself would be trained on as data."""
    registry = folder / "dataset_info.json"
    if not registry.is_file():
        return
    try:  # only to name a few of its datasets: a file too large or too deep to read names none
        raw = registry.read_bytes() if registry.stat().st_size <= 1 << 20 else b""
        names = list(json.loads(raw))[:5] if raw and not json_depth_exceeds(raw, MAX_JSON_DEPTH) else []
    except (ValueError, TypeError, OSError):
        names = []
    raise UserError(
        f"data.source: '{folder}' is a LLaMA-Factory data folder (its dataset_info.json names datasets"
        + (f": {', '.join(map(str, names))}" if names else "")
        + f"); set data.dataset_dir: '{folder}' and data.source to the names of the datasets to train on"
    )


_SPLIT_WORDS = re.compile(r"(?:^|[-_./])(test|testing|eval|valid|validation|dev)(?:$|[-_./\d])")


def _folder_files(folder: Path) -> list[str]:
    """A folder of data files, as `datasets.load_dataset(folder)` reads its train split: every file not hidden
    (no `.`/`__` part), leaving out those named as another split (test, validation, eval, dev)."""
    files = [
        f
        for f in sorted(folder.rglob("*"))
        if f.is_file() and not any(p.startswith((".", "__")) for p in f.relative_to(folder).parts)
    ]
    train = [str(f) for f in files if not _SPLIT_WORDS.search(str(f.relative_to(folder)).lower())]
    if not train:
        raise UserError(f"data.source: folder '{folder}' holds no training data files ({_KINDS_NAMED})")
    return train


# Real records nest a few levels (chat messages with tool calls: ~10); a crafted 20,000-deep value makes parsers
# recurse past the stack (pyarrow's JSON reader crashes the process).
MAX_JSON_DEPTH = 200


def json_depth_exceeds(line: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether a JSON text nests deeper than `limit`. Counting brackets is cheap and settles almost every line; only a
    line with that many brackets is walked, skipping strings."""
    if line.count(b"[") + line.count(b"{") <= limit:
        return False
    depth, in_string, escaped = 0, False, False
    for byte in line:
        if in_string:
            escaped, in_string = (not escaped and byte == 0x5C), in_string and (escaped or byte != 0x22)
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):
            depth += 1
            if depth > limit:
                return True
        elif byte in (0x5D, 0x7D):
            depth -= 1
    return False


def line_problem(raw: bytes, kind: str, max_bytes: int) -> str | None:
    """Why one line of a jsonl/text source cannot be a document (too large, not UTF-8, too deep, not a JSON
    object), or None; checked before any parser sees it."""
    if len(raw) > max_bytes:
        return f"is a {len(raw) / 2**20:.1f} MiB document, more than data.max_document_bytes ({max_bytes} bytes)"
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"is not UTF-8 text (byte {raw[exc.start]:#04x} at column {exc.start + 1})"
    if kind != "json" or not raw.strip():
        return None
    if json_depth_exceeds(raw):
        return f"nests JSON more than {MAX_JSON_DEPTH} levels deep"
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        return f"is not valid JSON ({exc.msg} at column {exc.colno})"
    return None if isinstance(record, dict) else "is not a JSON object"


def _json_array(file: Path) -> bool:
    """Whether a .json file holds one JSON array (LLaMA-Factory's files) rather than a record per line."""
    if file.suffix != ".json":
        return False
    with file.open("rb") as handle:
        return handle.read(4096).lstrip()[:1] == b"["


def _first_bad_line(files: list[Path], kind: str, max_bytes: int = 1 << 62) -> str | None:
    """The first line of jsonl/text files that cannot be a document: 'FILE' line N and why (a .json array is one
    document per element, read whole: not checked line by line)."""
    for file in files:
        if _json_array(file):
            continue
        with file.open("rb") as handle:
            for number, raw in enumerate(handle, start=1):
                problem = line_problem(raw, kind, max_bytes)
                if problem is not None:
                    return f"'{file}' line {number} {problem}"
    return None


def _read_table(source: str | list[str], files: list[Path], max_document_bytes: int) -> Any:
    """A local HF dataset folder or *.jsonl / *.parquet / *.txt files (a glob or a list), as a `datasets.Dataset`
    (memory-mapped Arrow), and which of those it was ('disk', 'json', 'parquet' or 'text')."""
    import datasets

    datasets.disable_progress_bars()  # a bar per split of a local file is noise in a training log
    if _saved_dataset(source):
        dataset = datasets.load_from_disk(source)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"] if "train" in dataset else next(iter(dataset.values()))
        return dataset, "disk"
    kind = _FILE_KINDS[files[0].suffix]
    if all(f.stat().st_size == 0 for f in files):
        raise UserError(f"data.source: '{source}' is empty (no documents)")
    if kind in ("json", "text"):  # before Arrow reads them: a huge or deeply nested line is one sentence
        where = _first_bad_line(files, kind, max_document_bytes)
        if where is not None:
            raise UserError(f"data.source: {where}")
    logger = logging.getLogger("datasets")
    level = logger.level
    logger.setLevel(logging.CRITICAL)  # it logs a traceback before raising; our one line says where instead
    try:
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split="train"), kind
    except Exception as exc:  # datasets raises many types for unreadable files
        where = _first_bad_line(files, kind) if kind in ("json", "text") else None
        if where is not None:
            raise UserError(f"data.source: {where}") from None
        raise UserError(f"data.source: cannot read '{source}': {exc}") from None
    finally:
        logger.setLevel(level)


@dataclass
class SourceDocuments:
    """The rows of a source (the first `max_samples`) and which fields hold a document: `text_key`, or a prompt and
    a response for SFT. Rows are read a range at a time, so a corpus is never one Python list."""

    table: Any  # a datasets.Dataset
    text_key: str | None  # None: prompt/response records
    prompt_key: str
    response_key: str
    query_key: str | None  # SFT: a field appended to the prompt after a newline where present (ROLL's)
    source: str | list[str]
    files: list[Path]
    kind: str
    chat_format: str | None = None  # conversations: data.format (rows hold a record's JSON in `record`)
    config: DataConfig | None = None  # conversations: the options that render and mask them
    entry: RegistryEntry | None = None  # a dataset named in data.dataset_dir: how its records are written

    def undecodable(self) -> UserError:
        """The error for text that is not UTF-8, which Arrow finds only when a row is read: where it is."""
        where = _first_bad_line(self.files, self.kind) if self.kind in ("json", "text") else None
        return UserError(f"data.source: {where or repr(self.source) + ' holds text that is not UTF-8'}")

    def __len__(self) -> int:
        return len(self.table)

    def read(self, start: int, stop: int) -> list[str] | list[PromptResponse] | list[Chat]:
        """The documents of rows [start, stop)."""
        if self.chat_format is not None:
            return self.chats(self.table[start:stop], start)
        return self.documents(self.table[start:stop])

    def chats(self, rows: dict[str, list], first: int) -> list[Chat]:
        """The conversations of a batch of rows, the first of which is row `first`."""
        fmt = self.chat_format or "auto"
        count = len(next(iter(rows.values())))
        if set(rows) == {"where", "record"}:  # read by json_records: each record's JSON and where it is
            records = [json.loads(r) for r in rows["record"]]
            places = rows["where"]
        else:  # a parquet file or a saved dataset: its columns (Arrow's missing fields are None)
            records = [{k: v[i] for k, v in rows.items() if v[i] is not None} for i in range(count)]
            places = [f"record {first + i + 1} of '{self.source}'" for i in range(count)]
        chats = []
        for where, record in zip(places, records, strict=True):
            record = self._canonical(record, where)
            media = [k for k in MEDIA_FIELDS if record.get(k)]
            if media:
                raise UserError(
                    f"data.source: {where} has '{media[0]}', which a text-only model cannot read; train it with a "
                    "vision-language model (docs/vl.md) or drop the field"
                )
            chats.append(to_chat(record, fmt, where))
        return chats

    def _canonical(self, record: dict, where: str) -> dict:
        """The record in the fields the chat readers take: as its registry entry writes it, or renamed by
        data.messages_key."""
        if self.entry is not None:
            return self.entry.canonical(record, where)
        return with_messages_key(record, self.config.messages_key) if self.config else record

    def documents(self, rows: dict[str, list]) -> list[str] | list[PromptResponse]:
        """The documents of a batch of rows (column -> values); empty texts and responses are dropped."""
        if self.text_key is not None:
            return [t for t in rows[self.text_key] if isinstance(t, str) and t]
        prompts, responses = rows[self.prompt_key], rows[self.response_key]
        queries = rows[self.query_key] if self.query_key in rows else [None] * len(prompts)
        return [
            PromptResponse((p if isinstance(p, str) else "") + (f"\n{q}" if isinstance(q, str) and q else ""), r)
            for p, q, r in zip(prompts, queries, responses, strict=True)
            if isinstance(r, str) and r
        ]


def json_records(files: list[Path], max_bytes: int) -> list[tuple[str, dict]]:
    """Every record of .json arrays and .jsonl files as Python objects (conversations: nested and irregular, as
    Arrow's schema inference would not keep them), each jsonl line checked first, with where it is ("record N of
    'FILE'": the array's Nth element, the file's line N)."""
    records: list = []
    for file in files:
        if _json_array(file):
            records += [(f"record {n} of '{file}'", r) for n, r in enumerate(_array_records(file), 1)]
            continue
        where = _first_bad_line([file], "json", max_bytes)
        if where is not None:
            raise UserError(f"data.source: {where}")
        with file.open("rb") as handle:
            records += [
                (f"record {n} of '{file}'", json.loads(line)) for n, line in enumerate(handle, 1) if line.strip()
            ]
    return records


def _array_records(file: Path) -> list[dict]:
    """The records of a .json array file, read whole, each checked as a jsonl line is: nesting past MAX_JSON_DEPTH
    (Python's parser recurses and would end in a RecursionError), not JSON, not objects are one line."""
    raw = file.read_bytes()
    if json_depth_exceeds(raw, MAX_JSON_DEPTH + 1):  # the array itself is one level
        raise UserError(f"data.source: '{file}' nests JSON more than {MAX_JSON_DEPTH} levels deep")
    try:
        array = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"data.source: '{file}' is not a JSON array of records ({exc})") from None
    if not isinstance(array, list) or not all(isinstance(r, dict) for r in array):
        raise UserError(f"data.source: '{file}' is not a JSON array of records (objects)")
    return array


def _first_record(files: list[Path]) -> dict:
    """The first record of a json source, cheaply (a .json array is parsed whole)."""
    file = files[0]
    if _json_array(file):
        array = _array_records(file)
        return array[0] if array else {}
    with file.open("rb") as handle:
        for line in handle:
            if line.strip():
                if json_depth_exceeds(line, MAX_JSON_DEPTH):  # Python's parser would recurse out; the line checks
                    return {}  # name it, in one line
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    return {}
                return record if isinstance(record, dict) else {}
    return {}


def _chat_form(cfg: DataConfig, record: dict) -> str | None:
    """The chat form of a source whose first record (or columns) is this; with data.format: auto, fields named by
    both `prompt_key` and `response_key` (ROLL's SFT files: instruction/output) keep prompt/response reading."""
    if cfg.format == "auto" and cfg.prompt_key in record and cfg.response_key in record:
        return None
    record = with_messages_key(record, cfg.messages_key)
    fields = {k: [] if k in ("messages", "conversations") and not isinstance(v, list) else v for k, v in record.items()}
    return record_format(fields, cfg.format)


def conversation_form(cfg: DataConfig) -> str | None:
    """Whether the source holds conversations (their form, or None), from its first json record or its parquet
    columns, without reading it whole: what `check` asks before a run (of several named datasets: the first's)."""
    if cfg.dataset_dir is not None:
        first = dataset_names(single_source(cfg.source))[:1]
        return named_dataset(cfg.model_copy(update={"source": first}))[0].format if first else None
    files = source_files(cfg.source)
    if cfg.source == "builtin:corpus" or _saved_dataset(cfg.source) or _FILE_KINDS[files[0].suffix] == "text":
        return None
    if _FILE_KINDS[files[0].suffix] == "parquet":
        import pyarrow.parquet as pq

        return _chat_form(cfg, dict.fromkeys(pq.read_schema(files[0]).names, ""))
    return _chat_form(cfg, _first_record(files))


def _chat_table(cfg: DataConfig, files: list[Path], entry: RegistryEntry | None) -> Any:
    """A json source of conversations as a table of one `record` column (each record's JSON), or None when the
    source is not conversations; a registry `entry`'s columns checked against the records' fields."""
    import datasets

    if cfg.source == "builtin:corpus" or _saved_dataset(cfg.source) or _FILE_KINDS[files[0].suffix] != "json":
        return None
    if cfg.format in ("auto", "text") and _chat_form(cfg, _first_record(files)) is None:
        return None
    records = json_records(files, cfg.max_document_bytes)[: cfg.max_samples]
    if not records:
        raise UserError(f"data.source: '{cfg.source}' is empty (no documents)")
    if entry is not None:
        entry.check_columns({key for _, record in records if isinstance(record, dict) for key in record}, entry.file)
    return datasets.Dataset.from_dict({"where": [w for w, _ in records], "record": [json.dumps(r) for _, r in records]})


def open_source(cfg: DataConfig) -> SourceDocuments:
    """The source's rows in file order: conversations (data.format, or records with `messages`, `conversations` or
    `instruction`/`output`), prompt/response pairs when it has both `prompt_key` and `response_key` fields, else
    texts of `text_key`."""
    import datasets

    cfg, entry = named_dataset(cfg)
    source = single_source(cfg.source)
    files = source_files(source)
    chat = _chat_table(cfg, files, entry)
    if chat is not None:
        return SourceDocuments(chat, None, "", "", None, source, files, "json", cfg.format, cfg, entry)
    if source == "builtin:corpus":
        from fsdp2kit.data.builtin import corpus_documents

        table, kind = datasets.Dataset.from_dict({"text": corpus_documents()}), "text"
    else:
        table, kind = _read_table(source, files, cfg.max_document_bytes)
    if cfg.max_samples is not None:
        table = table.select(range(min(cfg.max_samples, len(table))))
    if entry is not None:
        entry.check_columns(table.column_names, entry.file)
    text_key = "text" if kind == "text" else cfg.text_key  # a text file's lines have no field names to choose from
    chat_format = _chat_form(cfg, dict.fromkeys(table.column_names, "")) if kind != "text" else None
    if chat_format is not None:
        return SourceDocuments(table, None, "", "", None, source, files, kind, cfg.format, cfg, entry)
    if cfg.prompt_key in table.column_names and cfg.response_key in table.column_names:
        return SourceDocuments(table, None, cfg.prompt_key, cfg.response_key, cfg.query_key, source, files, kind)
    if text_key not in table.column_names:
        raise UserError(
            f"data.text_key: '{cfg.source}' has no field '{text_key}' (nor both '{cfg.prompt_key}' "
            f"and '{cfg.response_key}' for SFT); its fields: {', '.join(table.column_names)}"
        )
    return SourceDocuments(table, text_key, cfg.prompt_key, cfg.response_key, cfg.query_key, source, files, kind)


def load_documents(cfg: DataConfig) -> list[str] | list[PromptResponse] | list[Chat]:
    """All of a source's documents as one list: for small sources and for checking a store against its source."""
    documents = open_source(cfg)
    return documents.read(0, len(documents))


def load_tokenizer(path: Path, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The tokenizer of a model folder, a checkpoint or `data.tokenizer`, through transformers; a corrupt or
    incomplete one is one sentence naming the damaged file (or the folder, when no file is plainly damaged)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # tokenizers and transformers raise many types for unreadable files
        for file in sorted(Path(path).glob("*.json")):  # a truncated or overwritten tokenizer.json, say
            problem = _json_problem(file)
            if problem is not None:
                raise UserError(
                    f"the tokenizer file '{file}' is damaged ({problem}); restore it from the model's source"
                ) from None
        reason = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else type(exc).__name__
        raise UserError(f"data.tokenizer: the tokenizer in '{path}' cannot be loaded: {reason}") from None


def _json_problem(file: Path) -> str | None:
    """Why a JSON file does not parse, in a few words; None when it does."""
    try:
        json.loads(file.read_bytes())
    except UnicodeDecodeError as exc:
        return f"byte 0x{exc.object[exc.start]:02x} at offset {exc.start} is not UTF-8"
    except json.JSONDecodeError as exc:
        return f"not JSON: {exc.msg} at offset {exc.pos}"
    return None


@dataclass(frozen=True)
class Sample:
    """Up to seq_len + 1 tokens: the model reads tokens[:-1] and predicts tokens[1:]. `trained[i]` says whether
    token i is a loss target; `positions` (packing with document_mask) is each token's position in its document."""

    tokens: torch.Tensor
    trained: torch.Tensor
    positions: torch.Tensor | None = None

    @classmethod
    def document(cls, tokens: torch.Tensor) -> Sample:
        """One whole document, every token after the first trained on."""
        trained = torch.ones(len(tokens), dtype=torch.bool)
        trained[0] = False
        return cls(tokens, trained)


def collate(samples: Sequence[Sample | torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The model's inputs and the labels. Samples are right-padded to the longest; padding is masked from attention
    (`attention_mask`) and loss. Packed samples with document positions are never padded and carry `position_ids`
    instead of an attention mask. A plain tensor is one document's tokens."""
    items = [s if isinstance(s, Sample) else Sample.document(s) for s in samples]
    length = max(len(s.tokens) for s in items) - 1
    batch = len(items)
    input_ids = torch.full((batch, length), pad_id, dtype=torch.long)
    labels = torch.full((batch, length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, length), dtype=torch.long)
    for i, sample in enumerate(items):
        n = len(sample.tokens) - 1
        input_ids[i, :n] = sample.tokens[:-1]
        labels[i, :n] = sample.tokens[1:].masked_fill(~sample.trained[1:], IGNORE_INDEX)
        attention_mask[i, :n] = 1
    if all(s.positions is not None for s in items):
        return {
            "input_ids": input_ids,
            "position_ids": torch.stack([s.positions[:-1] for s in items if s.positions is not None]),
            "labels": labels,
        }
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The keyword arguments of the model's forward: all but the labels."""
    return {key: value for key, value in batch.items() if key != "labels"}


def input_token_count(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tokens the model reads, padding excluded: a tensor on the batch's device, so counting reads nothing on the
    host (the training step fetches it with the loss, once)."""
    mask = batch.get("attention_mask")
    if mask is not None:
        return mask.sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)
