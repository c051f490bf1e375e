"""`fsdp2kit plan --budget-gb X --measure`: the configurations that fit, each trained for a few real steps.

Each candidate runs as `fsdp2kit train` itself (a subprocess, the config's own --set lines plus the candidate's, a
few steps, output to a temporary folder), and its tokens/s (the median of the steps after the first, which warms up)
and peak are read back from its metrics.jsonl. Candidates come in the heuristic's order of expected speed; one is
skipped, not run, when it cannot win or is not expected to (SKIP_RULE).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from fsdp2kit.train.loggers import read_records

SKIP_RULE = (
    "a candidate is not run when (1) one with the same sharding and micro-batch, measured or itself skipped by (1) "
    "or (2), does strictly less work (no recompute where it recomputes, no offload where it offloads): it cannot be "
    "faster; or (2) with the same "
    "sharding, recompute and offload, tokens/s already fell from one micro-batch to the next smaller one: smaller "
    "ones are assumed slower still (throughput assumed unimodal in the micro-batch); or (3) it needs CUDA (offload) "
    "and there is none"
)
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def train_command(config: str, world_size: int, role: str | None, strategy_file: str | None) -> list[str]:
    """`fsdp2kit train` of the config as the user named it, on `world_size` ranks."""
    command = [sys.executable, "-m", "fsdp2kit", "train", config, "--nproc", str(world_size)]
    if role:
        command += ["--role", role]
    if strategy_file:
        command += ["--fsdp-config", strategy_file]
    return command


def _run_sets(out: Path, steps: int) -> list[str]:
    return [
        f"training.max_steps={steps}",
        f"training.output_dir={out}",
        "training.save_steps=0",
        "training.export_hf=false",
        "training.report_to=[]",
        "training.resume=never",
        "training.track_memory=false",  # the tracker slows every step: speed is what is measured here
        "training.profile_steps=null",
    ]


def measure_one(command: list[str], sets: list[str], out: Path, steps: int) -> dict[str, object]:
    """Train `steps` steps; tokens/s (median after the first step) and peak from metrics.jsonl, or the error line."""
    env = {key: value for key, value in os.environ.items() if key not in _LAUNCHER_VARIABLES}
    args = [arg for item in [*sets, *_run_sets(out, steps)] for arg in ("--set", item)]
    result = subprocess.run([*command, *args], env=env, capture_output=True, text=True)
    metrics = out / "metrics.jsonl"
    if result.returncode or not metrics.exists():
        lines = result.stderr.strip().splitlines() or [f"exit code {result.returncode}"]
        return {"status": "failed", "reason": lines[-1]}
    records = read_records(metrics)
    steady = records[1:] or records
    return {
        "status": "measured",
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
        "peak_mem_kind": records[-1].get("peak_mem_kind", ""),
    }


def _same_shape(a: dict[str, object], b: dict[str, object]) -> bool:
    return all(a[key] == b[key] for key in ("strategy", "recompute", "offload"))


def skip_reason(candidate: dict[str, object], measured: list[dict[str, object]]) -> str | None:
    """SKIP_RULE for `candidate`, given the candidates measured before it (in the heuristic's order)."""
    if candidate["offload"] and not torch.cuda.is_available():
        return "offload needs CUDA"
    done = [m for m in measured if m["status"] == "measured"]
    # A twin skipped by this rule is itself no faster than a measured one: more work than it cannot win either.
    ranked = [m for m in measured if m["status"] == "measured" or str(m.get("reason", "")).startswith("cannot")]
    for other in ranked:
        less_work = other["recompute"] <= candidate["recompute"] and other["offload"] <= candidate["offload"]  # type: ignore[operator]
        same = other["strategy"] == candidate["strategy"] and other["micro_batch"] == candidate["micro_batch"]
        if same and less_work and not _same_shape(other, candidate):
            return f"cannot beat #{other['index']} (same sharding and micro-batch, less work)"
    larger = [m for m in done if _same_shape(m, candidate) and m["micro_batch"] > candidate["micro_batch"]]  # type: ignore[operator]
    if len(larger) >= 2 and larger[-1]["tokens_per_s"] < larger[-2]["tokens_per_s"]:  # type: ignore[operator]
        return f"cannot beat #{larger[-2]['index']}: tokens/s fell from it to #{larger[-1]['index']}"
    return None


def measure_candidates(
    command: list[str],
    base_sets: list[str],
    candidates: Iterable[dict[str, object]],
    fits: Callable[[dict[str, object]], dict[str, object] | None],
    steps: int,
) -> dict[str, object]:
    """Each candidate skipped (SKIP_RULE, before its memory is even planned), left out (`fits` says it does not fit)
    or measured; the fastest measured one, and whether the heuristic's pick (the first that fits) is it."""
    rows: list[dict[str, object]] = []
    first_fit = None
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-plan-") as workdir:
        for candidate in candidates:
            row = {"index": len(rows) + 1, **candidate}
            reason = skip_reason(row, rows)
            if reason is None:
                planned = fits(candidate)
                if planned is None:
                    continue
                row.update(planned)
                first_fit = first_fit or row["index"]
                sets = [*base_sets, *candidate["overrides"]]  # type: ignore[misc]
                row.update(measure_one(command, sets, Path(workdir) / f"candidate_{row['index']}", steps))
            else:
                row.update(status="skipped", reason=reason)
            rows.append(row)
    measured = [r for r in rows if r["status"] == "measured"]
    fastest = max(measured, key=lambda r: r["tokens_per_s"], default=None)  # type: ignore[arg-type, return-value]
    return {
        "steps": steps,
        "rule": SKIP_RULE,
        "candidates": rows,
        "fastest": fastest,
        "heuristic_pick": first_fit,
        "heuristic_agrees": fastest is not None and fastest["index"] == first_fit,
    }


def print_measured(measurement: dict[str, object], budget_gb: float) -> None:
    """The table of candidates, then the fastest measured one as --set lines with its tokens/s and peak."""
    from rich.console import Console
    from rich.table import Table

    def gib(value: object) -> str:
        return f"{int(value) / 1024**3:.3f}"  # type: ignore[call-overload]

    console = Console(width=max(Console().width, 150))
    table = Table("#", "strategy", "recompute", "offload", "micro x accum", "planned GiB", "tokens/s", "peak GiB", "")
    for row in measurement["candidates"]:  # type: ignore[attr-defined]
        measured = row["status"] == "measured"
        table.add_row(
            str(row["index"]),
            row["strategy"],
            str(row["recompute"]),
            str(row["offload"]),
            f"{row['micro_batch']} x {row['accumulation']}",
            gib(row["peak_bytes"]) if "peak_bytes" in row else "-",
            f"{row['tokens_per_s']:.0f}" if measured else "-",
            f"{gib(row['peak_mem_bytes'])} ({row['peak_mem_kind']})" if measured else "-",
            "" if measured else f"{row['status']}: {row['reason']}",
        )
    console.print(f"measured: {measurement['steps']} steps of each candidate that fits {budget_gb} GiB, in order")
    console.print(table)
    fastest = measurement["fastest"]
    if fastest is None:
        console.print("no candidate could be measured")
        return
    pick = measurement["heuristic_pick"]
    agrees = f"the heuristic's pick (#{pick}) {'agrees' if measurement['heuristic_agrees'] else 'differs'}"
    console.print(
        f"fastest measured: #{fastest['index']}, {fastest['tokens_per_s']:.0f} tokens/s, "  # type: ignore[index]
        f"peak {gib(fastest['peak_mem_bytes'])} GiB ({fastest['peak_mem_kind']}), "  # type: ignore[index]
        f"planned {gib(fastest['peak_bytes'])} GiB; {agrees}"  # type: ignore[index]
    )
    for line in fastest["overrides"]:  # type: ignore[index]
        print(f"--set {line}", flush=True)
