"""Evaluation (`data.eval_source` / `data.eval_fraction`, `training.eval_steps` -> `eval_loss`) and weighted mixtures
of sources (`data.source: [{path, weight}, ...]`): shares, determinism, exact resume, one-line errors."""

from __future__ import annotations

import json
from subprocess import CompletedProcess

import numpy as np
import pytest
import torch
from conftest import SMALL_RUN, CliResult, process_group, read_metrics, run_cli, set_args
from transformers import AutoTokenizer

from fsdp2kit.config.load import validate
from fsdp2kit.config.schema import DataConfig
from fsdp2kit.data.builtin import corpus_documents, tokenizer_dir
from fsdp2kit.data.mixture import MixedSamples, samples_taken, split_samples
from fsdp2kit.data.samples import GlobalBatches
from fsdp2kit.errors import UserError
from fsdp2kit.train.evaluate import EvalBatches, eval_loss
from fsdp2kit.train.resume import data_files

DEMO = "examples/demo.yaml"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(tokenizer_dir())


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


@pytest.fixture
def two_sources(tmp_path):
    """Two sources of 300 and 200 documents (distinct ones) of the built-in corpus."""
    docs = corpus_documents()
    return write_jsonl(tmp_path / "a.jsonl", docs[:300]), write_jsonl(tmp_path / "b.jsonl", docs[300:500])


def mixture(a: str, b: str, **settings) -> list[dict]:
    return [{"path": a, "weight": settings.pop("wa", 0.8)}, {"path": b, "weight": settings.pop("wb", 0.2)}]


def test_eval_fraction_holds_out_a_disjoint_seeded_set(tmp_path, tokenizer):
    cfg = DataConfig(source="builtin:corpus", seq_len=64, eval_fraction=0.05, cache_dir=str(tmp_path / "cache"))
    train, held = split_samples(cfg, tokenizer, seed=42)
    again_train, again_held = split_samples(cfg, tokenizer, seed=42)
    _, other_held = split_samples(cfg, tokenizer, seed=7)
    whole = len(train) + len(held)
    assert len(held) == round(0.05 * whole)
    assert np.array_equal(held.indices, again_held.indices) and np.array_equal(train.indices, again_train.indices)
    assert not set(held.indices.tolist()) & set(train.indices.tolist())
    assert sorted(held.indices.tolist() + train.indices.tolist()) == list(range(whole))
    assert not np.array_equal(held.indices, other_held.indices)
    assert torch.equal(held[0].tokens, train.base[int(held.indices[0])].tokens)


def source_of(samples: MixedSamples, ids: torch.Tensor) -> np.ndarray:
    return samples.pool.locate(ids.numpy())[0]


def test_mixture_gives_each_source_its_share_deterministically(tmp_path, tokenizer, two_sources):
    cfg = DataConfig(source=mixture(*two_sources), seq_len=64, pack=False, cache_dir=str(tmp_path / "cache"))
    samples, held = split_samples(cfg, tokenizer, seed=42)
    assert held is None and isinstance(samples, MixedSamples)
    assert len(samples) == 500 and samples.quotas == [400, 100]
    order = torch.cat([samples.epoch_order(epoch, 42, True) for epoch in range(2)])
    sources = source_of(samples, order[:1000])
    assert abs((sources == 1).mean() - 0.2) <= 0.02
    for start in range(0, 1000, 50):  # any window holds the shares, not only the whole
        assert abs((sources[start : start + 50] == 1).sum() - 10) <= 2
    # the smaller share draws a permutation of its samples: 200 distinct documents over two epochs
    assert len(set(order[sources == 1].tolist())) == 200
    assert torch.equal(order[:500], samples.epoch_order(0, 42, True))
    assert not torch.equal(order[:500], samples.epoch_order(0, 43, True))
    # the batches of a step are the same whichever step the reader starts at (a resume)
    straight = GlobalBatches(samples, 4, 2, 1, 0, 42, True, 0)
    assert samples_taken(straight, range(0, 125)) == [
        "data: steps 1-125 took 1000 samples: 800 from a.jsonl, 200 from b.jsonl"
    ]
    resumed = GlobalBatches(split_samples(cfg, tokenizer, seed=42)[0], 4, 2, 1, 0, 42, True, 0)
    for step in (0, 61, 62, 130):
        for got, expected in zip(resumed.micro_batches(step), straight.micro_batches(step), strict=True):
            assert torch.equal(got["input_ids"], expected["input_ids"])
    print("\n".join(samples.describe()))


