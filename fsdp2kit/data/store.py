"""The token store: a corpus tokenized once into flat files that every later run and every rank memory-maps.

A store is a folder under `data.cache_dir` named by a fingerprint of everything that decides its tokens (the source
files' paths, sizes and modification times, the tokenizer, the data keys that pick fields and rows). It holds
`tokens.bin` (every document's ids followed by EOS, back to back, uint16 when the vocabulary fits, else uint32),
`offsets.bin` (int64, where each document starts, plus the end), `prompt_lengths.bin` (int32, SFT only),
`masks.bin` (conversations: uint8 per token, 1 where it is a loss target; no EOS is appended, the chat template ends
each turn) and `meta.json`. It is built with every core into a temporary folder and committed by renaming
that folder, under an exclusive file lock: ranks (and nodes sharing the folder) that start together get one build,
the others wait and then read it; a killed build leaves only a temporary folder, never a store that looks complete."""

from __future__ import annotations

import copy
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from multiprocessing import get_context
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tokenizers

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import cache_root
from fsdp2kit.data.chat import Chat, ChatTemplate, given_template
from fsdp2kit.data.dataset import SourceDocuments, named_dataset, open_source, single_source, source_files
from fsdp2kit.durable import disk_full_message, folder_bytes, fsync_dir, ran_out_of_space, write_durable
from fsdp2kit.errors import RunFault, UserError, raise_pending_interrupt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

STORE_FORMAT = 5  # 4: tool schemas wrapped as {"type": "function", ...} (issue 42); 5: meta.json's "files" (issue 49)
_BATCH_ROWS = 1000  # rows a tokenizer call encodes at once (a task of the pool)
_ROWS_PER_PROCESS = 5000  # below this a second process costs more to start than it saves


