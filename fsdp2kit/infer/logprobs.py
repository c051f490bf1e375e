"""`fsdp2kit infer` (`fsdp2_infer`): forward-only per-token log-probs of every sample, e.g. an RL reference model.

Sample i goes to data-parallel rank i % (world / ulysses_size); with sequence parallel the ranks of a group each
read a slice of its tokens and add up their partial sums. Every rank runs the same number of forwards (a rank with
fewer samples repeats a dummy batch) because each forward all-gathers parameters from all ranks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.data.dataset import collate, encode_documents, load_documents, load_tokenizer, model_inputs
from fsdp2kit.data.vl import VLEncoder, VLSample, load_conversations
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import UserError
from fsdp2kit.parallel.ulysses import shard_sequence
from fsdp2kit.parallel.vision import shard_vision_batch
from fsdp2kit.train.loggers import phase
from fsdp2kit.train.setup import build_sharded_model


@torch.no_grad()
def sample_logprobs(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], sp_group: dist.ProcessGroup | None = None
) -> tuple[list[float], list[int]]:
    """Per sample: the sum of log p(token_i | tokens_<i) over its target tokens (i >= 1; a conversation's assistant
    turns), and the number of those terms. With sequence
    parallel the batch holds this rank's slice of the tokens, and the sums over the group's slices are added up."""
    logits = model(**model_inputs(batch), use_cache=False).logits.float()  # one pass: a KV cache is wasted memory
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = batch["labels"]
    mask = targets != -100
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    sums, counts = picked.sum(dim=1).double(), mask.sum(dim=1)
    if sp_group is not None:
        dist.all_reduce(sums, group=sp_group)
        dist.all_reduce(counts, group=sp_group)
    return sums.cpu().tolist(), counts.cpu().tolist()


def infer(cfg: JobConfig, runtime: Runtime) -> None:
    if cfg.model.name_or_path.startswith("builtin:") and not cfg.model.allow_random_init:
        raise UserError(
            f"model.name_or_path: {cfg.model.name_or_path} has no trained weights, so infer would score random "
            "weights; give a model folder or checkpoint, or set model.allow_random_init: true"
        )
    with phase(f"loading the model ({cfg.model.name_or_path})", runtime.is_main):
        sharded = build_sharded_model(cfg, runtime, training=False)
    model = sharded.model
    tokenizer = load_tokenizer(sharded.source.tokenizer_path, cfg.model.trust_remote_code)
    vision = sharded.plan.vision_patch
    items: list
    if vision:  # conversations, encoded (images read) batch by batch; scored on their assistant turns
        encoder = VLEncoder.load(sharded.source.tokenizer_path, sharded.source.hf_config, cfg.data.seq_len)
        items = load_conversations(cfg.data)
    else:
        # As the model's users tokenise: default special tokens, no EOS added, no packing, truncated at data.seq_len
        # (a prompt/response record is the prompt's ids followed by the response's).
        with phase(f"tokenising {cfg.data.source}", runtime.is_main):
            documents = load_documents(cfg.data)
            items = [
                torch.tensor(ids[: cfg.data.seq_len])
                for ids, _ in encode_documents(documents, tokenizer, append_eos=False)
            ]
    layout = sharded.layout
    mine = [
        (i, item)
        for i, item in enumerate(items)
        if i % layout.data_parallel_size == layout.data_parallel_rank(runtime.rank) and (vision or len(item) >= 1)
    ]
    size = cfg.infer_batch_size
    rounds = torch.tensor(math.ceil(len(mine) / size))
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    results: list[dict] = []
    for r in range(int(rounds)):
        chunk = mine[r * size : (r + 1) * size]
        if vision:
            samples = [encoder.encode(c) for _, c in chunk] or [
                VLSample(torch.tensor([pad_id] * 2), torch.zeros(2) > 0)
            ]
            batch = encoder.collate(samples, pad_id)
        else:
            batch = collate([ids for _, ids in chunk] or [torch.tensor([pad_id, pad_id])], pad_id)
        batch = {k: v.to(runtime.device) for k, v in batch.items()}
        if sharded.sp_group is not None:
            batch = (shard_vision_batch if vision else shard_sequence)(batch, sharded.sp_group)
        sums, counts = sample_logprobs(model, batch, sharded.sp_group)
        if not chunk:
            continue  # the dummy batch: its forward joined the collectives, its results are no sample's
        for (index, _), total, count in zip(chunk, sums, counts, strict=True):
            results.append(
                {
                    "index": index,
                    "num_tokens": count,
                    "sum_logprob": total,
                    "mean_logprob": total / count if count else None,
                }
            )

    gathered: list[list[dict]] = [[] for _ in range(runtime.world_size)]
    dist.all_gather_object(gathered, results if runtime.rank % layout.ulysses_size == 0 else [])  # once per SP group
    if not runtime.is_main:
        return
    records = sorted((r for part in gathered for r in part), key=lambda r: r["index"])
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
    print(
        f"infer: {len(records)} samples, {tokens} tokens, perplexity {summary['perplexity']:.4f}; "
        f"wrote {out / 'infer.jsonl'}",
        flush=True,
    )
