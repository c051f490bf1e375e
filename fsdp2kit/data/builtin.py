"""A corpus and a tokenizer that need no download: the docstrings of the installed Python standard library,
and a byte-level BPE tokenizer trained on them with the `tokenizers` library (cached, built once per machine)."""

from __future__ import annotations

import ast
import fcntl
import os
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CORPUS_CHARS = 2_000_000
VOCAB_SIZE = 4096
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "unk_token": "<|unk|>"}
_VERSION = f"v1-py{sys.version_info.major}{sys.version_info.minor}"


def cache_root() -> Path:
    """`$FSDP2KIT_CACHE`, else ~/.cache/fsdp2kit: one folder per user and machine for what fsdp2kit builds once."""
    return Path(os.environ.get("FSDP2KIT_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "fsdp2kit"))


def cache_dir() -> Path:
    path = cache_root() / _VERSION
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextmanager
def _locked(name: str) -> Iterator[None]:
    """Ranks of one machine build a cached artefact once; the others wait for it."""
    with open(cache_dir() / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
    docs = (ast.get_docstring(n) for n in nodes)
    return [d.strip() for d in docs if d and len(d.strip()) > 40]


def corpus_file() -> Path:
    """The corpus as one file, documents separated by NUL: docstrings of the standard library's own sources, in a
    fixed (sorted) file order; read, never imported. Built once per machine."""
    path = cache_dir() / "corpus.txt"
    with _locked("corpus"):
        if not path.exists():
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            skip = {"site-packages", "test", "tests", "idle_test", "lib2to3", "__pycache__"}
            documents: list[str] = []
            total = 0
            for file in sorted(stdlib.rglob("*.py")):
                if skip.intersection(file.relative_to(stdlib).parts):
                    continue
                for doc in _docstrings(file.read_text(encoding="utf-8", errors="replace")):
                    documents.append(doc)
                    total += len(doc)
                if total >= CORPUS_CHARS:
                    break
            tmp = path.with_suffix(".tmp")
            tmp.write_text("\x00".join(documents), encoding="utf-8")
            tmp.replace(path)
    return path


def corpus_documents() -> list[str]:
    return corpus_file().read_text(encoding="utf-8").split("\x00")


def tokenizer_dir() -> Path:
    """A folder holding the built-in tokenizer, loadable by `transformers.AutoTokenizer.from_pretrained`."""
    path = cache_dir() / f"tokenizer-bpe{VOCAB_SIZE}"
    documents = corpus_documents()
    with _locked("tokenizer"):
        if not (path / "tokenizer.json").exists():
            from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
            from transformers import PreTrainedTokenizerFast

            tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS["unk_token"]))
            tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
            tokenizer.decoder = decoders.ByteLevel()
            trainer = trainers.BpeTrainer(
                vocab_size=VOCAB_SIZE,
                special_tokens=list(SPECIAL_TOKENS.values()),
                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                show_progress=False,
            )
            tokenizer.train_from_iterator(documents, trainer=trainer)
            wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
            tmp = path.with_name(path.name + ".tmp")
            wrapped.save_pretrained(tmp)
            tmp.replace(path)
    return path
