"""Chunked loss (`training.loss_chunk_tokens`) on a model with Qwen's 152k vocabulary: a training step's tracked peak,
its losses and its speed, chunked (auto: 1024 tokens) against the whole logits at once (0), and what `fsdp2kit plan`
predicts for each. The model is the built-in tiny Qwen3 with a 151936-token vocabulary (2 layers, hidden 256), seq
2048, one sample per step, fp32, one rank: the logits dominate its step, as they do for a real Qwen at long context.

Timing runs (without the memory tracker, which slows every op) alternate between the two settings, `--repeats`
times; tokens/s is the median over the steps after the first of every run of a setting.
Prints one JSON object. Run: .venv/bin/python benchmarks/chunked_loss.py [--steps 4] [--repeats 2]

`--shape llama-1b` trains issue 31's Llama-3.2-1B shape instead (hidden 2048, 16 layers, GQA 32/8, untied 128256-token
vocabulary; bf16 compute, fp32 reduce; seq 2048 x 4): on a GPU, the chunked step's time and CUDA peak beside the
unchunked one's (`--nproc` ranks). `--head` times the LM head and its loss alone, forward and backward, on this
machine's device (CUDA where there is one): the whole logits as transformers computes them (float32 cross-entropy),
fsdp2kit's chunked loss at `auto` (chunks sized by memory) and at the former fixed 1024 tokens, and liger-kernel's
fused linear cross-entropy where it is installed (CUDA); medians of `--repeats` runs, peaks from the CUDA allocator.
`--out FILE` writes the JSON there as well (e.g. docs/bench/gpu_chunked_loss.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness import child_env

REPO = Path(__file__).resolve().parent.parent
MODEL = [
    "model.name_or_path=builtin:tiny-qwen3",
    "model.config={vocab_size: 151936, num_hidden_layers: 2, hidden_size: 256}",
    "data.seq_len=2048",
    "data.source=builtin:corpus",
    "training.per_device_train_batch_size=1",
    "training.gradient_accumulation_steps=1",
]
SETTINGS = {"whole": "0", "chunked": "auto"}
# Issue 31's H100 shape (benchmarks/gpu_suite.sh): fresh weights, speed and memory only.
LLAMA_1B = [
    "model.name_or_path=builtin:tiny-llama",
    "model.dtype=bf16",
    "model.config={vocab_size: 128256, tie_word_embeddings: false, hidden_size: 2048, intermediate_size: 8192, "
    "num_hidden_layers: 16, num_attention_heads: 32, num_key_value_heads: 8, max_position_embeddings: 8192}",
    "strategy_args.strategy_config.param_dtype=bf16",
    "strategy_args.strategy_config.reduce_dtype=fp32",
    "data.seq_len=2048",
    "data.source=builtin:corpus",
    "training.per_device_train_batch_size=4",
    "training.gradient_accumulation_steps=1",
]
SHAPES = {"tiny-qwen3-152k": MODEL, "llama-1b": LLAMA_1B}


def fsdp2kit(command: str, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "fsdp2kit", command, "examples/demo.yaml", *extra]
    args += [a for item in overrides for a in ("--set", item)]
    env = child_env()
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def train(model: list[str], chunk: str, steps: int, out: Path, track: bool, nproc: int) -> list[dict]:
    overrides = [*model, f"training.loss_chunk_tokens={chunk}", f"training.max_steps={steps}"]
    overrides += [f"training.track_memory={str(track).lower()}", "training.export_hf=false", "training.save_steps=0"]
    overrides += ["training.report_to=[]", "training.resume=never", f"training.output_dir={out}"]
    fsdp2kit("train", overrides, "--nproc", str(nproc))
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def steps_side_by_side(model: list[str], steps: int, repeats: int, nproc: int) -> dict:
    """Training steps with the whole logits and chunked, alternately: tokens/s (median of the steps after the first
    of every run), step seconds, peaks (tracked on a CPU, the CUDA allocator's on a GPU), plan and losses."""
    import torch

    track = not torch.cuda.is_available()  # the tracker slows every op; CUDA reports its allocator's peak anyway
    result: dict[str, dict] = {}
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for name, chunk in SETTINGS.items():
            tracked = train(model, chunk, 2, Path(tmp) / f"{name}-tracked", track, nproc)
            planned = fsdp2kit("plan", [*model, f"training.loss_chunk_tokens={chunk}"], "--json", "--nproc", str(nproc))
            result[name] = {
                "loss_chunk_tokens": chunk,
                "tracked_peak_bytes": max(r["peak_mem_bytes"] for r in tracked),
                "planned_peak_bytes": json.loads(planned.stdout.strip().splitlines()[-1])["peak_bytes"],
                "losses": [r["loss"] for r in tracked],
            }
        for repeat in range(repeats):
            for name, chunk in SETTINGS.items():
                records = train(model, chunk, steps, Path(tmp) / f"{name}-{repeat}", False, nproc)
                speeds[name] += [r["tokens_per_s"] for r in records[1:]]
    for name in SETTINGS:
        result[name]["tokens_per_s"] = statistics.median(speeds[name])
        result[name]["plan_error"] = result[name]["planned_peak_bytes"] / result[name]["tracked_peak_bytes"] - 1
    whole, chunked = result["whole"], result["chunked"]
    return {
        **result,
        "peak_ratio": chunked["tracked_peak_bytes"] / whole["tracked_peak_bytes"],
        "speed_ratio": chunked["tokens_per_s"] / whole["tokens_per_s"],
        "step_time_ratio": whole["tokens_per_s"] / chunked["tokens_per_s"],
        "max_loss_diff": max(abs(a - b) for a, b in zip(whole["losses"], chunked["losses"], strict=True)),
    }


def head_side_by_side(tokens: int, hidden: int, vocab: int, repeats: int) -> dict:
    """The LM head and its summed cross-entropy alone, forward and backward, each way on this machine's device
    (bf16 on CUDA, fp32 on a CPU): milliseconds (median), peak bytes above the inputs (CUDA), and each against the
    whole logits."""
    import torch

    from fsdp2kit.parallel.token_logprobs import chunk_tokens

    cuda = torch.cuda.is_available()
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    generator = torch.Generator().manual_seed(0)
    hidden_states = torch.randn(tokens, hidden, generator=generator).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden, generator=generator) * hidden**-0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
    ways = _head_ways(chunk_tokens("auto", vocab) or tokens, cuda)
    rows = {name: _time_head(way, hidden_states, weight, targets, repeats) for name, way in ways.items()}
    whole = rows["whole"]
    for row in rows.values():
        row["time_ratio"] = row["ms"] / whole["ms"]
        if whole.get("peak_bytes"):
            row["peak_ratio"] = row["peak_bytes"] / whole["peak_bytes"]
    shape = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "dtype": str(dtype), "device": str(device)}
    if cuda:
        shape["card"] = torch.cuda.get_device_name()
    return {"shape": shape, **rows}


