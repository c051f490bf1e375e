"""One rank of the MoE-family runs of tests/test_moe_families.py, launched as `python tests/moe_families_worker.py
RUNS.json` under torchrun's environment (or called in-process by the test, a world of one). Each run of the JSON list
loads a folder written by transformers' `save_pretrained` through `fsdp2kit.Strategy`, trains `steps` steps of
next-token cross-entropy (router auxiliary loss included) on this rank's share of seeded global micro-batches, then
scores a probe batch and (`export`) exports the model; rank 0 saves the losses, gradient norms, the probe's log-probs
and the `full_weights`. Expert parallelism (`ep`, `efsdp`, tests/test_expert_parallel.py) adds: `packed` documents,
`forced` routing (every token of a Qwen3-MoE to experts 0 and 1: the ranks holding the others receive nothing),
`ragged` micro-batches (every other one shorter: ranks exchange different token counts), other `strategy` keys, a
checkpoint saved after step `save_at` and a run that `resume`s from one. Context parallel (`cp`,
tests/test_context_parallel.py) adds: a caller's `loss_fn` (`caller_loss`), the log-probs of a left-padded probe,
other `model` and `training` keys (recompute, LoRA, the chunked loss), and the count of attention calls.
`router_only` trains through a caller's loss_fn (the RL adapters' path) whose own loss has no gradient: what moves is
the router loss alone. `lora`: the run's model.lora; `training: {optimizer: muon}`: each rank's orthogonalised
matrices are saved (tests/test_muon.py)."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
import torch.distributed as dist

import fsdp2kit

LENGTH, ROWS, VOCAB = 16, 2, 64


def micro_batches(
    step: int, count: int, ragged: bool = False, packed: bool | str = False
) -> list[dict[str, torch.Tensor]]:
    """`count` micro-batches of step `step` (step -1: the probe), the same in every process, the last row of each
    right-padded: the router loss leaves padding out. `ragged`: every other micro-batch 4 tokens shorter; `packed`:
    two documents a row (their positions count from 0 again), unpadded; "mixed": micro-batches 2-3 of every 4 packed,
    0-1 right-padded (so that each of 2 data-parallel ranks, taking every other one, gets one of each); "left": RL's
    rows instead, the first left-padded by 3 + index % 2 tokens, the last right-padded as above."""
    generator = torch.Generator().manual_seed(2000 + step)
    batches = []
    for index in range(count):
        length = LENGTH - 4 * (ragged and index % 2)
        mask = torch.ones(ROWS, length, dtype=torch.long)
        mask[-1, length - 5 :] = 0
        if packed == "left":
            mask[0, : 3 + index % 2] = 0
        ids = torch.randint(3, VOCAB, (ROWS, length), generator=generator).masked_fill(mask == 0, 2)
        if packed is True or (packed == "mixed" and index // 2 % 2):
            positions = (torch.arange(length) % (length // 2)).expand(ROWS, length)
            batches.append({"input_ids": ids.masked_fill(mask == 0, 5), "position_ids": positions})
        else:
            batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def next_token_loss(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A caller's loss_fn: the summed negative log-probs of the real next tokens, and their count."""
    mask = batch.get("attention_mask")
    real = torch.ones_like(log_probs) if mask is None else (mask[:, :-1] * mask[:, 1:]).to(log_probs.dtype)
    return -(log_probs * real).sum(), real.sum()


def left_padded_probe() -> dict[str, torch.Tensor]:
    """RL's layout: prompts left-padded by 3 and 5 tokens, the first response right-padded by 2, LENGTH - 1 tokens
    (not a multiple of any cut: the cut pads it). The padding is eos (1), as RL's rollouts pad: pad_token_id's
    embedding row is 0, which keeps a padding token's values 0 in every layer, whatever it attends to."""
    ids = torch.randint(3, VOCAB, (ROWS, LENGTH - 1), generator=torch.Generator().manual_seed(7))
    mask = torch.ones(ROWS, LENGTH - 1, dtype=torch.long)
    mask[0, :3], mask[1, :5], mask[0, -2:] = 0, 0, 0
    return {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}


