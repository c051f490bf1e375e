"""`fsdp2kit infer` over HF folders written by transformers: the same log-probs as a plain transformers forward,
at 1 and 2 ranks, for untied (Llama) and tied (Qwen3) embeddings."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import REPO, make_hf_folder, run_cli, set_args

from fsdp2kit.data.builtin import corpus_documents

TEXTS = [d[:400] for d in corpus_documents()[100:107]]


def reference_logprobs(model, path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    sums = []
    with torch.no_grad():
        for text in TEXTS:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            sums.append(logprobs.gather(-1, ids[0, 1:, None]).sum().item())
    return sums


def infer_records(folder, data, out, nproc=1, settings: dict | None = None, run=run_cli) -> list[dict]:
    """`fsdp2kit infer` of the model in `folder` on `data`: its records, the summary last. Launched, or with
    run=run_main (1 rank) in this process."""
    given = {"model.name_or_path": str(folder), "data.source": str(data), "training.output_dir": str(out)}
    ranks = ["--nproc", str(nproc)] if nproc > 1 else []
    result = run("infer", "examples/demo.yaml", *ranks, *set_args({**given, **(settings or {})}))
    assert result.returncode == 0, result.stderr
    return [json.loads(line) for line in (out / "infer.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("builtin, shard", [("tiny-llama", None), ("tiny-qwen3", "1MB")])
def test_infer_matches_transformers(tmp_path, builtin, shard, run_main):
    """At 1 rank (in this process) and 2 (launched)."""
    folder = tmp_path / "model"
    model = make_hf_folder(folder, builtin, shard)
    assert model.config.tie_word_embeddings == (builtin == "tiny-qwen3")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    expected = reference_logprobs(model, folder)
    for nproc in (1, 2):
        out = tmp_path / f"out{nproc}"
        settings = {"strategy_args.strategy_name": "fsdp2_infer", "infer_batch_size": 3}
        records = infer_records(folder, data, out, nproc, settings, run=run_main if nproc == 1 else run_cli)
        samples, summary = records[:-1], records[-1]
        assert [r["index"] for r in samples] == list(range(len(TEXTS)))
        assert [r["sum_logprob"] for r in samples] == pytest.approx(expected, abs=1e-4)
        assert summary["perplexity"] == pytest.approx(
            torch.tensor(-sum(expected) / sum(r["num_tokens"] for r in samples)).exp().item(), rel=1e-5
        )
        assert not any(r["truncated"] for r in samples)


def test_infer_says_which_samples_it_cut_at_seq_len(tmp_path):
    """A sample longer than data.seq_len is scored on its first seq_len tokens: marked, and counted in one line."""
    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in [TEXTS[0], "short"]))
    given = {"model.name_or_path": str(folder), "data.source": str(data), "training.output_dir": str(tmp_path / "o")}
    settings = {"strategy_args.strategy_name": "fsdp2_infer", "data.seq_len": 16}
    result = run_cli("infer", "examples/demo.yaml", *set_args({**given, **settings}))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "o" / "infer.jsonl").read_text().splitlines()][:-1]
    assert [(r["truncated"], r["num_tokens"]) for r in records] == [(True, 15), (False, records[1]["num_tokens"])]
    assert "infer: 1 of 2 samples are longer than data.seq_len = 16 and were scored on their first part" in (
        result.stdout
    )


def test_infer_says_which_conversations_it_cut_at_seq_len(tmp_path, run_main):
    """Conversations longer than data.seq_len were scored on their first part without a word (issue 34: 6/0/0
    tokens instead of 18/57/13): each is marked and counted in one line; a short one is scored whole."""
    folder = tmp_path / "model"
    make_hf_folder(folder, "tiny-llama")
    turns = [("hi", "hello there"), ("say more " * 40, "more words " * 40)]
    data = tmp_path / "chats.jsonl"
    data.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            for q, a in turns
        )
    )
    template = REPO / "tests" / "fixtures" / "chat_templates" / "chatml.jinja"
    given = {"model.name_or_path": str(folder), "data.source": str(data), "training.output_dir": str(tmp_path / "o")}
    settings = {"strategy_args.strategy_name": "fsdp2_infer", "data.seq_len": 64, "data.chat_template": str(template)}
    settings["data.cache_dir"] = str(tmp_path)
    result = run_main("infer", "examples/demo.yaml", *set_args({**given, **settings}))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "o" / "infer.jsonl").read_text().splitlines()][:-1]
    assert [r["truncated"] for r in records] == [False, True]
    assert records[0]["num_tokens"] > 0
    assert "infer: 1 of 2 samples are longer than data.seq_len = 64 and were scored on their first part" in (
        result.stdout
    )
