"""The data pipeline: every kind of source, SFT loss masks (padded and packed), document boundaries in packed
samples, max_samples, and one-sentence errors for a bad source."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import corpus_documents, tokenizer_dir
from fsdp2kit.data.dataset import IGNORE_INDEX, PromptResponse, collate, load_documents, tokenize_samples
from fsdp2kit.errors import UserError
from fsdp2kit.train.loop import token_loss_sum

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
    from transformers import AutoTokenizer

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


def expected_sft_tokens(tokenizer):
    """Per example: prompt ids (with default special tokens), response ids + EOS."""
    return [
        (
            tokenizer(r["prompt"])["input_ids"],
            tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        )
        for r in SFT
    ]


def test_sft_loss_is_on_the_response_and_eos_only(tokenizer):
    documents = [PromptResponse(**row) for row in SFT]
    samples = tokenize_samples(documents, tokenizer, DataConfig(seq_len=64, pack=False))
    batch = collate(samples, tokenizer.pad_token_id)
    for row, (prompt, response) in enumerate(expected_sft_tokens(tokenizer)):
        tokens = prompt + response
        assert batch["input_ids"][row, : len(tokens) - 1].tolist() == tokens[:-1]
        # label i is token i+1: the prompt's tokens (after the first) are never targets, every response token is
        expected = [IGNORE_INDEX] * (len(prompt) - 1) + response
        assert batch["labels"][row, : len(tokens) - 1].tolist() == expected
        assert (batch["labels"][row, len(tokens) - 1 :] == IGNORE_INDEX).all()


def test_sft_masks_travel_with_the_tokens_when_packing(tokenizer):
    documents = [PromptResponse(**row) for row in SFT] * 3
    samples = tokenize_samples(documents, tokenizer, DataConfig(seq_len=16, pack=True))
    stream, trained = [], []
    for prompt, response in expected_sft_tokens(tokenizer) * 3:
        stream += prompt + response
        trained += [False] * len(prompt) + [True] * len(response)
    assert len(samples) == len(stream) // 17
    for index, sample in enumerate(samples):
        window = slice(index * 17, (index + 1) * 17)
        assert sample.tokens.tolist() == stream[window]
        assert sample.trained.tolist() == trained[window]


def test_samples_without_any_target_are_dropped(tokenizer):
    long_prompt = PromptResponse(" ".join(["word"] * 100), " answer")
    kept = PromptResponse("short", " answer")
    samples = tokenize_samples([long_prompt, kept], tokenizer, DataConfig(seq_len=16, pack=False))
    assert len(samples) == 1 and samples[0].tokens[0] == tokenizer("short")["input_ids"][0]


@pytest.fixture(scope="module")
def tiny_model():
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.models.builtin import BUILTIN_MODELS

    settings = dict(BUILTIN_MODELS["tiny-llama"], num_hidden_layers=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(settings.pop("model_type"), **settings)).eval()


@pytest.mark.parametrize("document_mask", [True, False])
def test_packed_documents_do_not_attend_to_each_other(tokenizer, tiny_model, document_mask):
    """With document_mask the training loss of a packed window equals the sum of each document's loss on its own;
    without it, the later documents see the earlier ones and the loss differs."""
    documents = DOCS
    stream_len = sum(len(tokenizer(d)["input_ids"]) + 1 for d in documents)
    cfg = DataConfig(seq_len=stream_len - 1, pack=True, document_mask=document_mask)
    (sample,) = tokenize_samples(documents, tokenizer, cfg)
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


def test_packed_positions_restart_at_each_document(tokenizer):
    lengths = [len(tokenizer(d)["input_ids"]) + 1 for d in DOCS]
    (sample,) = tokenize_samples(DOCS, tokenizer, DataConfig(seq_len=sum(lengths) - 1, pack=True))
    assert sample.positions.tolist() == [p for n in lengths for p in range(n)]
    batch = collate([sample], tokenizer.pad_token_id)
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no padding, so no attention mask to hide it
    first_tokens = [sum(lengths[:i]) for i in range(1, len(lengths))]
    assert all(batch["labels"][0, i - 1] == IGNORE_INDEX for i in first_tokens)  # nothing of its own precedes it


@pytest.mark.parametrize(
    "source, message",
    [
        ("{tmp}/missing.jsonl", "data.source: no such file '{tmp}/missing.jsonl'"),
        ("{tmp}/folder", "data.source: '{tmp}/folder' is a folder but not a saved HF dataset (no dataset_info.json)"),
        ("{tmp}/*.*", "data.source: '{tmp}/*.*' must be *.jsonl, *.parquet or *.txt files of one kind"),
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
    with pytest.raises(UserError) as error:
        load_documents(DataConfig(source=source.format(tmp=tmp_path)))
    assert str(error.value) == message.format(tmp=tmp_path)