def _head_ways(auto_chunk: int, cuda: bool) -> dict:
    """name -> loss(hidden, weight, targets): the ways `head_side_by_side` compares."""
    import importlib.util
    from functools import partial

    import torch.nn.functional as F

    from fsdp2kit.parallel.linear_cross_entropy import linear_cross_entropy

    def logits_of(part, weight):  # noqa: ANN001, ANN202
        return F.linear(part, weight).float(), None

    def chunked(chunk: int):  # noqa: ANN202
        return lambda h, w, t: linear_cross_entropy(h, w, None, t, chunk, partial(logits_of, weight=w))

    ways = {
        "whole": lambda h, w, t: F.cross_entropy(F.linear(h, w).float(), t, reduction="sum"),
        f"chunked_auto_{auto_chunk}": chunked(auto_chunk),
        "chunked_1024": chunked(1024),
    }
    if cuda and importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        ways["liger"] = lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t, reduction="sum")
    return ways


def _time_head(way, hidden_states, weight, targets, repeats: int) -> dict:  # noqa: ANN001
    import time

    import torch

    cuda = hidden_states.is_cuda
    times, loss = [], None
    for attempt in range(repeats + 2):  # two warm-up runs
        hidden_states.grad = weight.grad = None
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        loss = way(hidden_states, weight, targets)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if attempt >= 2:
            times.append((time.perf_counter() - start) * 1000)
    row = {"ms": statistics.median(times), "loss": float(loss.detach())}
    if cuda:
        row["peak_bytes"] = torch.cuda.max_memory_allocated() - base
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny-qwen3-152k")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--head", action="store_true", help="time the head and its loss alone (see the docstring)")
    parser.add_argument("--tokens", type=int, default=8192, help="--head: tokens (issue 31: 4 x 2048)")
    parser.add_argument("--hidden", type=int, default=2048, help="--head: hidden size")
    parser.add_argument("--vocab", type=int, default=128256, help="--head: vocabulary")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON to this file")
    args = parser.parse_args()
    if args.head:
        result = {"benchmark": "chunked_loss_head", **head_side_by_side(args.tokens, args.hidden, args.vocab, 5)}
    else:
        measured = steps_side_by_side(SHAPES[args.shape], args.steps, args.repeats, args.nproc)
        result = {"benchmark": "chunked_loss", "shape": args.shape, "nproc": args.nproc, **measured}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
