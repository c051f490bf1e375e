"""Fault soak: train, kill at a random moment (SIGKILL or SIGINT; during steps, synchronous and asynchronous saves),
resume; repeat. At the end the loss curve must equal an uninterrupted run's and no committed checkpoint may be lost.

Prints one JSON object. Run: .venv/bin/python benchmarks/fault_soak.py [--rounds 20] [--steps 120] [--nproc 1]
Each round resumes `resume: auto` from the newest checkpoint, picks sync or async saves and SIGKILL or SIGINT at
random, waits until a random step 1-3 steps past the newest checkpoint is printed, sleeps a random fraction of a
step (so the signal lands in the step, or in the save that follows it) and sends the signal. Checked every round:
the run resumed from the newest committed checkpoint, every committed checkpoint is whole (`dcp_io.damage`), none
committed before the signal was lost, and a SIGINT ended with exit code 130 and one line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fsdp2kit.checkpoint.dcp_io import damage  # noqa: E402
from fsdp2kit.checkpoint.manager import committed_checkpoints  # noqa: E402


def command(args: argparse.Namespace, out: Path, async_save: bool) -> list[str]:
    overrides = {
        "model.config.num_hidden_layers": 2,
        "data.seq_len": 64,
        "training.per_device_train_batch_size": 1,
        "training.gradient_accumulation_steps": 1,
        "training.max_steps": args.steps,
        "training.save_steps": args.every,
        "training.warmup_steps": 2,
        "training.export_hf": "false",
        "training.report_to": "[]",
        "training.output_dir": out,
        "strategy_args.strategy_config.async_save_ckpt": str(async_save).lower(),
    }
    sets = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    return [sys.executable, "-m", "fsdp2kit", "train", "examples/demo.yaml", "--nproc", str(args.nproc), *sets]


def losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def steps_of(run: Path) -> list[int]:
    return [int(p.name[5:]) for p in committed_checkpoints(run / "checkpoints")]


def one_round(args: argparse.Namespace, run: Path, rng: random.Random, env: dict) -> dict:
    before = steps_of(run)
    newest = before[-1] if before else 0
    async_save = rng.random() < 0.5
    sig = rng.choice([signal.SIGKILL, signal.SIGINT])
    target = newest + rng.randint(1, 3)
    proc = subprocess.Popen(
        command(args, run, async_save), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    resumed_at, killed_at, sent = 0, 0, False
    step_started = time.perf_counter()
    for line in proc.stdout:
        if match := re.match(r"resumed from .*step_(\d+) at step", line):
            resumed_at = int(match.group(1))
        if match := re.match(r"step (\d+)/", line):
            step_time = time.perf_counter() - step_started
            step_started = time.perf_counter()
            killed_at = int(match.group(1))
            if killed_at >= target:
                time.sleep(rng.uniform(0, 1.5 * step_time))  # into the next step or the save after this one
                proc.send_signal(sig)
                sent = True
                break
    out, err = proc.communicate()
    problems = []
    if resumed_at != newest:
        problems.append(f"resumed from step {resumed_at}, newest committed was {newest}")
    after = steps_of(run)
    if before and (not after or after[-1] < before[-1]):
        problems.append(f"lost checkpoint: {before} -> {after}")
    for step in after:
        if (reason := damage(run / "checkpoints" / f"step_{step}")) is not None:
            problems.append(f"step_{step} damaged: {reason}")
    if sent and sig == signal.SIGINT:
        lines = [x for x in err.splitlines() if x.strip()]
        if proc.returncode != 130 or len(lines) != 1 or "Traceback" in err:
            problems.append(f"SIGINT: exit {proc.returncode}, stderr {err[-500:]!r}")
    return {
        "signal": sig.name if sent else None,
        "async_save": async_save,
        "at_save_step": killed_at % args.every == 0,  # the save of this step starts right after its line
        "committed": after,
        "problems": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120)  # 20 rounds advance 1-4 steps each
    parser.add_argument("--every", type=int, default=2, help="save_steps")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault-soak-") as work:
        reference, soaked = Path(work) / "reference", Path(work) / "soaked"
        subprocess.run(command(args, reference, True), cwd=REPO, env=env, check=True, capture_output=True)
        rounds = [one_round(args, soaked, rng, env) for _ in range(args.rounds)]
        final = subprocess.run(command(args, soaked, True), cwd=REPO, env=env, capture_output=True, text=True)
        if final.returncode != 0:
            raise SystemExit(final.stderr)
        expected, got = losses(reference), losses(soaked)
        if sorted(got) != sorted(expected):
            raise SystemExit(f"steps differ: {sorted(set(expected) ^ set(got))}")
        print(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "steps": args.steps,
                    "save_steps": args.every,
                    "nproc": args.nproc,
                    "kills": {name: sum(r["signal"] == name for r in rounds) for name in ("SIGKILL", "SIGINT")},
                    "async_rounds": sum(r["async_save"] for r in rounds),
                    "signals_at_a_save_step": {
                        mode: sum(
                            r["signal"] is not None and r["at_save_step"] and r["async_save"] == is_async
                            for r in rounds
                        )
                        for mode, is_async in (("sync", False), ("async", True))
                    },
                    "max_abs_loss_diff": max(abs(got[s] - expected[s]) for s in expected),
                    "checkpoint_problems": [p for r in rounds for p in r["problems"]],
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
