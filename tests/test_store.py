"""The token store: built once and reused, a new one when what decides its tokens changes, never used half-built, one
build when processes start together; and the edges of real corpora in `train` and `infer`: empty and one-token
documents, an empty file, a malformed line, bytes that are not UTF-8, a corpus smaller than one global batch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tokenizers
from conftest import REPO, read_metrics, run_cli
from transformers import AutoTokenizer, TokenizersBackend

from fsdp2kit.cli import main
from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import corpus_documents, tokenizer_dir
from fsdp2kit.data.store import store_path, token_store
from fsdp2kit.errors import UserError

TINY = ["--set", "model.config.num_hidden_layers=1", "--set", "data.seq_len=32", "--set", "training.export_hf=false"]
TINY += ["--set", "model.allow_random_init=true"]  # infer scores the random built-in model: what matters is the data


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_store_is_reused_and_replaced_when_its_inputs_change(tmp_path, tokenizer, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:30])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    store = token_store(cfg, tokenizer)
    assert capsys.readouterr().out.count("token store: 30 documents") == 1
    ids = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in corpus_documents()[:30]]
    assert store.tokens.dtype == np.uint16 and store.tokens.tolist() == [t for doc in ids for t in doc]
    assert store.offsets.tolist() == np.cumsum([0] + [len(doc) for doc in ids]).tolist()
    assert token_store(cfg.model_copy(update={"seq_len": 7, "pack": False}), tokenizer).path == store.path
    assert capsys.readouterr().out == ""  # read, not rebuilt: samples are cut at read time
    assert store_path(cfg.model_copy(update={"max_samples": 3}), tokenizer) != store.path
    assert store_path(cfg.model_copy(update={"text_key": "body"}), tokenizer) != store.path
    write_jsonl(source, corpus_documents()[:29])  # a new size and modification time
    assert store_path(cfg, tokenizer) != store.path


def _written_over(store):
    """tokens.bin overwritten in place, the same size, with ids past the 4096-token vocabulary: an IndexError in the
    embedding when the store was used. The write comes later than the build's own (a file's time ticks in
    milliseconds), as a hand's or another program's does."""
    time.sleep(0.05)
    tokens = np.memmap(store / "tokens.bin", dtype=np.uint16, mode="r+")
    tokens[:] = 60000
    tokens.flush()


@pytest.mark.parametrize(
    "damage, reason",
    [
        (_written_over, "tokens.bin was written over since the store was built (its sha256 is not the one meta.json"),
        (lambda store: os.truncate(store / "tokens.bin", 1000), "tokens.bin is 1000 bytes where meta.json says "),
        (lambda store: (store / "offsets.bin").unlink(), "offsets.bin is missing where meta.json says "),
        (lambda store: (store / "meta.json").write_text('{"tokens": 12'), "meta.json is unreadable: "),
        (lambda store: (store / "meta.json").unlink(), "meta.json is missing"),
    ],
)
def test_a_store_damaged_after_its_commit_is_built_again(tmp_path, tokenizer, capsys, damage, reason):
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:30])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    whole = token_store(cfg, tokenizer)
    expected = [whole.document(i).tolist() for i in range(whole.num_documents)]
    damage(whole.path)
    capsys.readouterr()
    store = token_store(cfg, tokenizer)
    assert f"token store {whole.path} is damaged ({reason}" in capsys.readouterr().out
    assert [store.document(i).tolist() for i in range(store.num_documents)] == expected
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == [whole.path.name]


def test_a_store_copied_without_its_file_times_is_used_as_it_is(tmp_path, tokenizer, capsys):
    """A cache copied by a tool that does not keep modification times: each file's sha256 is the one recorded, so the
    store is read, not called damaged and built again."""
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:30])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    whole = token_store(cfg, tokenizer)
    for file in whole.path.glob("*.bin"):
        os.utime(file, ns=(time.time_ns(), time.time_ns() + 10**9))
    capsys.readouterr()
    assert token_store(cfg, tokenizer).tokens.tolist() == whole.tokens.tolist()
    assert capsys.readouterr().out == ""


def test_a_cache_dir_it_cannot_write_is_one_sentence(tmp_path, tokenizer):
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:30])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"))
    lock = store_path(cfg, tokenizer).with_suffix(".lock")
    lock.mkdir(parents=True)  # as unwritable as a read-only mount, to a root test
    with pytest.raises(
        UserError, match=r"^data.cache_dir: cannot write '.*\.lock' \(Is a directory\); give a writable"
    ):
        token_store(cfg, tokenizer)


def test_prepare_prints_what_it_built(tmp_path, capsys):
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:40])
    args = ["prepare", "examples/demo.yaml", "--set", f"data.source={source}", "--set", f"data.cache_dir={tmp_path}"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"the token store of {source} ..." and lines[1].startswith("token store: 40 documents, ")
    first = lines[-1]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()  # the second prepare finds it: no build line
    assert [line.split(": done in ")[0] for line in lines] == [
        f"the token store of {source} ...",
        f"the token store of {source}",
        first,
    ]
    expected = sum(len(d.encode()) for d in corpus_documents()[:40])
    assert ": 40 documents, " in first and f" tokens, {expected} bytes of text; built in " in first
    assert first.endswith(" threads of the Rust tokenizer") and " tokens/s " in first


def big_corpus(tmp_path):
    documents = corpus_documents()
    return write_jsonl(tmp_path / "big.jsonl", [documents[i % len(documents)] for i in range(30_000)])


def prepare_process(source, cache) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fsdp2kit", "prepare", "examples/demo.yaml"]
        + ["--set", f"data.source={source}", "--set", f"data.cache_dir={cache}", "--set", "data.num_proc=1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


@pytest.mark.slow
def test_a_killed_build_is_rebuilt_not_used(tmp_path, tokenizer):
    source, cache = big_corpus(tmp_path), tmp_path / "cache"
    build = prepare_process(source, cache)
    deadline = time.monotonic() + 120
    while not any(f.stat().st_size for f in cache.glob("*.tmp-*/tokens.bin")) and time.monotonic() < deadline:
        time.sleep(0.02)
    build.send_signal(signal.SIGKILL)  # halfway: tokenizing
    build.wait()
    assert list(cache.glob("*.tmp-*")), "the build should have been killed while writing"
    assert not [p for p in cache.iterdir() if ".tmp-" not in p.name and not p.name.endswith(".lock")]
    cfg = DataConfig(source=str(source), cache_dir=str(cache))
    store = token_store(cfg, tokenizer)  # what the next run does: a full build
    assert not list(cache.glob("*.tmp-*"))  # the killed build's leftovers are gone
    assert store.num_documents == 30_000
    last = corpus_documents()[29_999 % len(corpus_documents())]
    assert store.document(29_999).tolist() == tokenizer(last)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.slow
def test_two_processes_building_at_once_make_one_store(tmp_path):
    source, cache = big_corpus(tmp_path), tmp_path / "cache"
    builds = [prepare_process(source, cache) for _ in range(2)]
    outputs = [build.communicate(timeout=300) for build in builds]
    assert [build.returncode for build in builds] == [0, 0], outputs
    assert sum(out.count("token store: 30000 documents") for out, _ in outputs) == 1  # one built, one waited
    assert outputs[0][0].splitlines()[-1] == outputs[1][0].splitlines()[-1]  # and both describe the same store
    assert len([p for p in cache.iterdir() if p.is_dir()]) == 1


def test_the_rust_tokenizer_gives_the_ids_of_a_tokenizer_call_whatever_its_file_sets(tmp_path, tokenizer):
    """The store calls the Rust tokenizer directly (for speed): a tokenizer.json that turns on truncation and padding,
    which `tokenizer(texts)` turns off for each call, must not change what is stored."""
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    rust = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    rust.enable_truncation(max_length=4)
    rust.enable_padding(length=64, pad_id=0, pad_token=tokenizer.convert_ids_to_tokens(0))
    rust.save(str(folder / "tokenizer.json"))
    loaded = AutoTokenizer.from_pretrained(folder)
    assert loaded.backend_tokenizer.truncation is not None  # as the file says, until the first tokenizer call
    source = write_jsonl(tmp_path / "docs.jsonl", corpus_documents()[:30])
    store = token_store(DataConfig(source=str(source), cache_dir=str(tmp_path / "cache")), loaded)
    assert "threads of the Rust tokenizer" in store.meta["workers"]
    expected = [tokenizer(d)["input_ids"] + [tokenizer.eos_token_id] for d in corpus_documents()[:30]]
    assert [store.document(i).tolist() for i in range(30)] == expected


class LowercasingTokenizer(TokenizersBackend):
    """A tokenizer class that changes how text is encoded: its own call, not the Rust tokenizer, must decide."""

    def _encode_plus(self, text, *args, **kwargs):
        return super()._encode_plus([t.lower() for t in text], *args, **kwargs)


@pytest.mark.slow
def test_a_tokenizer_class_of_its_own_is_called_by_a_pool_of_processes(tmp_path, tokenizer):
    folder = tmp_path / "tokenizer"
    tokenizer.save_pretrained(folder)
    lowercasing = LowercasingTokenizer.from_pretrained(folder)
    documents = [d.upper() for d in corpus_documents()]
    source = write_jsonl(tmp_path / "docs.jsonl", [documents[i % len(documents)] for i in range(6000)])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), num_proc=2)
    store = token_store(cfg, lowercasing)
    assert store.meta["workers"] == "2 processes"
    for i in (0, 1, 5999):
        text = documents[i % len(documents)]
        assert store.document(i).tolist() == tokenizer(text.lower())["input_ids"] + [tokenizer.eos_token_id]
        assert store.document(i).tolist() != tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "data.source: '{file}' is empty (no documents)"),
        (
            b'{"text": "one"}\n{"text": two}\n',
            "data.source: '{file}' line 2 is not valid JSON (Expecting value at column 10)",
        ),
        (
            b'{"text": "one"}\n{"text": "\xff two"}\n',
            "data.source: '{file}' line 2 is not UTF-8 text (byte 0xff at column 11)",
        ),
        (b'{"text": ""}\n{"other": "x"}\n', "data.source: no documents (every 'text' is empty or missing)"),
        (b'{"text": "a b c"}\n', "data: the dataset yields 0 samples, fewer than one global batch of 4 "),
    ],
)
@pytest.mark.parametrize("command", ["train", "infer"])
def test_bad_corpora_are_one_line_exit_2(tmp_path, capsys, command, content, message):
    file = tmp_path / "corpus.jsonl"
    file.write_bytes(content)
    args = [command, "examples/demo.yaml", *TINY, "--set", f"data.source={file}", "--set", f"data.cache_dir={tmp_path}"]
    args += ["--set", f"training.output_dir={tmp_path / 'run'}", "--set", "training.per_device_train_batch_size=2"]
    code = main(args)
    if command == "infer" and message.startswith("data: the dataset yields"):
        assert code == 0  # infer has no global batch: one document is fine
        return
    assert code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and error[0].startswith("error: " + message.format(file=file))


@pytest.mark.slow
def test_empty_and_one_token_documents_at_two_ranks(tmp_path, tokenizer, run_main):
    """Empty documents are skipped; a one-token document trains on its EOS and, in infer, has no term to score
    (num_tokens 0) even alone in its batch on a rank. Training runs in this process: one rank accumulating the two
    micro-batches two ranks would each train on."""
    texts = ["", "a", "", corpus_documents()[3][:200], "b", corpus_documents()[4][:150], "", "c"]
    source = write_jsonl(tmp_path / "edges.jsonl", texts)
    common = [*TINY, "--set", f"data.source={source}", "--set", f"data.cache_dir={tmp_path}"]
    run = tmp_path / "train"
    result = run_main(
        "train", "examples/demo.yaml", *common, "--set", f"training.output_dir={run}",
        "--set", "data.pack=false", "--set", "training.per_device_train_batch_size=2", "--set", "training.max_steps=1",
        "--set", "training.gradient_accumulation_steps=2", "--set", "data.shuffle=false",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    (record,) = read_metrics(run)
    kept = [t for t in texts if t]
    # the first 4 documents, each its ids and EOS cut at seq_len + 1 = 33 tokens, of which all but the last are inputs
    assert record["tokens"] == sum(min(len(tokenizer(t)["input_ids"]) + 1, 33) - 1 for t in kept[:4])
    out = tmp_path / "infer"
    result = run_cli(
        "infer", "examples/demo.yaml", "--nproc", "2", *common,
        "--set", f"training.output_dir={out}", "--set", "infer_batch_size=1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    records = [json.loads(line) for line in (out / "infer.jsonl").read_text().splitlines()][:-1]
    assert [r["index"] for r in records] == list(range(len(kept)))
    # terms: each document's ids cut at seq_len = 32, all but the first; none for a one-token document
    assert [r["num_tokens"] for r in records] == [min(len(tokenizer(t)["input_ids"]), 32) - 1 for t in kept]
    assert all((r["mean_logprob"] is None) == (r["num_tokens"] == 0) for r in records)