def router_only(log_probs: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss_fn whose own term is 0 with autograd, weighted by the batch's targets: the step's gradient is the
    router loss's alone."""
    return (log_probs * 0).sum(), batch["attention_mask"][:, 1:].sum().float()


def force_routing(model: torch.nn.Module) -> None:
    """Every token of a Qwen3-MoE to experts 0 and 1, weighted by the router's own probabilities (it still learns)."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    def route(router: torch.nn.Module, args: Any, output: Any) -> Any:
        logits = output[0]
        probabilities = logits.float().softmax(dim=-1)[:, :2]
        weights = probabilities / probabilities.sum(-1, keepdim=True)
        return logits, weights.to(logits.dtype), torch.tensor([[0, 1]]).expand(len(logits), 2)

    for module in model.modules():
        if isinstance(module, Qwen3MoeTopKRouter):
            module.register_forward_hook(route)


def count_attention_calls(model: torch.nn.Module) -> list[int]:
    """Wrap the attention function the model is switched to with a counter of its calls (recompute calls it again in
    backward); returns the counter, [calls]. A model attending with its own eager function (registered nowhere)
    stays uncounted: [0]."""
    from transformers import AttentionInterface

    name = model.config.get_text_config()._attn_implementation
    calls = [0]
    attention = AttentionInterface._global_mapping.get(name)
    if attention is None:
        return calls

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return attention(*args, **kwargs)

    AttentionInterface.register(name, counted)
    return calls


def count_calls(module: Any, name: str) -> list[int]:
    """Wrap `module.name` with a counter of its calls; returns the counter, [calls]. Counted: context parallel's
    blockwise causal attention (its plain causal path) and the dense masks made over the sequence."""
    function = getattr(module, name)
    calls = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return function(*args, **kwargs)

    setattr(module, name, counted)
    return calls


def config(run: dict[str, Any]) -> dict[str, Any]:
    per_expert = run["per_expert"]
    return {
        "model": {
            "name_or_path": run["folder"],
            "ulysses_size": run["ulysses"],
            "context_parallel_size": run.get("cp", 1),
            "tensor_parallel_size": run.get("tp", 1),
            "dtype": "fp32",
            **({"lora": run["lora"]} if run.get("lora") else {}),
            **run.get("model", {}),
        },
        "strategy_args": {
            "strategy_config": {
                "wrap_policy": {"moe_experts": [run["experts"]] if run["experts"] else []},
                "apply_expert_patch": per_expert,
                "ep_size": run.get("ep", 1),
                "efsdp_size": run.get("efsdp", 1),
                "moe_use_grouped_mm": run.get("grouped_mm"),
                **run.get("strategy", {}),
            }
        },
        "training": {
            "learning_rate": 1e-3,
            "lr_scheduler_type": "constant",
            "max_steps": run["steps"],
            "max_grad_norm": 1.0,
            "output_dir": run["out"] + ".run",
            **run.get("training", {}),
        },
    }


def labelled(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A right-padded micro-batch as the `train` command's: labels shifted, IGNORE_INDEX where there is no target."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    labels = torch.full_like(ids, -100)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return {**batch, "labels": labels}


def assembled_blocks(strategy: Any, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every rank's `sharded_weights` blocks put together where they say they sit (NaN where no rank's block lands):
    on rank 0, the model as a rollout engine would assemble it without a gather."""
    everyone: list = [None] * dist.get_world_size()
    mine = [(s.name, s.local, s.offset) for s in strategy.sharded_weights() if s.contributes]
    dist.all_gather_object(everyone, mine)
    whole = {name: torch.full_like(tensor, float("nan")) for name, tensor in like.items()}
    for name, local, offset in (block for blocks in everyone for block in blocks):
        whole[name][tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))] = local
    return whole


