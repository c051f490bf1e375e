"""Where each step's record goes, on rank 0: metrics.jsonl, TensorBoard (output_dir/tb), W&B, and the console: a
live progress bar (loss, tokens/s, ETA) when stdout is a terminal, else one plain line every logging_steps."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fsdp2kit.config.schema import JobConfig
from fsdp2kit.durable import disk_full_message, ran_out_of_space
from fsdp2kit.errors import RunFault, UserError


def _scalars(record: dict) -> dict[str, float]:
    """The record's numbers, for the dashboards (not the step itself, nor flags and names)."""
    return {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def read_records(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl. A run killed mid-write leaves its last line torn: that line is skipped;
    a bad line anywhere else is a damaged file (UserError naming the line)."""
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif number < len(lines):
            raise UserError(f"line {number} of '{path}' is not a step record (the file is damaged)")
    return records


@contextmanager
def phase(what: str, is_main: bool) -> Iterator[None]:
    """A line before a long phase (loading the model, tokenising) and one with its duration after it, on rank 0,
    so a run that is busy never looks hung."""
    started = time.perf_counter()
    if is_main:
        print(f"{what} ...", flush=True)
    yield
    if is_main:
        print(f"{what}: done in {time.perf_counter() - started:.1f}s", flush=True)


class JsonlLog:
    """One JSON object per optimizer step. A fresh run starts a fresh file; a resumed one drops the records of
    steps after its checkpoint, which are about to be recomputed, and a torn last line; the file is replaced
    atomically, so a crash during the rewrite loses nothing."""

    def __init__(self, path: Path, resume_step: int | None):
        self.path = path
        if resume_step is None:
            path.unlink(missing_ok=True)
        elif path.exists():
            kept = [r for r in read_records(path) if r["step"] <= resume_step]
            rewritten = path.with_name(path.name + ".tmp")
            rewritten.write_text("".join(json.dumps(r) + "\n" for r in kept))
            os.replace(rewritten, path)

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        try:
            with self.path.open("a") as handle:
                handle.write(line)
        except OSError as exc:
            if not ran_out_of_space(self.path.parent, exc):
                raise
            intact = "the records before it are intact (a torn last line is dropped on resume), and the checkpoints"
            raise RunFault(
                disk_full_message(self.path.parent, f"step {record['step']}'s metrics", len(line), intact)
            ) from None

    def close(self) -> None:
        pass


def _tag(key: str) -> str:
    """A record field's TensorBoard tag: the evaluation's under `eval/` (eval_loss -> eval/loss), the rest `train/`."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


class TensorBoardLog:
    """Scalars under `train/` (and `eval/`) in TensorBoard event files; on resume, events after the checkpoint are
    purged."""

    def __init__(self, log_dir: Path, resume_step: int | None):
        from torch.utils.tensorboard import SummaryWriter

        if resume_step is None:
            shutil.rmtree(log_dir, ignore_errors=True)
        self.writer = SummaryWriter(str(log_dir), purge_step=None if resume_step is None else resume_step + 1)

    def write(self, record: dict) -> None:
        for key, value in _scalars(record).items():
            self.writer.add_scalar(_tag(key), value, record["step"])
        self.writer.flush()  # a step's events are on disk even if the run dies at the next one

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """A W&B run named after the output folder, with the resolved config; project, entity and mode come from the
    usual WANDB_* environment variables."""

    def __init__(self, cfg: JobConfig):
        import wandb

        output_dir = Path(cfg.training.output_dir)
        self.run = wandb.init(name=output_dir.name, dir=str(output_dir), config=cfg.saved_dict())

    def write(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class ConsoleProgress:
    """A rich progress bar when stdout is a terminal; otherwise a line every `every` steps and at the last one."""

    def __init__(self, total_steps: int, start_step: int, every: int):
        self.total, self.start_step, self.every = total_steps, start_step, every
        self.started = time.perf_counter()
        self.bar = None
        if sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[stats]}"),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self.task = self.bar.add_task("train", total=total_steps, completed=start_step, stats="")
            self.bar.start()

    def write(self, record: dict) -> None:
        step = record["step"]
        skipped = " (skipped: non-finite)" if record.get("skipped") else ""
        if "eval_loss" in record:  # printed whatever logging_steps says: an evaluation is rare and costly
            print(f"step {step}: eval_loss {record['eval_loss']:.4f} over {record['eval_tokens']} tokens", flush=True)
        if self.bar is not None:
            stats = f"loss {record['loss']:.4f} tokens/s {record['tokens_per_s']:.0f}{skipped}"
            self.bar.update(self.task, completed=step, stats=stats)
        elif step % self.every == 0 or step == self.total:
            eta = (time.perf_counter() - self.started) / (step - self.start_step) * (self.total - step)
            print(
                f"step {step}/{self.total} loss {record['loss']:.4f} lr {record['lr']:.2e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {record['tokens_per_s']:.0f} eta {_duration(eta)}"
                + skipped,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class RunLoggers:
    """Every destination of the step records (`training.report_to` picks the dashboards); empty on ranks other
    than 0."""

    def __init__(self, cfg: JobConfig, is_main: bool, total_steps: int, resume_step: int | None):
        tc = cfg.training
        if "wandb" in tc.report_to and importlib.util.find_spec("wandb") is None:  # checked on every rank: all stop
            raise UserError(
                "training.report_to: 'wandb' needs the wandb package, which is not installed; "
                "`pip install wandb` or leave it out (valid: tensorboard, wandb)"
            )
        self.logs: list = []
        if not is_main:
            return
        output_dir = Path(tc.output_dir)
        self.logs.append(JsonlLog(output_dir / "metrics.jsonl", resume_step))
        if "tensorboard" in tc.report_to:
            self.logs.append(TensorBoardLog(output_dir / "tb", resume_step))
        if "wandb" in tc.report_to:
            self.logs.append(WandbLog(cfg))
        self.logs.append(ConsoleProgress(total_steps, resume_step or 0, tc.logging_steps))

    def write(self, record: dict) -> None:
        for log in self.logs:
            log.write(record)

    def __enter__(self) -> RunLoggers:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for log in self.logs:
            log.close()
