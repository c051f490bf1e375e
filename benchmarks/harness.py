"""What the side-by-side benchmarks share: one HF model folder (so every stack starts from the same weights), an
fsdp2kit run and a reference-loop run on the same data, interleaved repeats, and the ratios of their medians."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# The model: a 25M-parameter Llama (7 layers of 512, 4096-token vocabulary), fp32.
LLAMA_25M = {
    "hidden_size": 512,
    "intermediate_size": 1376,
    "num_hidden_layers": 7,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}
LR = 1e-3


@dataclass(frozen=True)
class Workload:
    """Per rank and step: `accumulation` micro-batches of `batch` samples of `seq_len` tokens (the issue's run:
    256 tokens, 4 x 2), for `steps` optimizer steps."""

    seq_len: int = 256
    batch: int = 4
    accumulation: int = 2
    steps: int = 6


def model_folder(root: Path, shape: dict | None = None, name: str = "llama25m") -> Path:
    """The builtin tiny Llama's architecture at `shape` (by default LLAMA_25M), seeded, saved as root/name with the
    builtin tokenizer (its 4096 tokens fit any larger vocabulary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdp2kit.data.builtin import tokenizer_dir
    from fsdp2kit.models.builtin import BUILTIN_MODELS

    folder = root / name
    settings = {**BUILTIN_MODELS["tiny-llama"], **(LLAMA_25M if shape is None else shape)}
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    for file in tokenizer_dir().iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    return folder


def child_env() -> dict[str, str]:
    """The environment of a measured run: one thread per rank, this checkout first on the path (kept beside any
    path already there: the GPU machine's packages are on PYTHONPATH), no launcher variables of our own."""
    path = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(command: list[str]) -> None:
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")


# The configuration a user with DDP's memory would pick: replicated parameters, gradients all-reduced, no recompute.
NO_SHARD = (
    "strategy_args.strategy_config.sharding_strategy=NO_SHARD",
    "strategy_args.strategy_config.reshard_after_forward=false",
    "model.gradient_checkpointing=false",
)


def fsdp2kit_overrides(model: Path, work: Workload, out: Path) -> list[str]:
    """The --set lines that make fsdp2kit's demo config train `work` from `model` as the reference loops do (fp32,
    AdamW at a constant LR without weight decay), into `out`, saving and exporting nothing."""
    return [
        f"model.name_or_path={model}",
        "model.dtype=fp32",
        f"data.seq_len={work.seq_len}",
        f"training.per_device_train_batch_size={work.batch}",
        f"training.gradient_accumulation_steps={work.accumulation}",
        f"training.learning_rate={LR}",
        "training.weight_decay=0.0",
        "training.warmup_steps=0",
        "training.lr_scheduler_type=constant",
        f"training.max_steps={work.steps}",
        "training.save_steps=0",
        "training.export_hf=false",
        "training.report_to=[]",
        "training.resume=never",
        f"training.output_dir={out}",
    ]


def run_fsdp2kit(model: Path, nproc: int, work: Workload, out: Path, extra: list[str] = ()) -> dict:  # type: ignore[assignment]
    sets = [*fsdp2kit_overrides(model, work, out), *extra]
    command = [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", str(nproc)]
    command += [arg for item in sets for arg in ("--set", item)]
    _run(command)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tracked = {}
    if records[0].get("peak_mem_kind") == "cpu_live_tensors":  # training.track_memory=true
        top = max(records, key=lambda r: r["peak_mem_bytes"])
        tracked = {"tracked_peak_bytes": top["peak_mem_bytes"], "tracked_peak_categories": top["peak_mem_categories"]}
    return {
        **tracked,
        "tokens_per_s": [r["tokens_per_s"] for r in records],
        "losses": [r["loss"] for r in records],
        # the process's peak RSS on CPU (what the reference loops report there), the allocator's peak on CUDA
        "peak_mem_bytes": max(r.get("peak_rss_bytes", r["peak_mem_bytes"]) for r in records),
    }


def run_reference(
    impl: str,
    model: Path,
    nproc: int,
    work: Workload,
    out: Path,
    extra: list[str] = (),  # type: ignore[assignment]
) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    command += [str(REPO / "benchmarks" / "reference_loop.py"), "--impl", impl, "--model", str(model)]
    command += ["--out", str(out), "--steps", str(work.steps), "--seq-len", str(work.seq_len)]
    command += ["--batch", str(work.batch), "--accumulation", str(work.accumulation), "--lr", str(LR), *extra]
    _run(command)
    return json.loads(out.read_text())


def compare(ours: list[dict], theirs: list[dict], names: tuple[str, str] = ("fsdp2kit", "reference")) -> dict:
    """Ratios of medians (steady-state steps: the first, which warms up, is left out) and the largest relative
    difference of any step's loss between any pair of runs (None when a side trains on synthetic tokens)."""

    def median_tps(runs: list[dict]) -> float:
        return statistics.median(t for run in runs for t in run["tokens_per_s"][1:])

    def median_mem(runs: list[dict]) -> float:
        return statistics.median(run["peak_mem_bytes"] for run in runs)

    loss_diff = None
    if not any(run.get("synthetic") for run in [*ours, *theirs]):
        loss_diff = max(
            abs(a - b) / abs(b) for x in ours for y in theirs for a, b in zip(x["losses"], y["losses"], strict=True)
        )
    return {
        "ratio_tokens_per_s": median_tps(ours) / median_tps(theirs),
        "ratio_peak_mem": median_mem(ours) / median_mem(theirs),
        "loss_max_rel_diff": loss_diff,
        "tokens_per_s": {names[0]: median_tps(ours), names[1]: median_tps(theirs)},
        "peak_mem_bytes": {names[0]: median_mem(ours), names[1]: median_mem(theirs)},
    }


@dataclass(frozen=True)
class Arm:
    """One side of a comparison: fsdp2kit with extra --set lines, or a reference loop with extra arguments."""

    name: str
    impl: str  # "fsdp2kit" or a reference_loop --impl
    extra: tuple[str, ...] = ()


def interleaved(arms: list[Arm], world_sizes: list[int], repeats: int, work: Workload, workdir: Path) -> dict:
    """Every arm once per repeat, in turn, at each world size: {nproc: {arm name: [runs]}}."""
    model = model_folder(workdir)
    runs: dict = {}
    for nproc in world_sizes:
        runs[nproc] = {arm.name: [] for arm in arms}
        for repeat in range(repeats):
            for arm in arms:
                out = workdir / f"{arm.name}_{nproc}_{repeat}"
                if arm.impl == "fsdp2kit":
                    run = run_fsdp2kit(model, nproc, work, out, list(arm.extra))
                else:
                    run = run_reference(arm.impl, model, nproc, work, out.with_suffix(".json"), list(arm.extra))
                    run["synthetic"] = "--synthetic-batches" in arm.extra
                runs[nproc][arm.name].append(run)
    return runs


def side_by_side(impl: str, world_sizes: list[int], repeats: int, work: Workload, workdir: Path) -> dict:
    """fsdp2kit and the reference loop alternately, `repeats` times at each world size."""
    runs = interleaved([Arm("fsdp2kit", "fsdp2kit"), Arm(impl, impl)], world_sizes, repeats, work, workdir)
    results: dict = {}
    for nproc, by_arm in runs.items():
        results[str(nproc)] = compare(by_arm["fsdp2kit"], by_arm[impl])
        if "accelerate_mode" in by_arm[impl][0]:
            results[str(nproc)]["accelerate_mode"] = by_arm[impl][0]["accelerate_mode"]
    return results


def parse_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=2)
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def workload(args: argparse.Namespace) -> Workload:
    return Workload(args.seq_len, args.batch, args.accumulation, args.steps)


def load_average() -> str:
    """The 1, 5 and 15-minute load averages (the machine is shared: figures are labelled with them)."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(impl: str, name: str) -> None:
    """The command line of each side-by-side benchmark; prints its one JSON object."""
    args = parse_args()
    work = workload(args)
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-bench-") as workdir:
        results = side_by_side(impl, args.world_sizes, args.repeats, work, Path(workdir))
    print(
        json.dumps(
            {
                "benchmark": name,
                "reference": impl,
                "workload": work.__dict__,
                "loadavg": {"before": before, "after": load_average()},
                "world_sizes": results,
            }
        )
    )


def arm_summary(runs: list[dict]) -> dict:
    """Median steady-state tokens/s, median peak RSS, the loss curve of the first repeat, and the tracked peak
    where the arm tracked memory."""
    summary = {
        "tokens_per_s": statistics.median(t for run in runs for t in run["tokens_per_s"][1:]),
        "peak_rss_bytes": statistics.median(run["peak_mem_bytes"] for run in runs),
        "losses": runs[0]["losses"],
    }
    for key in ("tracked_peak_bytes", "tracked_peak_categories", "accelerate_mode"):
        if key in runs[0]:
            summary[key] = runs[0][key]
    return summary


def arms_main(name: str, arms: list[Arm], pairs: list[tuple[str, str]], description: str = "") -> None:
    """Run `arms` interleaved; print one JSON object: each arm's summary and `compare` of each (ours, theirs) pair."""
    args = parse_args()
    work = workload(args)
    before = load_average()
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-bench-") as workdir:
        runs = interleaved(arms, args.world_sizes, args.repeats, work, Path(workdir))
    results: dict = {}
    for nproc, by_arm in runs.items():
        results[str(nproc)] = {
            "arms": {arm: arm_summary(arm_runs) for arm, arm_runs in by_arm.items()},
            "ratios": {f"{a} / {b}": compare(by_arm[a], by_arm[b], (a, b)) for a, b in pairs},
        }
    report = {
        "benchmark": name,
        "description": description,
        "arms": [arm.__dict__ for arm in arms],
        "workload": work.__dict__,
        "repeats": args.repeats,
        "loadavg": {"before": before, "after": load_average()},
        "world_sizes": results,
    }
    print(json.dumps(report))
