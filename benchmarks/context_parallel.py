"""The longest sequence each sequence layout trains at a fixed per-rank memory budget (issue 48): no sequence
parallel, Ulysses k, context parallel c, and Ulysses x CP, on the same 4 CPU ranks (gloo), side by side in one run.

Per layout, one training step of one sample of T tokens per sequence group, T doubled from --start while the
tracked per-rank peak of the step (torch's FSDPMemTracker through `training.track_memory`'s StepMemory: live tensor
bytes, the only honest figure on CPU) stays within --budget-mib; the first T past it ends the layout. Beside it, the
time of one untracked step at each T, and the attention work per rank: the causal (query, key) pairs of the queries
the rank attends for (the index maps `shard_sequence` recorded, the ones the attention wrapper's mask is built
from) times the heads it attends with (heads / k under Ulysses), with the ratio of the busiest rank to the idlest.
Every layout runs with sdpa (the default) and again with eager attention (see ATTENTIONS).

Prints one JSON object. Run: .venv/bin/python benchmarks/context_parallel.py [--budget-mib 64] [--start 512]
[--sliding-window W --attentions sdpa]: with a window, the same shape as a Mistral whose layers attend to the W
tokens up to each (context parallel's banded tiles, parallel/context_attention.py: `window_tiles`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import child_env, model_folder

REPO = Path(__file__).resolve().parent.parent
RANKS = 4
# A small Llama whose activations grow with T: 2 layers of 128 wide, 4 heads (2 key/value heads), a 256-token
# vocabulary with the loss in chunks of 256 tokens, so that the logits do not dominate.
SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 344,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 1 << 16,
}
# sdpa (the default): unmasked causal attention runs a flash kernel that keeps no [T, T] scores, and so does context
# parallel's plain causal path (parallel/context_attention.py: the same kernel block by block, no mask; a masked sdpa
# would run the math kernel on CPU, which keeps them); eager keeps them in every layout.
ATTENTIONS = ("sdpa", "eager")
# (name, ulysses_size, context_parallel_size)
LAYOUTS = [("no SP", 1, 1), ("Ulysses 2", 2, 1), ("Ulysses 4", 4, 1), ("CP 2", 1, 2), ("CP 4", 1, 4)]
LAYOUTS += [("Ulysses 2 x CP 2", 2, 2)]


def strategy_config(folder: str, attention: str, ulysses: int, context: int, out: str) -> dict[str, Any]:
    return {
        "model": {
            "name_or_path": folder,
            "attn_implementation": attention,
            "dtype": "fp32",
            "ulysses_size": ulysses,
            "context_parallel_size": context,
        },
        "training": {
            "learning_rate": 1e-3,
            "max_steps": 100,
            "lr_scheduler_type": "constant",
            "loss_chunk_tokens": 256,
            "output_dir": out,
        },
    }


def attention_work(strategy: Any, length: int, ulysses: int) -> int:
    """This rank's causal (query, key) pairs times its heads, from the index maps of the micro-batch cut last; under
    a sliding window only the pairs less than the window apart."""
    import torch

    from fsdp2kit.parallel.sequence_layout import token_indices

    group = strategy.sharded.sp_group
    indices = token_indices(group) if group is not None else None
    queries, keys = indices if indices is not None else (torch.arange(length),) * 2
    distance = queries[:, None] - keys[None, :]
    window = getattr(strategy.model.config, "sliding_window", None) or length
    pairs = int(((distance >= 0) & (distance < window)).sum())
    return pairs * strategy.model.config.num_attention_heads // ulysses


def measure_layout(
    folder: str, attention: str, name: str, ulysses: int, context: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Doubling T from --start: the tracked peak, the step time and the attention work of each T, until the peak
    passes the budget (or T reaches --max-length)."""
    import torch
    import torch.distributed as dist

    import fsdp2kit
    from fsdp2kit.train.memory import StepMemory

    strategy = fsdp2kit.Strategy.from_config(strategy_config(folder, attention, ulysses, context, args.out))
    sequence = ulysses * context
    sample = dist.get_rank() // sequence  # the ranks of a sequence group train the same sample

    def batch(length: int) -> list[dict[str, torch.Tensor]]:
        generator = torch.Generator().manual_seed(length + sample)
        return [{"input_ids": torch.randint(3, SHAPE["vocab_size"], (1, length), generator=generator)}]

    strategy.train_step(batch(args.start))  # the optimizer's states exist from here on, as in any later step
    rows, budget = [], args.budget_mib * 2**20
    length = args.start
    while length <= args.max_length:
        memory = StepMemory(strategy.model, strategy.optimizer, torch.device("cpu"), True)
        with memory.step(batch(length)):
            strategy.train_step(batch(length))
        peak = torch.tensor([memory.peak.get("total", 0)])
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        work = [0] * dist.get_world_size()
        dist.all_gather_object(work, attention_work(strategy, length, ulysses))
        dist.barrier()
        start = time.perf_counter()
        strategy.train_step(batch(length))
        dist.barrier()
        rows.append(
            {
                "seq_len": length,
                "peak_mib": round(int(peak) / 2**20, 2),
                "step_s": round(time.perf_counter() - start, 3),
                "attention_pairs_per_rank": work,
                "attention_balance": round(max(work) / min(work), 4),
            }
        )
        if int(peak) > budget:
            break
        length *= 2
    within = [row["seq_len"] for row in rows if row["peak_mib"] <= args.budget_mib]
    return {
        "layout": name,
        "attention": attention,
        "ulysses_size": ulysses,
        "context_parallel_size": context,
        "longest_seq_len": max(within) if within else None,
        "steps": rows,
    }


