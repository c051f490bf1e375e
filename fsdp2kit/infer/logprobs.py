"""`fsdp2kit infer` (`fsdp2_infer`): forward-only per-token log-probs of every sample, e.g. an RL reference model.

Sample i goes to data-parallel rank i % (world / (ulysses_size x context_parallel_size)); with sequence or context
parallel the ranks of a sequence group each read a share of its tokens, gathered back in the sequence's order. Every
rank runs the same number of forwards (a rank with fewer samples repeats a dummy batch) because each forward
all-gathers parameters from all ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import UserError
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.models.build import check_data_fits
from fsdp2kit.strategy import INFER_COMMAND, Strategy
from fsdp2kit.train.loggers import phase


@torch.no_grad()
def sample_logprobs(strategy: Strategy, batch: dict[str, torch.Tensor]) -> tuple[list[float], list[int]]:
    """Per sample of a shifted batch: the sum of log p(token_i | tokens_<i) over its target tokens (i >= 1; a
    conversation's assistant turns), and the number of those terms (`Strategy.token_logprobs`, in chunks; under
    sequence parallel gathered over the group)."""
    log_probs, _ = strategy.token_logprobs(batch)
    counts = (batch["labels"] != IGNORE_INDEX).sum(dim=1)
    return log_probs.double().sum(dim=1).cpu().tolist(), counts.cpu().tolist()


def infer(cfg: JobConfig, runtime: Runtime) -> None:
    if cfg.model.name_or_path.startswith("builtin:") and not cfg.model.allow_random_init:
        raise UserError(
            f"model.name_or_path: {cfg.model.name_or_path} has no trained weights, so infer would score random "
            "weights; give a model folder or checkpoint, or set model.allow_random_init: true"
        )
    with phase(f"loading the model ({cfg.model.name_or_path})", runtime.is_main):
        strategy = Strategy(cfg, runtime, training=False)
    strategy.head.require_log_probs(INFER_COMMAND)
    sharded, tokenizer = strategy.sharded, strategy.tokenizer
    check_data_fits(sharded.source.hf_config, cfg.data.seq_len, tokenizer)
    layout = sharded.layout
    first, step = layout.data_parallel_rank(runtime.rank), layout.data_parallel_size
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with phase(f"{sharded.variant.modality.data_phase} {cfg.data.source}", runtime.is_main):
        source = sharded.variant.scoring_source(cfg.data, tokenizer, sharded.source, pad_id)
    without_terms, scored = source.indices(first, step)
    results: list[dict] = [_record(i, 0.0, 0, source.truncated(i)) for i in without_terms]
    size = cfg.infer_batch_size
    rounds = torch.tensor(math.ceil(len(scored) / size))
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    for r in range(int(rounds)):
        chunk = scored[r * size : (r + 1) * size]
        batch = {k: v.to(runtime.device) for k, v in source.batch_of(chunk).items()}
        sums, counts = sample_logprobs(strategy, batch)
        if not chunk:
            continue  # the dummy batch: its forward joined the collectives, its results are no sample's
        results += [
            _record(index, total, count, source.truncated(index))
            for index, total, count in zip(chunk, sums, counts, strict=True)
        ]

    gathered: list[list[dict]] = [[] for _ in range(runtime.world_size)]
    dist.all_gather_object(gathered, results if layout.answers_for_its_data(runtime.rank) else [])  # once per group
    if not runtime.is_main:
        return
    _write_records(sorted((r for part in gathered for r in part), key=lambda r: r["index"]), cfg)


def _write_records(records: list[dict], cfg: JobConfig) -> None:
    """infer.jsonl (the records, then a summary) and what they add up to, in a line or two."""
    tokens = sum(r["num_tokens"] for r in records)
    total = sum(r["sum_logprob"] for r in records)
    out = Path(cfg.training.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "summary": True,
        "num_samples": len(records),
        "num_tokens": tokens,
        "mean_logprob": total / tokens if tokens else None,
        "perplexity": math.exp(-total / tokens) if tokens else None,
    }
    with (out / "infer.jsonl").open("w") as handle:
        for record in records + [summary]:
            handle.write(json.dumps(record) + "\n")
    perplexity = "n/a (no sample has two tokens)" if not tokens else f"{summary['perplexity']:.4f}"
    print(
        f"infer: {len(records)} samples, {tokens} tokens, perplexity {perplexity}; wrote {out / 'infer.jsonl'}",
        flush=True,
    )
    cut = sum(r["truncated"] for r in records)
    if cut:
        print(
            f"infer: {cut} of {len(records)} samples are longer than data.seq_len = {cfg.data.seq_len} and were scored "
            'on their first part only ("truncated": true in infer.jsonl); raise data.seq_len to score them whole',
            flush=True,
        )


def _record(index: int, sum_logprob: float, num_tokens: int, truncated: bool) -> dict:
    return {
        "index": index,
        "num_tokens": num_tokens,
        "sum_logprob": sum_logprob,
        "mean_logprob": sum_logprob / num_tokens if num_tokens else None,
        "truncated": truncated,
    }
