"""The remove-padding and token-budget case of tests/test_packing.py: RL-shaped batches (left-padded prompts,
right-padded responses), a Strategy whose steps leave the weights where they are (a learning rate of 1e-30) so every
step's gradients are taken at the same weights, and, launched as `python tests/packing_worker.py MODEL_DIR OUT` under
torchrun with 2 ranks, the checks that are about ranks: remove-padding at 2 data-parallel ranks and under Ulysses 2,
and token budgets that give the ranks unequal micro-batch counts. Rank 0 saves what it saw to OUT."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from strategy_case import VOCAB, policy_loss
from torch.distributed.tensor import DTensor

import fsdp2kit

Batch = dict[str, torch.Tensor]
ROWS, LENGTH = 4, 14
BUDGET = 9  # real tokens per micro-batch: about one row of padded_batch's


def padded_batch(seed: int, rows: int = ROWS, length: int = LENGTH) -> Batch:
    """Rows of a prompt left-padded and a response right-padded (mask: zeros, ones, zeros), per-sample advantages,
    per-token weights where token t and t+1 are both real."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, length // 3, (rows,), generator=generator)
    stops = torch.randint(length // 2, length + 1, (rows,), generator=generator)
    positions = torch.arange(length)[None, :]
    mask = ((positions >= starts[:, None]) & (positions < stops[:, None])).long()
    ids = torch.randint(3, VOCAB, (rows, length), generator=generator).masked_fill(mask == 0, 0)
    scored = mask[:, :-1] * mask[:, 1:]
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "advantages": torch.randn(rows, generator=generator),
        "token_weights": torch.rand(rows, length - 1, generator=generator) * scored,
    }


def config(model_dir: str, output_dir: str, remove_padding: bool, ulysses: int = 1) -> dict[str, Any]:
    return {
        "model": {"name_or_path": model_dir, "ulysses_size": ulysses, "remove_padding": remove_padding},
        "training": {
            "learning_rate": 1e-30,  # the weights stay put: each step's gradients are compared at the same weights
            "weight_decay": 0.0,
            "lr_scheduler_type": "constant",
            "max_steps": 10,
            "max_grad_norm": 0.0,
            "output_dir": output_dir,
        },
    }


def step_gradients(strategy: fsdp2kit.Strategy, step: Callable[[], dict]) -> tuple[dict, dict[str, torch.Tensor]]:
    """What `step()` (a train_step) returns and the whole gradients its update saw, by parameter name."""
    names = {id(p): name for name, p in strategy.model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def keep(optimizer: torch.optim.Optimizer, *_: Any) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
                seen[names[id(p)]] = grad.detach().clone()

    assert strategy.optimizer is not None
    handle = strategy.optimizer.register_step_pre_hook(keep)
    try:
        result = step()
    finally:
        handle.remove()
    return result, seen


def policy_loss_with_rows(log_probs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """policy_loss, and the micro-batch's row count as a metric (its mean: rows / real micro-batches)."""
    return (*policy_loss(log_probs, batch), {"rows": float(batch["input_ids"].shape[0])})


def attention_calls_by_documents() -> list[bool | None]:
    """Wrap the CPU's document attention with a record of each call: whether it attended by documents (None: no
    mask at all, one document a stream, plain causal)."""
    from fsdp2kit.parallel import document_sdpa

    calls: list[bool | None] = []
    attend = document_sdpa.document_sdpa_attention

    def recorded(module: Any, query: Any, key: Any, value: Any, mask: Any, **kwargs: Any) -> Any:
        calls.append(None if mask is None else getattr(mask, "document_spans", None) is not None)
        return attend(module, query, key, value, mask, **kwargs)

    document_sdpa.document_sdpa_attention = recorded  # type: ignore[assignment]
    return calls


def run(model_dir: str, out: str) -> None:
    by_documents = attention_calls_by_documents()
    strategy = fsdp2kit.Strategy.from_config(config(model_dir, out + ".dp", True))
    rank = dist.get_rank()
    whole = padded_batch(0)
    mine = {k: v[rank * 2 : rank * 2 + 2] for k, v in whole.items()}
    seen: dict[str, Any] = {"dp_attention": strategy.model.config._attn_implementation, "by_documents": by_documents}
    seen["dp_log_probs"] = strategy.forward_step(mine)["log_probs"]
    seen["dp"] = step_gradients(strategy, lambda: strategy.train_step([mine], policy_loss))
    # Unequal token totals: rank 0's rows need more micro-batches within the budget than rank 1's (rank 1 adds
    # empty ones); the step still minimises the global sum(loss_sum) / sum(weight).
    budgeted = [whole, padded_batch(1, rows=2)][rank]
    seen["budget_log_probs"] = strategy.forward_step(budgeted, max_tokens=BUDGET)["log_probs"]
    seen["budget"] = step_gradients(
        strategy, lambda: strategy.train_step([budgeted], policy_loss_with_rows, max_tokens=BUDGET)
    )
    strategy = fsdp2kit.Strategy.from_config(config(model_dir, out + ".sp", True, ulysses=2))
    seen["sp_log_probs"] = strategy.forward_step(whole, entropy=True)
    seen["sp"] = step_gradients(strategy, lambda: strategy.train_step([whole], policy_loss))
    if rank == 0:
        torch.save(seen, out)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2])