def train(run: dict[str, Any]) -> None:
    strategy = fsdp2kit.Strategy.from_config(config(run))
    if run.get("forced"):
        force_routing(strategy.model)
    sequence = run["ulysses"] * run.get("cp", 1) * run.get("tp", 1)
    data_parallel = dist.get_world_size() // sequence
    rank = dist.get_rank() // sequence  # the ranks of a sequence (and tensor-parallel) group train the same ones
    first = strategy.load_checkpoint(run["resume"])["step"] if run.get("resume") else 0
    from fsdp2kit.parallel import context_attention, sequence_masks

    attention_calls = count_attention_calls(strategy.model)
    blockwise_calls = count_calls(context_attention, "blockwise_causal_attention")
    dense_masks = count_calls(sequence_masks, "_dense_mask")
    losses, grad_norms, orthogonalised = [], [], []
    for step in range(first, run["steps"]):
        everyone = micro_batches(
            step, run["accumulation"] * data_parallel, run.get("ragged", False), run.get("packed", False)
        )
        mine = everyone[rank::data_parallel]
        loss_fn = next_token_loss if run.get("caller_loss") else router_only if run.get("router_only") else None
        result = strategy.train_step(mine, loss_fn)
        losses.append(result["loss"])
        grad_norms.append(result["grad_norm"])
        orthogonalised.append(list(getattr(strategy.optimizer, "orthogonalised", [])))
        if step + 1 == run.get("save_at"):
            strategy.save_checkpoint(run["checkpoint"])
    trained_attention_calls, trained_blockwise_calls, trained_dense_masks = (
        attention_calls[0],
        blockwise_calls[0],
        dense_masks[0],
    )
    log_probs = strategy.forward_step(micro_batches(-1, 1)[0])["log_probs"]
    evaluated = strategy.evaluate([labelled(micro_batches(-1, 1)[0])])  # every data-parallel rank the same batch
    counters = (blockwise_calls, dense_masks, attention_calls)
    before_left = [counter[0] for counter in counters]
    left_log_probs = strategy.forward_step(left_padded_probe())["log_probs"] if run.get("left_padded") else None
    left_calls = [counter[0] - before for counter, before in zip(counters, before_left, strict=True)]
    weights = {name: tensor.clone() for name, tensor in strategy.full_weights(bucket_bytes=1 << 14)}
    blocks = assembled_blocks(strategy, weights) if run.get("sharded_weights") else None
    ranks_orthogonalised: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks_orthogonalised, orthogonalised)
    if run["export"]:
        strategy.export_hf(run["out"] + ".hf")
    if dist.get_rank() == 0:
        torch.save(
            {
                "losses": losses,
                "grad_norms": grad_norms,
                "log_probs": log_probs,
                "left_log_probs": left_log_probs,
                "data_parallel_size": strategy.data_parallel_size(),
                "attention": strategy.model.config.get_text_config()._attn_implementation,
                "attention_calls": trained_attention_calls,  # in the train steps, every layer's every call
                "blockwise_calls": trained_blockwise_calls,  # of them, those CP attended block by block
                "dense_masks": trained_dense_masks,  # the dense [B, 1, queries, keys] masks made for them
                "left_calls": left_calls,  # the left-padded probe's: blockwise calls, dense masks, attention calls
                "chunk_tokens": strategy.chunk_tokens,
                "trained": [name for name, p in strategy.model.named_parameters() if p.requires_grad],
                "weights": weights,
                "loss_scale": strategy.scaler.scale,
                "orthogonalised": ranks_orthogonalised,
                "sharded_weights": blocks,
                "eval": (evaluated.loss, evaluated.tokens),
            },
            run["out"],
        )


if __name__ == "__main__":
    for run in json.loads(open(sys.argv[1]).read()):
        train(run)
