"""The data pipeline: every kind of source, SFT loss masks (padded and packed), document boundaries in packed
samples, max_samples, and one-sentence errors for a bad source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import corpus_documents, tokenizer_dir
from fsdp2kit.data.dataset import IGNORE_INDEX, PromptResponse, Sample, collate, load_documents
from fsdp2kit.data.samples import GlobalBatches, TrainingSamples
from fsdp2kit.errors import UserError
from fsdp2kit.train.step import token_loss_sum

DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the sum of two numbers.",
    "A third, somewhat longer document about packing samples into windows of tokens.",
]
SFT = [
    {"prompt": "Question: what is 2+2?\nAnswer:", "response": " 4"},
    {"prompt": "Name a colour.", "response": " Blue, or green, or any other colour you like."},
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_every_source_kind_yields_the_same_documents(tmp_path):
    import datasets

    table = datasets.Dataset.from_dict({"text": DOCS, "id": [1, 2, 3]})
    sources = {
        "jsonl": write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS]),
        "parquet": tmp_path / "docs.parquet",
        "txt": tmp_path / "docs.txt",
        "HF dataset folder": tmp_path / "saved",
        "HF DatasetDict folder": tmp_path / "saved_dict",
        "glob of jsonl files": tmp_path / "part-*.jsonl",
    }
    table.to_parquet(str(sources["parquet"]))
    sources["txt"].write_text("\n".join(DOCS) + "\n\n")  # one document a line; the blank line is dropped
    table.save_to_disk(str(sources["HF dataset folder"]))
    datasets.DatasetDict({"train": table, "test": table.select([0])}).save_to_disk(
        str(sources["HF DatasetDict folder"])
    )
    write_jsonl(tmp_path / "part-0.jsonl", [{"text": DOCS[0]}])
    write_jsonl(tmp_path / "part-1.jsonl", [{"text": d} for d in DOCS[1:]])
    for kind, source in sources.items():
        assert load_documents(DataConfig(source=str(source))) == DOCS, kind
    files = [str(tmp_path / "part-0.jsonl"), str(tmp_path / "part-1.jsonl")]
    assert load_documents(DataConfig(source=files)) == DOCS


def test_text_key_and_max_samples(tmp_path):
    source = write_jsonl(tmp_path / "docs.jsonl", [{"body": d, "text": "not this"} for d in DOCS])
    assert load_documents(DataConfig(source=str(source), text_key="body", max_samples=2)) == DOCS[:2]
    assert load_documents(DataConfig(source="builtin:corpus", max_samples=5)) == corpus_documents()[:5]


def test_sft_fields_give_prompt_response_pairs(tmp_path):
    source = write_jsonl(tmp_path / "sft.jsonl", SFT + [{"prompt": "empty response is dropped", "response": ""}])
    assert load_documents(DataConfig(source=str(source))) == [PromptResponse(**row) for row in SFT]
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": r["prompt"], "a": r["response"]} for r in SFT])
    cfg = DataConfig(source=str(renamed), prompt_key="q", response_key="a")
    assert load_documents(cfg) == [PromptResponse(**row) for row in SFT]


def samples_of(tmp_path, rows: list, **settings) -> TrainingSamples:
    """The training samples of `rows` (texts or SFT records) written as a jsonl file, through a token store."""
    source = write_jsonl(tmp_path / "rows.jsonl", [{"text": r} if isinstance(r, str) else r for r in rows])
    cfg = DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **settings)
    return TrainingSamples.from_config(cfg, AutoTokenizer.from_pretrained(tokenizer_dir()))


def every(samples: TrainingSamples) -> list[Sample]:
    return [samples[i] for i in range(len(samples))]


def expected_sft_tokens(tokenizer):
    """Per example: prompt ids (with default special tokens), response ids + EOS."""
    return [
        (
            tokenizer(r["prompt"])["input_ids"],
            tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        )
        for r in SFT
    ]


def test_sft_loss_is_on_the_response_and_eos_only(tokenizer, tmp_path):
    samples = samples_of(tmp_path, SFT, seq_len=64, pack=False)
    batch = collate(every(samples), tokenizer.pad_token_id)
    for row, (prompt, response) in enumerate(expected_sft_tokens(tokenizer)):
        tokens = prompt + response
        assert batch["input_ids"][row, : len(tokens) - 1].tolist() == tokens[:-1]
        # label i is token i+1: the prompt's tokens (after the first) are never targets, every response token is
        expected = [IGNORE_INDEX] * (len(prompt) - 1) + response
        assert batch["labels"][row, : len(tokens) - 1].tolist() == expected
        assert (batch["labels"][row, len(tokens) - 1 :] == IGNORE_INDEX).all()


def test_sft_masks_travel_with_the_tokens_when_packing(tokenizer, tmp_path):
    samples = samples_of(tmp_path, SFT * 3, seq_len=16, pack=True)
    stream, trained = [], []
    for prompt, response in expected_sft_tokens(tokenizer) * 3:
        stream += prompt + response
        trained += [False] * len(prompt) + [True] * len(response)
    assert len(samples) == len(stream) // 17
    for index, sample in enumerate(every(samples)):
        window = slice(index * 17, (index + 1) * 17)
        assert sample.tokens.tolist() == stream[window]
        assert sample.trained.tolist() == trained[window]


def test_samples_without_any_target_are_dropped(tokenizer, tmp_path):
    long_prompt = {"prompt": " ".join(["word"] * 100), "response": " answer"}
    kept = {"prompt": "short", "response": " answer"}
    samples = samples_of(tmp_path, [long_prompt, kept], seq_len=16, pack=False)
    assert len(samples) == 1 and samples[0].tokens[0] == tokenizer("short")["input_ids"][0]


def reference_samples(rows: list, tokenizer, seq_len: int, pack: bool, document_mask: bool) -> list[Sample]:
    """The samples of the pipeline before the token store, computed here from scratch with the tokenizer: each
    document's ids (a prompt's, then the response's) and EOS; no target at a document's first token nor in a
    prompt; unpacked: a document cut at seq_len + 1; packed: the joined stream cut into windows of seq_len + 1 with
    positions restarting at each document and at the window's start; samples without a target dropped."""
    documents = []
    for row in rows:
        if isinstance(row, str):
            if row:
                documents.append((tokenizer(row)["input_ids"] + [tokenizer.eos_token_id], 0))
        elif row["response"]:
            prompt = tokenizer(row["prompt"])["input_ids"]
            response = tokenizer(row["response"], add_special_tokens=False)["input_ids"]
            documents.append((prompt + response + [tokenizer.eos_token_id], len(prompt)))
    width, samples = seq_len + 1, []
    if not pack:
        for ids, prompt in documents:
            trained = [i >= max(prompt, 1) for i in range(len(ids))][:width]
            samples.append(Sample(torch.tensor(ids[:width]), torch.tensor(trained)))
    else:
        stream = [(t, i >= max(prompt, 1), i) for ids, prompt in documents for i, t in enumerate(ids)]
        for start in range(0, len(stream) - width + 1, width):
            window = stream[start : start + width]
            positions, position = [], 0
            for k, (_, _, in_document) in enumerate(window):
                position = 0 if k == 0 or in_document == 0 else position + 1
                positions.append(position)
            samples.append(
                Sample(
                    torch.tensor([t for t, _, _ in window]),
                    torch.tensor([trained for _, trained, _ in window]),
                    torch.tensor(positions) if document_mask else None,
                )
            )
    return [s for s in samples if s.trained[1:].any()]


