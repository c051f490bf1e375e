"""Per-rank memory and step time under tensor parallelism: the same model and sequence on the same 4 CPU ranks (gloo)
at TP 1 (FSDP 4), TP 2 x FSDP 2 and TP 4, side by side in one run.

Per layout: `fsdp2kit plan --json` (its traced per-rank peak, as planned for CUDA), then `fsdp2kit train` with
`training.track_memory` (the tracked per-rank peak of live tensor bytes, the figure the plan predicts; the largest
over the steps) and again without it (tokens/s, the median after the first step). Beside them, the float32 logits a
rank holds for one chunk of the loss: a chunk's tokens x the rank's vocabulary rows x 4 bytes, which falls as 1/tp
while the sequence is shorter than a chunk. Every rank of a TP group trains the same micro-batch, so a step's tokens
per rank are the same at each layout; the global batch is tp times smaller.

Prints one JSON object. Run: .venv/bin/python benchmarks/tensor_parallel.py [--seq-len 1024] [--steps 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml
from harness import child_env

REPO = Path(__file__).resolve().parent.parent
RANKS = 4
# tiny-llama with 4 key/value heads (TP 4 splits them) and a vocabulary of its corpus's tokenizer.
MODEL = {"name_or_path": "builtin:tiny-llama", "config": {"num_key_value_heads": 4}, "dtype": "fp32"}


def config(folder: Path, tp: int, seq_len: int, steps: int, track: bool) -> Path:
    path = folder / f"tp{tp}{'-tracked' if track else ''}.yaml"
    cfg = {
        "model": {**MODEL, "tensor_parallel_size": tp},
        "data": {"seq_len": seq_len},
        "training": {
            "max_steps": steps,
            "per_device_train_batch_size": 1,
            "gradient_accumulation_steps": 1,
            "output_dir": str(folder / path.stem),
            "save_steps": 0,
            "export_hf": False,
            "report_to": [],
            "track_memory": track,
            "logging_steps": 1,
        },
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def fsdp2kit(*args: object) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fsdp2kit", *map(str, args), "--nproc", str(RANKS)]
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True, cwd=REPO)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {result.stderr.strip().splitlines()[-1:]}")
    return result


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def logits_bytes(seq_len: int, vocab: int, tp: int) -> int:
    from fsdp2kit.parallel.token_logprobs import chunk_tokens

    chunk = chunk_tokens("auto", vocab, tp) or seq_len
    return min(chunk, seq_len) * -(-vocab // tp) * 4


def measure(folder: Path, tp: int, seq_len: int, steps: int) -> dict[str, Any]:
    plan = json.loads(fsdp2kit("plan", config(folder, tp, seq_len, steps, True), "--json").stdout.splitlines()[-1])
    fsdp2kit("train", config(folder, tp, seq_len, steps, True))
    tracked = records(folder / f"tp{tp}-tracked")
    fsdp2kit("train", config(folder, tp, seq_len, steps, False))
    timed = records(folder / f"tp{tp}")
    from fsdp2kit.data.builtin import VOCAB_SIZE

    peak = max(r["peak_mem_bytes"] for r in tracked)
    return {
        "tp": tp,
        "fsdp": RANKS // tp,
        "tracked_peak_mib": round(peak / 2**20, 2),
        "planned_peak_mib": round(plan["peak_bytes"] / 2**20, 2),
        "planned_over_tracked": round(plan["peak_bytes"] / peak, 3),
        "logits_chunk_mib": round(logits_bytes(seq_len, VOCAB_SIZE, tp) / 2**20, 3),
        "tokens_per_s_per_rank": round(statistics.median(r["tokens_per_s"] for r in timed[1:]) / RANKS, 1),
        "peak_kind": tracked[-1].get("peak_mem_kind", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(Path(tmp), tp, args.seq_len, args.steps) for tp in (1, 2, 4)]
    base = rows[0]
    for row in rows:
        row["peak_vs_tp1"] = round(row["tracked_peak_mib"] / base["tracked_peak_mib"], 3)
        row["logits_vs_tp1"] = round(row["logits_chunk_mib"] / base["logits_chunk_mib"], 3)
        row["tokens_per_s_vs_tp1"] = round(row["tokens_per_s_per_rank"] / base["tokens_per_s_per_rank"], 3)
    print(json.dumps({"ranks": RANKS, "seq_len": args.seq_len, "model": MODEL, "layouts": rows}, indent=1))


if __name__ == "__main__":
    main()