def test_mixture_repeats_a_source_that_has_too_few_and_records_every_file(tmp_path, tokenizer, two_sources):
    cfg = DataConfig(source=mixture(*two_sources, wa=1, wb=3), seq_len=64, pack=False, cache_dir=str(tmp_path / "c"))
    samples, _ = split_samples(cfg, tokenizer, seed=1)
    assert samples.quotas == [125, 375]  # b's 200 documents repeated 1.875 times an epoch
    assert "repeated 1.88 times" in samples.describe()[1]
    sources = source_of(samples, samples.epoch_order(0, 1, True))
    assert (sources == 1).sum() == 375
    recorded = [path for path, _, _ in data_files(cfg)]
    assert [p.rsplit("/", 1)[-1] for p in recorded] == ["a.jsonl", "b.jsonl"]


def test_eval_batches_pad_every_rank_to_the_same_forwards():
    collate = lambda indices: {"labels": torch.tensor([[i, i] for i in indices])}  # noqa: E731
    shares = [list(EvalBatches(collate, 7, 2, 3, rank).micro_batches()) for rank in range(3)]
    assert [len(s) for s in shares] == [2, 2, 2]  # ranks hold 3, 2, 2 samples
    counted = sorted(int(v) for s in shares for b in s for v in b["labels"][:, 0] if v >= 0)
    assert counted == list(range(7))
    with process_group():
        result = eval_loss(lambda b: -torch.ones(b["labels"].shape), shares[1], torch.device("cpu"))
    assert result.tokens == 4 and result.loss == pytest.approx(1.0)


@pytest.mark.parametrize(
    "data, message",
    [
        ({"source": [{"path": "a.jsonl", "weight": 0}]}, "entry 0's weight to be a finite number > 0"),
        ({"source": [{"path": "a.jsonl", "weight": -1}]}, "entry 0's weight to be a finite number > 0"),
        ({"source": [{"path": "a.jsonl", "weight": float("inf")}]}, "entry 0's weight to be a finite number > 0"),
        ({"source": [{"path": "a.jsonl", "weight": "heavy"}]}, "entry 0's weight to be a finite number > 0"),
        ({"source": [{"path": "a.jsonl", "wieght": 1}]}, "only the keys path, weight (not 'wieght')"),
        ({"source": [{"path": "a.jsonl"}, "b.jsonl"]}, "every entry of a mixture to be a {path, weight} mapping"),
        ({"eval_fraction": 0.1, "eval_source": "b.jsonl"}, "expected one of data.eval_source and data.eval_fraction"),
        ({"eval_fraction": 1.5}, "data.eval_fraction"),
    ],
)
def test_bad_mixture_and_eval_settings_are_one_sentence(data, message):
    with pytest.raises(UserError) as error:
        validate({"data": data})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_mixture_on_the_command_line_exits_2(tmp_path):
    result = run_cli("train", DEMO, *set_args({"data.source": [{"path": "x.jsonl", "weight": -0.5}]}))
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "weight to be a finite number > 0" in result.stderr


def test_a_mixture_weight_written_1e_3_is_a_number_as_lr_1e_3_is():
    """YAML reads `1e-3` (no dot) as a string; the learning rate takes it, so the mixture weight does too."""
    data = validate({"data": {"source": [{"path": "a.jsonl", "weight": "1e-3"}, {"path": "b.jsonl"}]}}).data
    assert [entry.weight for entry in data.source] == [0.001, 1.0]