EDGY_TEXTS = [d[: 5 + (i * 131) % 700] for i, d in enumerate(corpus_documents()[:120])] + ["", "a", "b", "x" * 3]
EDGY_SFT = [
    {"prompt": d[: (i * 37) % 300], "response": d[(i * 37) % 300 : (i * 37) % 300 + 5 + (i * 53) % 200]}
    for i, d in enumerate(corpus_documents()[200:320])
] + [
    {"prompt": "only a prompt", "response": ""},
    {"prompt": "p " * 80, "response": "r"},
    {"prompt": "", "response": "z"},
]


@pytest.mark.parametrize("kind", ["text", "sft"])
@pytest.mark.parametrize("pack, document_mask", [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("seq_len", [16, 100])
def test_samples_and_batches_are_those_of_the_reference(tokenizer, tmp_path, kind, pack, document_mask, seq_len):
    """Every sample (tokens, loss mask, document positions) and every micro-batch of every rank equal those of the
    reference pipeline, so the 1-process numerics and exact-resume tests carry over to the token store."""
    rows = EDGY_TEXTS if kind == "text" else EDGY_SFT
    samples = samples_of(tmp_path, rows, seq_len=seq_len, pack=pack, document_mask=document_mask)
    expected = reference_samples(rows, tokenizer, seq_len, pack, document_mask)
    assert len(samples) == len(expected) > 8
    for got, want in zip(every(samples), expected, strict=True):
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.trained, want.trained)
        assert (got.positions is None) == (want.positions is None)
        assert got.positions is None or torch.equal(got.positions, want.positions)
    micro_batch, accumulation, ranks = 2, 2, 2
    order = torch.randperm(len(expected), generator=torch.Generator().manual_seed(5 * 1_000_003 + 0))
    for rank in range(ranks):
        batches = GlobalBatches(samples, micro_batch, accumulation, ranks, rank, 5, True, tokenizer.pad_token_id)
        for step in (0, 1):
            first = step * 8 + rank * 4
            for m, batch in enumerate(batches.micro_batches(step)):
                indices = order[first + 2 * m : first + 2 * m + 2].tolist()
                want = collate([expected[i] for i in indices], tokenizer.pad_token_id)
                assert batch.keys() == want.keys() and all(torch.equal(batch[k], want[k]) for k in want)


def sample_rows(micro_batches: list[dict]) -> list[tuple]:
    """The unpadded inputs of every sample of the micro-batches, sorted."""
    return sorted(
        tuple(batch["input_ids"][row][batch["attention_mask"][row] == 1].tolist())
        for batch in micro_batches
        for row in range(len(batch["input_ids"]))
    )


def test_token_budget_micro_batches_hold_the_step_samples_under_the_budget(tokenizer, tmp_path):
    """Each rank's micro-batches hold exactly its share of the step, padded to at most the budget, in as many
    micro-batches as the rank needing most; fixed micro-batches of the same samples pad more."""
    samples = samples_of(tmp_path, EDGY_TEXTS, seq_len=100, pack=False)
    budget, ranks, per_rank = 200, 2, 8
    padded = {"fixed": 0, "budget": 0}
    for step in range(4):
        counts = []
        for rank in range(ranks):
            fixed = GlobalBatches(samples, 2, 4, ranks, rank, 5, True, tokenizer.pad_token_id).micro_batches(step)
            grouped = GlobalBatches(samples, 2, 4, ranks, rank, 5, True, tokenizer.pad_token_id, budget)
            batches = grouped.micro_batches(step)
            assert all(b["input_ids"].numel() <= budget for b in batches)
            assert sample_rows(batches) == sample_rows(fixed)
            padded["fixed"] += sum(int((b["attention_mask"] == 0).sum()) for b in fixed)
            padded["budget"] += sum(int((b["attention_mask"] == 0).sum()) for b in batches)
            counts.append(len(batches))
        assert len(set(counts)) == 1 and 1 < counts[0] <= per_rank
    assert padded["budget"] < 0.7 * padded["fixed"]  # 539 vs 946 pad tokens here


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.models.builtin import BUILTIN_MODELS

    settings = dict(BUILTIN_MODELS["tiny-llama"], num_hidden_layers=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings)).eval()


