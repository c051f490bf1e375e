"""The figures of docs/PERFORMANCE.md, drawn from the benchmarks' saved JSON (docs/bench/*.json, each the one object
a benchmark printed), so a re-run benchmark redraws its figure without re-running the others:

- memory_scaling.png: model states per rank against N for ZeRO-3, ZeRO-2 and NO_SHARD, with the ideal 16·P/N;
- plan_vs_measured.png: `fsdp2kit plan`'s predicted peak against the measured one, per configuration;
- speed_ratios.png: fsdp2kit's tokens/s over each reference stack's, per world size, with the 0.97 goal.

Run: .venv/bin/python benchmarks/plots.py [--bench docs/bench] [--out docs/img]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SIDE_BY_SIDE = {
    "vs_raw_fsdp2": "raw fully_shard loop",
    "vs_fsdp1": "FSDP1 (FULL_SHARD)",
    "vs_accelerate": "Accelerate",
}


def memory_scaling(result: dict, out: Path) -> None:
    rows = result["rows"]
    figure, axes = plt.subplots(figsize=(6, 4))
    for strategy in dict.fromkeys(row["strategy"] for row in rows):
        mine = [row for row in rows if row["strategy"] == strategy]
        axes.plot([r["world_size"] for r in mine], [r["states_bytes"] / MIB for r in mine], "o-", label=strategy)
    ideal = sorted({(row["world_size"], row["ideal_16P_over_N"]) for row in rows})
    axes.plot([n for n, _ in ideal], [b / MIB for _, b in ideal], "k--", label="ideal 16·P/N")
    axes.set(
        xlabel="ranks (N)",
        ylabel="params + grads + AdamW states per rank (MiB)",
        title=f"Model states per rank, {result['model']} (P = {result['parameters']:,})",
        xticks=[n for n, _ in ideal],
    )
    axes.legend()
    figure.tight_layout()
    figure.savefig(out / "memory_scaling.png", dpi=120)
    plt.close(figure)


def plan_vs_measured(result: dict, out: Path) -> None:
    rows = result["rows"]
    figure, axes = plt.subplots(figsize=(5, 5))
    measured = [row["measured_peak_bytes"] / MIB for row in rows]
    planned = [row["plan_peak_bytes"] / MIB for row in rows]
    axes.scatter(measured, planned)
    labels: dict[tuple[float, float], list[str]] = {}  # rows that land on the same point share one label
    for row, x, y in zip(rows, measured, planned, strict=True):
        labels.setdefault((x, y), []).append(f"{row['strategy']} N={row['world_size']}")
    for (x, y), names in labels.items():
        axes.annotate(", ".join(names), (x, y), fontsize=7, xytext=(4, -10), textcoords="offset points", ha="right")
    span = [min(measured + planned) * 0.9, max(measured + planned) * 1.05]
    axes.plot(span, span, "k--", linewidth=0.8, label="prediction = measurement")
    axes.fill_between(span, [s * 0.9 for s in span], [s * 1.1 for s in span], alpha=0.15, label="±10%")
    axes.set(
        xlabel="measured peak per rank (MiB)",
        ylabel="`fsdp2kit plan` peak per rank (MiB)",
        title="plan against track_memory",
    )
    axes.legend(loc="upper left")
    figure.tight_layout()
    figure.savefig(out / "plan_vs_measured.png", dpi=120)
    plt.close(figure)


def speed_ratios(results: dict[str, dict], out: Path) -> None:
    figure, axes = plt.subplots(figsize=(7, 4))
    labels, ratios = [], []
    for name, result in results.items():
        reference = SIDE_BY_SIDE[name]
        for world_size, row in result["world_sizes"].items():
            ranks = f"{world_size} rank{'s' if world_size != '1' else ''}"
            if "ratios" in row:  # several arms: each (ours / theirs) pair
                for pair, ratio in row["ratios"].items():
                    if "tracked" not in pair:  # tracked runs measure memory, not speed
                        labels.append(f"{pair}\n{ranks}")
                        ratios.append(ratio["ratio_tokens_per_s"])
                continue
            mode = f", {row['accelerate_mode']}" if "accelerate_mode" in row else ""
            labels.append(f"{reference}\n{ranks}{mode}")
            ratios.append(row["ratio_tokens_per_s"])
    bars = axes.bar(range(len(ratios)), ratios)
    axes.bar_label(bars, fmt="%.3f")
    axes.axhline(1.0, color="k", linewidth=0.8)
    axes.axhline(0.97, color="r", linestyle="--", linewidth=0.8, label="goal vs raw loop: 0.97")
    axes.set_xticks(range(len(labels)), labels, fontsize=7)
    axes.set(ylabel="fsdp2kit tokens/s ÷ reference tokens/s", title="Speed side by side (2-core CPU, fp32, 25M Llama)")
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(out / "speed_ratios.png", dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bench", type=Path, default=REPO / "docs" / "bench")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "img")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    scaling = json.loads((args.bench / "memory_scaling.json").read_text())
    memory_scaling(scaling, args.out)
    plan_vs_measured(scaling, args.out)
    speed_ratios({name: json.loads((args.bench / f"{name}.json").read_text()) for name in SIDE_BY_SIDE}, args.out)


if __name__ == "__main__":
    main()