def train(tmp_path, run: str, steps: int, nproc: int = 1, here=None, **settings) -> CliResult | CompletedProcess:
    """A short run of the demo with `settings`, launched, or in this process with here=run_main."""
    settings = {
        **SMALL_RUN,
        "training.max_steps": steps,
        "training.output_dir": str(tmp_path / run),
        "data.cache_dir": str(tmp_path / "cache"),
        "training.lr_scheduler_type": "constant",
        "training.warmup_steps": 0,
        **settings,
    }
    if here is not None:
        result = here("train", DEMO, *set_args(settings))
    else:
        result = run_cli("train", DEMO, "--nproc", str(nproc), *set_args(settings))
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_eval_loss_every_eval_steps_and_at_the_end_equal_at_1_and_2_ranks(tmp_path, run_main):
    """eval_loss over 1% of the corpus held out, at step 2 and at the end (3), at 1 and 2 ranks (the same global
    batch), and with Ulysses over the 2 ranks; a learning rate small enough that the runs' weights agree, so what is
    compared is the evaluation itself. An eval batch of 3 leaves ranks a filler row. 1 rank runs in this process."""
    common = {
        "data.eval_fraction": 0.01,
        "training.eval_steps": 2,
        "training.per_device_eval_batch_size": 3,
        "training.learning_rate": 1e-6,
    }
    one = train(tmp_path, "one", 3, here=run_main, **common, **{"training.gradient_accumulation_steps": 2})
    train(tmp_path, "two", 3, 2, **common, **{"training.gradient_accumulation_steps": 1})
    train(tmp_path, "ulysses", 2, 2, **common, **{"training.gradient_accumulation_steps": 2, "model.ulysses_size": 2})
    assert "evaluation set: 73 samples (0.01 of the training samples held out)" in one.stdout
    runs = [read_metrics(tmp_path / run) for run in ("one", "two")]
    for records in runs:
        assert [r["step"] for r in records if "eval_loss" in r] == [2, 3]
    evals = [[(r["eval_loss"], r["eval_tokens"]) for r in records if "eval_loss" in r] for records in runs]
    for (loss_1, tokens_1), (loss_2, tokens_2) in zip(*evals, strict=True):
        assert tokens_1 == tokens_2 and abs(loss_1 - loss_2) < 1e-6
    ulysses = [(r["eval_loss"], r["eval_tokens"]) for r in read_metrics(tmp_path / "ulysses") if "eval_loss" in r]
    assert ulysses[0][1] == evals[0][0][1] and ulysses[0][0] == pytest.approx(evals[0][0][0], abs=1e-5)


@pytest.mark.slow
def test_mixed_run_resumes_exactly(tmp_path, two_sources, run_main):
    """A 2-source mixture stopped after its step-2 checkpoint and resumed gives the losses of a run that never
    stopped; the log names each source's share."""
    common = {
        "data.source": mixture(*two_sources),
        "training.save_steps": 2,
        "strategy_args.strategy_config.async_save_ckpt": False,
    }
    straight = train(tmp_path, "straight", 4, here=run_main, **common)
    assert "data.source[0] a.jsonl: weight 0.8" in straight.stdout
    assert "data.source[1] b.jsonl: weight 0.2" in straight.stdout
    assert "data: steps 1-4 took 32 samples: " in straight.stdout
    train(tmp_path, "resumed", 2, here=run_main, **common)
    assert "resumed from" in train(tmp_path, "resumed", 4, here=run_main, **common).stdout
    expected = [r["loss"] for r in read_metrics(tmp_path / "straight")]
    assert [r["loss"] for r in read_metrics(tmp_path / "resumed")] == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_eval_loss_reaches_tensorboard_and_the_report(tmp_path):
    from fsdp2kit.report import write_report
    from fsdp2kit.train.loggers import TensorBoardLog

    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "loss": 9.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 100.0, "peak_mem_bytes": 1 << 30}
        for s in range(1, 5)
    ]
    for record in records[1::2]:
        record |= {"eval_loss": record["loss"] + 0.5, "eval_tokens": 1000}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = write_report([run])
    assert "eval_loss 5.5000 (last of 2)" in summary and (run / "report" / "loss.png").is_file()
    log = TensorBoardLog(run / "tb", None)
    for record in records:
        log.write(record)
    log.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4] and "train/loss" in events.Tags()["scalars"]


def test_prepare_builds_every_store_a_mixed_run_reads(tmp_path, two_sources):
    """A mixture's entries and the evaluation source each get their token store ahead of the run."""
    a, b = two_sources
    held = write_jsonl(tmp_path / "held.jsonl", corpus_documents()[500:600])
    settings = {"data.source": mixture(a, b), "data.eval_source": held, "data.cache_dir": str(tmp_path)}
    result = run_cli("prepare", DEMO, *set_args(settings), "--show", "1")
    assert result.returncode == 0, result.stderr
    built = [line for line in result.stdout.splitlines() if line.startswith("token store /")]
    assert [line.split(":")[0].rsplit("/", 1)[1].split("-")[0] for line in built] == ["a", "b", "held"]
    assert "data.source[0] a.jsonl: weight 0.8" in result.stdout and "evaluation set: 21 samples" in result.stdout
    assert "--- sample 1 of" in result.stdout