@pytest.mark.parametrize("document_mask", [True, False])
def test_packed_documents_do_not_attend_to_each_other(tokenizer, tiny_model, document_mask, tmp_path):
    """With document_mask the training loss of a packed window equals the sum of each document's loss on its own;
    without it, the later documents see the earlier ones and the loss differs."""
    documents = DOCS
    stream_len = sum(len(tokenizer(d)["input_ids"]) + 1 for d in documents)
    (sample,) = every(samples_of(tmp_path, documents, seq_len=stream_len - 1, pack=True, document_mask=document_mask))
    with torch.no_grad():
        packed = token_loss_sum(tiny_model, collate([sample], tokenizer.pad_token_id)).item()
        alone = 0.0
        for document in documents:
            ids = torch.tensor([tokenizer(document)["input_ids"] + [tokenizer.eos_token_id]])
            logits = tiny_model(input_ids=ids[:, :-1]).logits
            alone += F.cross_entropy(logits[0], ids[0, 1:], reduction="sum").item()
    if document_mask:
        assert packed == pytest.approx(alone, rel=1e-5)
    else:
        assert abs(packed - alone) > 1e-3 * alone


def test_packed_positions_restart_at_each_document(tokenizer, tmp_path):
    lengths = [len(tokenizer(d)["input_ids"]) + 1 for d in DOCS]
    (sample,) = every(samples_of(tmp_path, DOCS, seq_len=sum(lengths) - 1, pack=True))
    assert sample.positions.tolist() == [p for n in lengths for p in range(n)]
    batch = collate([sample], tokenizer.pad_token_id)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no padding, so no attention mask to hide it
    first_tokens = [sum(lengths[:i]) for i in range(1, len(lengths))]
    assert all(batch["labels"][0, i - 1] == IGNORE_INDEX for i in first_tokens)  # nothing of its own precedes it