def worker(spec: Path) -> None:
    """One rank: every layout in turn, the results written by rank 0 to the spec's `result`."""
    import torch.distributed as dist

    args = argparse.Namespace(**json.loads(spec.read_text()))
    results = [
        measure_layout(args.folder, attention, *layout, args) for attention in args.attentions for layout in LAYOUTS
    ]
    if dist.get_rank() == 0:
        Path(args.result).write_text(json.dumps(results))


def main() -> None:
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):  # a rank, launched below (torchrun reads its options)
        worker(Path(sys.argv[1]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget-mib", type=float, default=64.0, help="tracked per-rank step peak allowed")
    parser.add_argument("--start", type=int, default=512, help="the first sequence length")
    parser.add_argument("--max-length", type=int, default=16384)
    parser.add_argument("--sliding-window", type=int, help="a Mistral of the same shape with this sliding window")
    parser.add_argument("--attentions", nargs="+", choices=ATTENTIONS, default=list(ATTENTIONS))
    args = parser.parse_args()
    shape = SHAPE if args.sliding_window is None else {**SHAPE, "model_type": "mistral"}
    shape |= {"sliding_window": args.sliding_window} if args.sliding_window is not None else {}
    sys.path.insert(0, str(REPO))
    from fsdp2kit.distributed import free_port

    with tempfile.TemporaryDirectory(prefix="fsdp2kit-cp-") as workdir:
        folder = model_folder(Path(workdir), shape, "small")
        result, spec = Path(workdir) / "result.json", Path(workdir) / "spec.json"
        paths = {"folder": str(folder), "out": f"{workdir}/run", "result": str(result)}
        spec.write_text(json.dumps({**vars(args), **paths}))
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--master-port"]
        command += [str(free_port()), __file__, str(spec)]
        began = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True)
        if done.returncode:
            first = done.stderr.find("Traceback")  # a rank's, before the launcher's own
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[max(first, 0) :][:4000]}")
        layouts = json.loads(result.read_text())
    print(
        json.dumps(
            {
                "benchmark": "context_parallel",
                "ranks": RANKS,
                "model": shape,
                "dtype": "fp32",
                "budget_mib_per_rank": args.budget_mib,
                **{attention: longest(layouts, attention) for attention in args.attentions},
                "layouts": layouts,
                "wall_s": round(time.perf_counter() - began, 1),
            }
        )
    )


def longest(layouts: list[dict[str, Any]], attention: str) -> dict[str, Any]:
    """The longest sequence each layout trained within the budget with `attention`, and its ratio to no SP's."""
    rows = {row["layout"]: row["longest_seq_len"] for row in layouts if row["attention"] == attention}
    no_sp = rows["no SP"]
    ratios = {name: round((length or 0) / no_sp, 2) if no_sp else None for name, length in rows.items()}
    return {"longest_seq_len": rows, "longest_vs_no_sp": ratios}


if __name__ == "__main__":
    main()
