"""`fsdp2kit report RUN_DIR [RUN_DIR ...]`: PNG plots of each run's metrics.jsonl against the step (several runs
overlaid), written to the first run's report/ folder, and a short text summary of every run."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fsdp2kit.errors import UserError
from fsdp2kit.train.loggers import read_records

GIB = 1024**3
REQUIRED_FIELDS = ("step", "loss", "tokens_per_s", "peak_mem_bytes")  # what the summary reads from every record
# file name: (metrics.jsonl field, y-axis label, scale)
PLOTS = {
    "loss": ("loss", "loss", 1),
    "lr": ("lr", "learning rate", 1),
    "grad_norm": ("grad_norm", "gradient norm (before clipping)", 1),
    "tokens_per_s": ("tokens_per_s", "tokens/s (all ranks)", 1),
    "memory": ("peak_mem_bytes", "peak memory per rank (GiB)", 1 / GIB),
}


def read_run(run_dir: Path) -> list[dict]:
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        what = "is a file, not a folder" if run_dir.exists() else "does not exist"
        raise UserError(f"report: run folder '{run_dir}' {what}; give the training.output_dir of a run")
    if not metrics.is_file():
        raise UserError(f"report: '{run_dir}' has no metrics.jsonl; give the training.output_dir of a run")
    try:
        records = read_records(metrics)
    except UserError as exc:
        raise UserError(f"report: {exc}") from None
    if not records:
        raise UserError(f"report: '{metrics}' has no steps yet")
    for number, record in enumerate(records, 1):
        missing = [key for key in REQUIRED_FIELDS if not isinstance(record.get(key), int | float)]
        if missing:
            raise UserError(
                f"report: '{metrics}' record {number} has no number for '{missing[0]}'; it was not written by "
                f"fsdp2kit train (each step's record holds {', '.join(REQUIRED_FIELDS)})"
            )
    return records


def summary(run_dir: Path, records: list[dict]) -> str:
    finite = [r["loss"] for r in records if math.isfinite(r["loss"])]
    skipped = sum(1 for r in records if r.get("skipped"))
    tokens_per_s = sum(r["tokens_per_s"] for r in records) / len(records)
    peak = max(records, key=lambda r: r["peak_mem_bytes"])
    loss = f"loss {finite[0]:.4f} -> {finite[-1]:.4f}" if finite else "no finite loss"
    evaluated = [r["eval_loss"] for r in records if isinstance(r.get("eval_loss"), int | float)]
    loss += f", eval_loss {evaluated[-1]:.4f} (last of {len(evaluated)})" if evaluated else ""
    return (
        f"{run_dir}: {len(records)} steps (last {records[-1]['step']}), {loss}"
        + (f", {skipped} skipped" if skipped else "")
        + f", mean {tokens_per_s:,.0f} tokens/s, peak memory {peak['peak_mem_bytes'] / GIB:.2f} GiB"
        + (f" ({peak['peak_mem_kind']})" if "peak_mem_kind" in peak else "")
    )


def _plot_run(ax: Any, label: str, records: list[dict], field: str, scale: float) -> None:
    """One run's curve of `field`; on the loss plot, its eval_loss points too, in the same colour."""
    points = [(r["step"], r[field] * scale) for r in records if field in r]
    line = ax.plot([s for s, _ in points], [v for _, v in points], label=label, linewidth=1.2)[0]
    evaluated = [(r["step"], r["eval_loss"]) for r in records if field == "loss" and "eval_loss" in r]
    if evaluated:
        steps, losses = zip(*evaluated, strict=True)
        ax.plot(steps, losses, "o--", color=line.get_color(), label=f"{label} eval_loss", markersize=4)


def write_report(run_dirs: list[Path]) -> str:
    """Plots to run_dirs[0]/report/<name>.png; returns the summary lines and where the plots went."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = [(run_dir, read_run(run_dir)) for run_dir in run_dirs]
    names = [d.name for d in run_dirs]
    labels = names if len(set(names)) == len(names) else [str(d) for d in run_dirs]
    out_dir = run_dirs[0] / "report"
    out_dir.mkdir(parents=True, exist_ok=True)
    for file_name, (field, ylabel, scale) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        for label, (_, records) in zip(labels, runs, strict=True):
            _plot_run(ax, label, records, field, scale)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(ax.get_lines()) > 1:  # several runs, or a run's eval_loss
            ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / f"{file_name}.png")
        plt.close(fig)
    lines = [summary(run_dir, records) for run_dir, records in runs]
    return "\n".join(lines + [f"plots: {', '.join(f'{n}.png' for n in PLOTS)} in {out_dir}"])