@pytest.mark.parametrize(
    "source, message",
    [
        ("{tmp}/missing.jsonl", "data.source: no such file '{tmp}/missing.jsonl'"),
        (
            "{tmp}/folder",
            "data.source: folder '{tmp}/folder' holds no training data files (*.jsonl, *.json, *.parquet or *.txt)",
        ),
        ("{tmp}/*.*", "data.source: '{tmp}/*.*' must be *.jsonl, *.json, *.parquet or *.txt files of one kind"),
        ("{tmp}/run.sh", "data.source: '{tmp}/run.sh' must be *.jsonl, *.json, *.parquet or *.txt files of one kind"),
        (
            "{tmp}/fields.jsonl",
            "data.text_key: '{tmp}/fields.jsonl' has no field 'text' (nor both 'prompt' and 'response' "
            "for SFT); its fields: prompt, answer",
        ),
        ("builtin:wiki", "data.source: unknown built-in dataset 'builtin:wiki'; valid: builtin:corpus"),
    ],
)
def test_bad_sources_are_one_sentence(tmp_path, source, message):
    (tmp_path / "folder").mkdir()
    write_jsonl(tmp_path / "fields.jsonl", [{"prompt": "p", "answer": "a"}])
    (tmp_path / "notes.txt").write_text("x\n")
    (tmp_path / "run.sh").write_text("echo\n")  # a file of no data kind
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source=source.format(tmp=tmp_path)))
    assert str(error.value) == message.format(tmp=tmp_path)


def test_a_folder_of_data_files_is_read_as_load_dataset_reads_it(tmp_path):
    """ROLL's `data/geoqa_data/`: datasets.load_dataset(folder) takes its files (not hidden ones) as the train split,
    leaving out files named as another split."""
    folder = tmp_path / "geoqa_data"
    (folder / "part").mkdir(parents=True)
    write_jsonl(folder / "a.jsonl", [{"text": "one"}])
    write_jsonl(folder / "part" / "b.jsonl", [{"text": "two"}])
    write_jsonl(folder / "test.jsonl", [{"text": "held out"}])
    write_jsonl(folder / ".cache.jsonl", [{"text": "hidden"}])
    texts = [str(d) for d in load_documents(DataConfig(source=str(folder)))]
    assert texts == ["one", "two"]


def test_a_llamafactory_data_folder_is_named_not_trained_as_its_registry(tmp_path):
    """A LLaMA-Factory data folder (dataset_info.json naming its datasets, as LLaMA-Factory's own `data/` folder)
    was taken for a `save_to_disk` folder (FileNotFoundError); read as a folder of files it would train on the
    registry itself. It is one line naming its datasets."""
    import shutil

    fixtures = Path(__file__).parent / "fixtures" / "llamafactory"
    shutil.copy(fixtures / "alpaca_en_demo.json", tmp_path / "alpaca_en_demo.json")
    registry = {"alpaca_en_demo": {"file_name": "alpaca_en_demo.json"}, "itself": {"file_name": "dataset_info.json"}}
    (tmp_path / "dataset_info.json").write_text(json.dumps(registry))
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source=str(tmp_path)))
    assert str(error.value) == (
        f"data.source: '{tmp_path}' is a LLaMA-Factory data folder (its dataset_info.json names datasets: "
        f"alpaca_en_demo, itself); set data.dataset_dir: '{tmp_path}' and data.source to the names of the datasets "
        "to train on"
    )
