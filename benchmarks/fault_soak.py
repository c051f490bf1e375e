"""Fault soak: train, interrupt at a random moment (SIGKILL or SIGINT; during a step, a synchronous save or an
asynchronous save), resume; repeat. At the end the loss curve must equal an uninterrupted run's and no committed
checkpoint may be lost.

Prints one JSON object. Run: .venv/bin/python benchmarks/fault_soak.py [--rounds 20] [--steps 120] [--nproc 1]

Every round resumes (`resume: auto`) and is signalled: the moment is drawn from what the run is doing, not from the
clock. A round aims at one of three moments, in turn over a shuffled cycle:
- `step`: after the progress line of a step that saves nothing (1-3 steps past the newest checkpoint), a random
  fraction of a step later, so the signal lands inside the next step;
- `sync_save` / `async_save` (the run's `async_save_ckpt` set to match): once the next save step's folder
  `.tmp-step_N` appears, a random delay into the write.
What the signal met is what the script saw when it sent it: a save in flight if a `.tmp-step_*` folder existed,
else a step. Checked every round: the run resumed from the newest committed checkpoint, every committed checkpoint
is whole (`dcp_io.damage`), none committed before the signal was lost, a SIGINT during a save published that save,
and a SIGINT ended with exit code 130 and one `error:` line.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness import child_env  # noqa: E402

from fsdp2kit.checkpoint.dcp_io import damage  # noqa: E402
from fsdp2kit.checkpoint.manager import committed_checkpoints  # noqa: E402

MOMENTS = ("step", "sync_save", "async_save")


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


def saves_in_flight(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").glob(".tmp-step_*"))


def wait_for_save(run: Path, step: int, proc: subprocess.Popen, timeout: float = 120.0) -> bool:
    """Poll (every millisecond) until the save of `step` has started writing; False if the run ended first."""
    folder = run / "checkpoints" / f".tmp-step_{step}"
    deadline = time.perf_counter() + timeout
    while time.perf_counter() < deadline and proc.poll() is None:
        if folder.exists():
            return True
        time.sleep(0.001)
    return False


def one_round(args: argparse.Namespace, run: Path, rng: random.Random, env: dict, aim: str) -> dict:
    before = steps_of(run)
    newest = before[-1] if before else 0
    async_save = aim == "async_save" if aim != "step" else rng.random() < 0.5
    sig = rng.choice([signal.SIGKILL, signal.SIGINT])
    if aim == "step":  # a step that saves nothing, so the signal lands in the step after its line
        target = rng.choice([s for s in range(newest + 1, newest + 4) if s % args.every])
    else:
        target = (newest // args.every + 1) * args.every
    proc = subprocess.Popen(
        command(args, run, async_save), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stderr is not None
    stderr: list[str] = []  # drained as the run goes, so a full pipe never stalls it
    drain = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)  # type: ignore[arg-type]
    drain.start()
    resumed_at, met, sent_at = 0, None, 0
    in_flight: list[str] = []
    last_line, step_time = 0.0, float("inf")  # the shortest time between two step lines: a step with no save
    for line in proc.stdout:
        if match := re.match(r"resumed from .*step_(\d+) at step", line):
            resumed_at = int(match.group(1))
        if not (match := re.match(r"step (\d+)/", line)):
            continue
        now = time.perf_counter()
        step_time, last_line = (min(step_time, now - last_line) if last_line else step_time), now
        if int(match.group(1)) < target:
            continue
        if aim == "step":
            time.sleep(rng.uniform(0.05, 0.8) * (step_time if step_time < float("inf") else 0.1))
        elif wait_for_save(run, target, proc):
            time.sleep(rng.uniform(0.0, args.save_delay))
        in_flight, alive = saves_in_flight(run), proc.poll() is None
        proc.send_signal(sig)
        met = (("async_save" if async_save else "sync_save") if in_flight else "step") if alive else None
        sent_at = max([target, *(int(name[len(".tmp-step_") :]) for name in in_flight)])
        break
    proc.stdout.read()
    proc.wait()
    drain.join()
    err = "".join(stderr)
    problems = []
    if met is None:
        problems.append(f"no signal delivered (aimed at {aim} of step {target}; exit {proc.returncode})")
    if resumed_at != newest:
        problems.append(f"resumed from step {resumed_at}, newest committed was {newest}")
    after = steps_of(run)
    if before and (not after or after[-1] < before[-1]):
        problems.append(f"lost checkpoint: {before} -> {after}")
    for step in after:
        if (reason := damage(run / "checkpoints" / f"step_{step}")) is not None:
            problems.append(f"step_{step} damaged: {reason}")
    if met is not None and sig == signal.SIGINT:
        errors = [x for x in err.splitlines() if x.startswith("error: ")]
        if proc.returncode != 130 or len(errors) != 1 or "Traceback" in err:
            problems.append(f"SIGINT: exit {proc.returncode}, stderr {err[-500:]!r}")
        published = [int(name[len(".tmp-step_") :]) for name in in_flight]
        if published and max(published) not in after:
            problems.append(f"SIGINT during the save of step {max(published)} did not publish it: {after}")
    return {
        "signal": sig.name,
        "aim": aim,
        "met": met,
        "at_step": sent_at,  # the step whose line was awaited, or the save in flight
        "in_flight": in_flight,
        "committed": after,
        "exit_code": proc.returncode,
        "problems": problems,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=120, help="max_steps; a round advances at most 3 steps")
    parser.add_argument("--every", type=int, default=2, help="save_steps")
    parser.add_argument("--save-delay", type=float, default=0.1, help="the longest delay (s) into a save's write")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    env = child_env()
    aims = [aim for _ in range(0, args.rounds, len(MOMENTS)) for aim in rng.sample(MOMENTS, len(MOMENTS))]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fault-soak-") as work:
        reference, soaked = Path(work) / "reference", Path(work) / "soaked"
        subprocess.run(command(args, reference, True), cwd=REPO, env=env, check=True, capture_output=True)
        rounds = []
        for aim in aims[: args.rounds]:
            rounds.append(one_round(args, soaked, rng, env, aim))
            print(json.dumps(rounds[-1]), file=sys.stderr, flush=True)  # progress, one round a line
        final = subprocess.run(command(args, soaked, True), cwd=REPO, env=env, capture_output=True, text=True)
        if final.returncode != 0:
            raise SystemExit(final.stderr)
        expected, got = losses(reference), losses(soaked)
        if sorted(got) != sorted(expected):
            raise SystemExit(f"steps differ: {sorted(set(expected) ^ set(got))}")
        kills = {
            name: {moment: sum(r["signal"] == name and r["met"] == moment for r in rounds) for moment in MOMENTS}
            for name in ("SIGKILL", "SIGINT")
        }
        print(
            json.dumps(
                {
                    "rounds": args.rounds,
                    "signalled_rounds": sum(r["met"] is not None for r in rounds),
                    "steps": args.steps,
                    "save_steps": args.every,
                    "nproc": args.nproc,
                    "kills": kills,  # by signal, then by what it met: a step, a sync save, an async save
                    "max_abs_loss_diff": max(abs(got[s] - expected[s]) for s in expected),
                    "checkpoint_problems": [p for r in rounds for p in r["problems"]],
                    "wall_s": round(time.perf_counter() - started, 1),
                }
            )
        )


if __name__ == "__main__":
    main()
