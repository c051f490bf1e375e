"""benchmarks/peers.py's summary (in-process, no framework): two sides whose log-probs or losses disagree beyond
1e-4 computed different things, so their speed ratios are void; agreeing sides get fsdp2kit / peer ratios of
medians of rank 0's calls and of the largest rank's RSS."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("peers", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rank(cpu: list[float], rss: int, log_probs: list, losses: dict) -> dict:
    return {
        "calls": {"train_step": [{"wall_s": 2 * c, "cpu_s": c} for c in cpu]},
        "peak_rss_bytes": rss,
        "rss_after_setup_bytes": rss // 2,
        "log_probs": log_probs,
        "losses": losses,
    }


def launches(cpu: list[float], rss: list[int], shift: float = 0.0, losses: dict | None = None) -> list[list[dict]]:
    """Two launches of two ranks; log-probs moved by `shift`."""
    losses = {"actor/pg_loss": [0.5, 0.25]} if losses is None else losses
    rows = [[-1.0 + shift, -2.0], [-0.5, -3.0 - shift]]
    return [[rank(cpu, r, rows, losses) for r in rss] for _ in range(2)]


def test_agreeing_sides_get_ratios_of_medians(peers):
    summary = peers.summarise(
        "roll",
        {"fsdp2kit": launches([1.0, 3.0, 2.0], [90, 100]), "roll": launches([4.0, 4.0, 5.0], [80, 200], shift=5e-5)},
    )
    assert summary["agreement"]["void"] is None
    assert summary["agreement"]["log_probs_max_abs_diff"] == pytest.approx(5e-5)
    call = summary["calls"]["train_step"]
    assert call["fsdp2kit"]["cpu_s"] == 2.0 and call["roll"]["cpu_s"] == 4.0 and call["fsdp2kit"]["samples"] == 6
    assert call["ratio_cpu"] == pytest.approx(0.5) and call["ratio_wall"] == pytest.approx(0.5)
    assert summary["memory"]["peak_rss_bytes"]["ratio_largest_rank"] == pytest.approx(0.5)  # 100 / 200
    table = peers.headline({"roll": {"2": summary}})
    assert table == {"roll @2": {"train_step cpu": pytest.approx(0.5), "peak_rss": pytest.approx(0.5)}}
    assert "| roll | 2 | train_step | 2.00 | 4.00 | 0.500 |" in peers.table({"roll": {"2": summary}})


@pytest.mark.parametrize(
    "theirs",
    [
        {"shift": 2e-4},  # log-probs apart
        {"losses": {"actor/pg_loss": [0.5, 0.2502]}},  # a loss apart
        {"losses": {"actor/pg_loss": [0.5]}},  # a loss missing
        {"losses": {"actor/kl_loss": [0.5, 0.25]}},  # another loss
    ],
)
def test_disagreeing_sides_are_void(peers, theirs):
    summary = peers.summarise(
        "fsdp2", {"fsdp2kit": launches([1.0], [1, 1]), "fsdp2": launches([2.0], [1, 1], **theirs)}
    )
    assert summary["agreement"]["void"] and "different computations" in summary["agreement"]["void"]
    assert summary["calls"]["train_step"]["ratio_cpu"] is None and summary["calls"]["train_step"]["ratio_wall"] is None
    assert summary["memory"]["peak_rss_bytes"]["ratio_largest_rank"] is None
    assert summary["calls"]["train_step"]["fsdp2kit"]["cpu_s"] == 1.0  # the medians stay, for the record
    assert "| void |" in peers.table({"verl": {"1": summary}})
    assert peers.largest_difference([1.0], [1.0, 2.0]) == math.inf


def test_the_trainer_arm_deals_rows_to_ranks_as_accelerates_data_loader(monkeypatch):
    """fsdp2kit's side of the Trainer arm takes, per rank and optimizer step, the rows the Trainer's data loader
    gives that rank (Accelerate's BatchSamplerShard over a sequential sampler), and no target lies in a prompt or
    the padding."""
    import torch
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    monkeypatch.syspath_prepend(str(BENCH.parent))
    trainer_arm = importlib.import_module("peers_trainer")
    rows = trainer_arm.sft_rows(16, 64, 1000)
    for world in (1, 2):
        accumulation = 8 // (2 * world)
        for rank in range(world):
            batches = BatchSampler(SequentialSampler(range(16)), 2, drop_last=False)
            dealt = list(BatchSamplerShard(batches, num_processes=world, process_index=rank))
            for step in range(2):
                ours = trainer_arm.rank_micro_batches(rows, step, rank, world, 2, accumulation)
                theirs = dealt[step * accumulation : (step + 1) * accumulation]
                assert len(ours) == len(theirs) == accumulation
                for batch, indices in zip(ours, theirs, strict=True):
                    assert torch.equal(batch["labels"], rows["labels"][indices])
    targets = rows["labels"] != -100
    assert targets.any() and not (targets & (rows["attention_mask"] == 0)).any()
    assert not targets[:, : 64 // 16].any()  # every prompt has at least length/16 tokens