@dataclass(frozen=True)
class TokenStore:
    """A committed store, memory-mapped: nothing is read until a sample asks for it."""

    path: Path
    tokens: np.ndarray
    offsets: np.ndarray
    prompt_lengths: np.ndarray | None  # tokens of each document that are prompt (SFT); None: no prompts
    eos_appended: bool  # each document ends in the tokenizer's EOS (training); infer reads documents without it
    meta: dict
    masks: np.ndarray | None = None  # conversations: 1 per trained token (never a document's first)

    @property
    def num_documents(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def document(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]


def default_cache_dir() -> Path:
    """~/.cache/fsdp2kit/tokens (or $FSDP2KIT_CACHE/tokens): one per user and machine, shared by its ranks."""
    return cache_root() / "tokens"


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A hash of what decides a tokenizer's ids: its serialised vocabulary, merges, normalisation and special-token
    handling (a fast tokenizer's JSON, else its vocabulary), and its EOS; not where it was loaded from."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    state = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps([type(tokenizer).__name__, tokenizer.eos_token_id, tokenizer.special_tokens_map], default=str)
    return hashlib.sha256((state + extra).encode()).hexdigest()


def store_fingerprint(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> dict:
    """Everything that changes a store's tokens; seq_len, packing and shuffling do not (samples are cut at read)."""
    source = single_source(cfg.source)
    files = [(f.resolve(), f.stat()) for f in source_files(source, cfg.dataset_dir)]
    entry = named_dataset(cfg)[1]
    return {
        "format": STORE_FORMAT,
        "source": source,
        "registry": None if entry is None else [str(entry.file), entry.attrs],  # how its records are read
        "files": [[str(path), stat.st_size, stat.st_mtime_ns] for path, stat in files],
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "text_key": cfg.text_key,
        "prompt_key": cfg.prompt_key,
        "response_key": cfg.response_key,
        "query_key": cfg.query_key,
        "max_samples": cfg.max_samples,
        "chat": _chat_fingerprint(cfg, tokenizer),
    }


def _chat_fingerprint(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> list:
    """What decides a conversation's tokens and masks: the form, the template's text and the mask options."""
    template = given_template(cfg.chat_template) if cfg.chat_template is not None else None
    own = getattr(tokenizer, "chat_template", None)
    texts = json.dumps([template, own], sort_keys=True, default=str)
    options = [cfg.format, cfg.template, cfg.train_on_prompt, cfg.mask_history, cfg.train_on_eos]
    return [*options, hashlib.sha256(texts.encode()).hexdigest()]


def store_path(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> Path:
    """Where the store of this data config and tokenizer lives: `<cache_dir>/<source name>-<fingerprint>`."""
    digest = hashlib.sha256(json.dumps(store_fingerprint(cfg, tokenizer), sort_keys=True).encode()).hexdigest()
    source = single_source(cfg.source)
    first = source[0] if isinstance(source, list) else source
    stem = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(first.removeprefix("builtin:")).stem)[:40] or "data"
    cache = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else default_cache_dir()
    return cache / f"{stem}-{digest[:20]}"


def open_store(path: Path) -> TokenStore:
    meta = json.loads((path / "meta.json").read_text())
    tokens = np.memmap(path / "tokens.bin", dtype=meta["dtype"], mode="r", shape=(meta["tokens"],))
    offsets = np.memmap(path / "offsets.bin", dtype=np.int64, mode="r", shape=(meta["documents"] + 1,))
    prompts = masks = None
    if meta["sft"]:
        prompts = np.memmap(path / "prompt_lengths.bin", dtype=np.int32, mode="r", shape=(meta["documents"],))
    if meta.get("chat"):
        masks = np.memmap(path / "masks.bin", dtype=np.uint8, mode="r", shape=(meta["tokens"],))
    return TokenStore(path, tokens, offsets, prompts, meta["eos_appended"], meta, masks)


def token_store(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase) -> TokenStore:
    """The store of this data config and tokenizer, built now (once, whoever asks first) if it is absent or was
    damaged after it was committed (a file truncated or removed: a full disk, a copy cut short, a hand)."""
    path = store_path(cfg, tokenizer)
    if path.exists() and _damage(path) is None:
        return open_store(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"data.cache_dir: cannot create '{path.parent}': {exc.strerror}") from None
    with _exclusive(path.parent / f"{path.name}.lock"):
        if path.exists() and (damage := _damage(path)) is not None:  # still damaged now that we hold the lock
            print(f"token store {path} is damaged ({damage}); building it again", flush=True)
            aside = path.with_name(f"{path.name}.damaged-{socket.gethostname()}-{os.getpid()}")
            os.rename(path, aside)  # readers that mapped the old files keep them until they close
            shutil.rmtree(aside, ignore_errors=True)
        if not path.exists():  # another process may have committed it while we waited
            _build(cfg, tokenizer, path)
    return open_store(path)


def _damage(path: Path) -> str | None:
    """What makes a committed store differ from what its meta.json describes, or None when it is whole."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        sizes = {
            "tokens.bin": meta["tokens"] * np.dtype(meta["dtype"]).itemsize,
            "offsets.bin": 8 * meta["documents"] + 8,
        }
        if meta["sft"]:
            sizes["prompt_lengths.bin"] = 4 * meta["documents"]
        if meta.get("chat"):
            sizes["masks.bin"] = meta["tokens"]
        committed = dict(meta["files"])
    except FileNotFoundError:
        return "meta.json is missing"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"meta.json is unreadable: {exc}"
    for name, size in sizes.items():
        file = path / name
        found = file.stat().st_size if file.is_file() else None
        if found != size:
            return f"{name} is {'missing' if found is None else f'{found} bytes'} where meta.json says {size} bytes"
    return _changed_file(path, committed)


def _file_record(file: Path) -> dict:
    """A data file as committed: its modification time and sha256, for `_changed_file`."""
    with open(file, "rb") as handle:
        digest = hashlib.file_digest(handle, "sha256").hexdigest()
    return {"mtime_ns": file.stat().st_mtime_ns, "sha256": digest}


def _changed_file(path: Path, records: dict) -> str | None:
    """The first data file written over since the store was committed (same size, other ids), or None. A file whose
    modification time is the recorded one was not written (a stat, nothing read: a warm start stays a stat per
    file); one with another time is hashed, so that a copy of the cache that did not keep the times is still used."""
    for name, record in records.items():
        file = path / name
        if file.stat().st_mtime_ns != record["mtime_ns"] and _file_record(file)["sha256"] != record["sha256"]:
            return f"{name} was written over since the store was built (its sha256 is not the one meta.json records)"
    return None


@contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    """One holder at a time across processes (and nodes, where the filesystem supports flock); the kernel
    releases it when its holder dies, so a killed builder never blocks the next."""
    try:
        lock = open(lock_path, "a")
    except OSError as exc:
        raise UserError(
            f"data.cache_dir: cannot write '{lock_path}' ({exc.strerror}); give a writable data.cache_dir"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(cfg: DataConfig, tokenizer: PreTrainedTokenizerBase, path: Path) -> None:
    for stale in path.parent.glob(f"{path.name}.tmp-*"):  # left by a killed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    documents = open_source(cfg)
    tmp.mkdir()
    try:
        meta = _write_store(documents, tokenizer, tmp, cfg.num_proc)
        meta["fingerprint"] = store_fingerprint(cfg, tokenizer)
        meta["files"] = {file.name: _file_record(file) for file in sorted(tmp.glob("*.bin"))}
        write_durable(tmp / "meta.json", json.dumps(meta, indent=1).encode())
        os.rename(tmp, path)  # atomic: the store appears whole or not at all
        fsync_dir(path.parent)
    except UnicodeDecodeError:
        raise documents.undecodable() from None
    except OSError as exc:
        if ran_out_of_space(tmp, exc):
            needed = folder_bytes(tmp) + sum(f.stat().st_size for f in documents.files)  # about the text again
            intact = "nothing was committed; set data.cache_dir to a disk with room"
            raise RunFault(disk_full_message(tmp.parent, "the token store", needed, intact)) from None
        raise UserError(
            f"data.cache_dir: writing the token store '{tmp}' failed ({exc.strerror}); nothing was committed"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"token store: {meta['documents']} documents, {meta['tokens']} tokens from {meta['text_bytes']} bytes of "
        f"text in {meta['build_seconds']:.1f}s ({meta['tokens_per_s']:.0f} tokens/s, {meta['workers']}) -> {path}",
        flush=True,
    )
    if meta.get("untrainable"):
        print(
            f"token store: {meta['untrainable']} conversations have no token to train on and are left out", flush=True
        )


def _progress_bar(rows: int) -> Any:
    """A row counter on a terminal, without tqdm's monitor thread: tqdm starts one for every bar, shown or not, and
    a Ctrl-C that lands while it starts was printed as a TqdmMonitorWarning beside the one-line stop."""
    from tqdm.auto import tqdm

    class Bar(tqdm):
        monitor_interval = 0

    return Bar(total=rows, unit=" rows", desc="token store", disable=not sys.stderr.isatty(), mininterval=1)


def _write_store(
    documents: SourceDocuments, tokenizer: PreTrainedTokenizerBase, folder: Path, num_proc: int | None
) -> dict:
    """Tokenize row ranges with every core (or `num_proc`), appending each range's ids to the flat files in row
    order; memory stays a few ranges' worth whatever the corpus size."""
    started = time.perf_counter()
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    rows = len(documents)
    ranges = [(start, min(start + _BATCH_ROWS, rows)) for start in range(0, rows, _BATCH_ROWS)]
    encoded, workers = _encoded_ranges(documents, tokenizer, dtype, ranges, num_proc)
    counts = {"documents": 0, "tokens": 0, "text_bytes": 0, "min_document_tokens": 1 << 62, "untrainable": 0}
    with (
        open(folder / "tokens.bin", "wb") as tokens_file,
        open(folder / "offsets.bin", "wb") as offsets_file,
        open(folder / "prompt_lengths.bin", "wb") as prompts_file,
        open(folder / "masks.bin", "wb") as masks_file,
        _progress_bar(rows) as bar,
    ):
        offsets_file.write(np.zeros(1, np.int64).tobytes())
        for (start, stop), (tokens, lengths, prompt_lengths, text_bytes, masks, untrained) in zip(
            ranges, encoded, strict=True
        ):
            raise_pending_interrupt()  # a Ctrl-C whose exception a finaliser swallowed
            tokens_file.write(tokens.tobytes())
            masks_file.write(masks.tobytes())
            counts["untrainable"] += untrained
            offsets_file.write((counts["tokens"] + np.cumsum(lengths)).tobytes())
            prompts_file.write(prompt_lengths.tobytes())
            counts["documents"] += len(lengths)
            counts["tokens"] += len(tokens)
            counts["text_bytes"] += text_bytes
            counts["min_document_tokens"] = min(counts["min_document_tokens"], int(lengths.min(initial=1 << 62)))
            bar.update(stop - start)
        for handle in (tokens_file, offsets_file, prompts_file, masks_file):
            handle.flush()
            os.fsync(handle.fileno())
    chat = documents.chat_format is not None
    sft = documents.text_key is None and not chat
    if not sft:
        (folder / "prompt_lengths.bin").unlink()
    if not chat:
        (folder / "masks.bin").unlink()
    if counts["tokens"] == 0:
        _refuse_nothing_to_train(documents, counts["untrainable"], chat, sft)
    seconds = time.perf_counter() - started
    return {
        **counts,
        "dtype": np.dtype(dtype).name,
        "sft": sft,
        "chat": chat,
        "eos_appended": tokenizer.eos_token_id is not None and not chat,
        "build_seconds": seconds,
        "tokens_per_s": counts["tokens"] / seconds,
        "workers": workers,
    }


def _refuse_nothing_to_train(documents: SourceDocuments, untrainable: int, chat: bool, sft: bool) -> None:
    if untrainable:  # conversations there were, none with a token to train on
        raise UserError(
            f"data.source: none of its {untrainable} conversations has a token to train on (no assistant turn, or "
            "every one with loss_weight 0); nothing is left to train"
        )
    field = "messages" if chat else documents.response_key if sft else documents.text_key
    raise UserError(f"data.source: no documents (every '{field}' is empty or missing)")


def _encoded_ranges(
    documents: SourceDocuments,
    tokenizer: PreTrainedTokenizerBase,
    dtype: type[np.unsignedinteger],
    ranges: list[tuple[int, int]],
    num_proc: int | None,
) -> tuple[Iterator[tuple], str]:
    """Each row range encoded, in order, and who encodes them. A Rust ("fast") tokenizer encodes in this process
    with its own thread pool over every core: measured 1.7x a `tokenizer(batch)` loop on 2 cores, where a pool of
    spawned processes reached 0.9x (each worker spends seconds importing before its first range, and the Python
    wrapper's attention masks and offsets cost as much again). A Python tokenizer gets freshly spawned processes
    that each receive the table (memory-mapped Arrow, pickled by reference) and the tokenizer once; spawned, not
    forked: a fork of a process with live threads (a rank's communication threads) can crash or hang."""
    cores, eos = len(os.sched_getaffinity(0)), tokenizer.eos_token_id
    rust = _rust_tokenizer(tokenizer) if documents.chat_format is None else None  # chats: rendered by transformers
    if rust is not None:
        threads = _size_rust_thread_pool(num_proc or cores)
        _start_worker(documents, rust, dtype, eos)
        return map(_encode_range, ranges), f"{threads} threads of the Rust tokenizer"
    processes = max(1, min(num_proc or cores, math.ceil(len(documents) / _ROWS_PER_PROCESS)))
    if processes == 1:
        _start_worker(documents, tokenizer, dtype, eos)
        return map(_encode_range, ranges), "1 process"
    return _pool_encoded(documents, tokenizer, dtype, eos, ranges, processes), f"{processes} processes"


def _pool_encoded(
    documents: SourceDocuments,
    tokenizer: PreTrainedTokenizerBase,
    dtype: type[np.unsignedinteger],
    eos: int | None,
    ranges: list[tuple[int, int]],
    processes: int,
) -> Iterator[tuple]:
    initargs = (documents, tokenizer, dtype, eos, True)
    with ProcessPoolExecutor(
        processes, mp_context=get_context("spawn"), initializer=_start_worker, initargs=initargs
    ) as pool:
        yield from pool.map(_encode_range, ranges)


def _rust_tokenizer(tokenizer: PreTrainedTokenizerBase) -> Any:
    """The tokenizer's Rust tokenizer, set as `tokenizer(texts)` sets it for each call (no truncation, no padding,
    its special-token splitting), so that it gives the same ids; None for a Python tokenizer or a class that
    changes how text is encoded."""
    from transformers import TokenizersBackend

    if not isinstance(tokenizer, TokenizersBackend) or any(
        getattr(type(tokenizer), name) is not getattr(TokenizersBackend, name) for name in ("__call__", "_encode_plus")
    ):
        return None
    rust = copy.deepcopy(tokenizer.backend_tokenizer)
    rust.no_truncation()
    rust.no_padding()
    rust.encode_special_tokens = tokenizer.split_special_tokens
    return rust


def _size_rust_thread_pool(threads: int) -> int:
    """Threads the Rust tokenizer will use: its pool is sized by RAYON_NUM_THREADS when first used (a rank has not
    tokenized before its store is built), and TOKENIZERS_PARALLELISM set to false keeps it to one."""
    if os.environ.get("TOKENIZERS_PARALLELISM", "true").lower() in ("", "off", "false", "f", "no", "n", "0"):
        return 1
    os.environ["RAYON_NUM_THREADS"] = str(threads)
    return threads


_worker: dict = {}


def _start_worker(
    documents: SourceDocuments,
    tokenizer: PreTrainedTokenizerBase,
    dtype: type[np.unsignedinteger],
    eos: int | None,
    in_pool: bool = False,
) -> None:
    """What `_encode_range` reads: set once per pool process, or in this process. `tokenizer` is a `transformers`
    tokenizer or its Rust tokenizer (see `_rust_tokenizer`)."""
    if in_pool:  # one process per core already: no tokenizer threads on top
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker.clear()
    _worker.update(documents=documents, tokenizer=tokenizer, dtype=dtype, eos=eos)


def _ids(texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
    tokenizer = _worker["tokenizer"]
    if isinstance(tokenizer, tokenizers.Tokenizer):  # no offsets computed: ids are all a store keeps
        return [e.ids for e in tokenizer.encode_batch_fast(texts, add_special_tokens=add_special_tokens)]
    return tokenizer(texts, add_special_tokens=add_special_tokens, return_attention_mask=False)["input_ids"]


def _encode_chats(chats: list[Chat], dtype: type[np.unsignedinteger]) -> tuple:
    """Conversations rendered with the chat template: ids, lengths, zero prompt lengths, text bytes, the trained
    mask (a document's first token never) and how many had no trained token (left out)."""
    if "template" not in _worker:
        _worker["template"] = ChatTemplate.from_config(_worker["documents"].config, _worker["tokenizer"])
    template: ChatTemplate = _worker["template"]
    ids, masks, text_bytes, untrained = [], [], 0, 0
    for chat in chats:
        tokens, trained = template.encode(chat)
        if len(tokens) < 2 or not any(trained[1:]):
            untrained += 1
            continue
        ids.append(tokens)
        masks.append([False, *trained[1:]])
        text_bytes += sum(len(m["content"].encode()) for m in chat.messages)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype, int(lengths.sum()))
    mask = np.fromiter(chain.from_iterable(masks), np.uint8, int(lengths.sum()))
    return flat, lengths, np.zeros(len(ids), np.int32), text_bytes, mask, untrained


def _encode_range(rows: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray, int]:
    """Rows [start, stop) as flat token ids (each document followed by EOS), document lengths, prompt lengths
    (SFT; zeros otherwise), the UTF-8 bytes of their text, the trained mask (conversations; empty otherwise) and
    the count of conversations left out; rows without a document give none. A prompt gets the tokenizer's default
    special tokens (e.g. BOS); the response is joined as ids."""
    documents: SourceDocuments = _worker["documents"]
    dtype = _worker["dtype"]
    texts: list[Any] = documents.read(*rows)
    eos = [] if _worker["eos"] is None else [_worker["eos"]]
    no_masks = np.zeros(0, np.uint8)
    if not texts:
        return np.zeros(0, dtype), np.zeros(0, np.int64), np.zeros(0, np.int32), 0, no_masks, 0
    if documents.chat_format is not None:
        return _encode_chats(texts, dtype)
    if documents.text_key is None:
        prompts = _ids([d.prompt for d in texts])
        responses = _ids([d.response for d in texts], add_special_tokens=False)
        ids = [p + r + eos for p, r in zip(prompts, responses, strict=True)]
        prompt_lengths = np.fromiter(map(len, prompts), np.int32, len(prompts))
        text_bytes = sum(len(d.prompt.encode()) + len(d.response.encode()) for d in texts)
    else:
        ids = [x + eos for x in _ids(texts)]
        prompt_lengths = np.zeros(len(ids), np.int32)
        text_bytes = sum(len(t.encode()) for t in texts)
    lengths = np.fromiter(map(len, ids), np.int64, len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype, int(lengths.sum()))
    return flat, lengths, prompt_lengths, text_bytes, no_masks, 0


def describe(store: TokenStore) -> str:
    """One line for `fsdp2kit prepare`: what the store holds and how fast it was built."""
    meta = store.meta
    return (
        f"{store.path}: {meta['documents']} documents, {meta['tokens']} tokens, {meta['text_bytes']} bytes of text; "
        f"built in {meta['build_seconds']:.1f}s at {meta['tokens_per_s']:.0f} tokens/s by {meta['workers']}"
    )
