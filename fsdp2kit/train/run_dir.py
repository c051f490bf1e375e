"""One job per output_dir: a lock that rank 0 holds for the whole run, so a second run into the same folder is
refused instead of deleting the first one's temporary checkpoints and interleaving its metrics."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO

import torch.distributed as dist

from fsdp2kit.errors import UserError

LOCK_FILE = ".fsdp2kit.lock"


def output_dir_problem(output_dir: Path) -> str | None:
    """Why `output_dir` cannot hold a run, or None; creates nothing (`check` asks too): the nearest existing folder
    on its path must be a folder this user can write to."""
    existing = next(path for path in [output_dir, *output_dir.absolute().parents] if path.exists())
    if not existing.is_dir():
        return f"training.output_dir: '{existing}' is a file, not a folder; give a folder path"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"training.output_dir: '{existing}' is not writable by this user; give a folder you can write to"
    return None


def _writable_dir(output_dir: Path) -> str | None:
    """Why `output_dir` cannot hold a run, or None, creating it: checked before any model is loaded."""
    problem = output_dir_problem(output_dir)
    if problem is not None:
        return problem
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"training.output_dir: '{output_dir}' cannot be created: {exc.strerror}"
    return None


class OutputDirLock:
    """An exclusive `fcntl` lock on output_dir/.fsdp2kit.lock, taken by rank 0 and released when the job ends. The
    kernel drops it when the holding process dies (even by SIGKILL), so a crashed run never leaves a stale lock.
    Every rank learns the outcome before touching the folder."""

    def __init__(self, output_dir: Path, is_main: bool):
        self.path = output_dir / LOCK_FILE
        self.handle: TextIO | None = None
        problem = None
        if is_main:
            problem = _writable_dir(output_dir) or self._acquire()
        verdict = [problem]
        if dist.is_initialized():
            dist.broadcast_object_list(verdict, src=0)
        if verdict[0] is not None:
            self.release()
            raise UserError(verdict[0])

    def _acquire(self) -> str | None:
        handle = self.path.open("a+")
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            return (
                f"training.output_dir: '{self.path.parent}' is in use by another run ({holder}); wait for it to "
                "finish or give another output_dir"
            )
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {os.uname().nodename}")
        handle.flush()
        self.handle = handle
        return None

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the lock
            self.handle = None

    def __enter__(self) -> OutputDirLock:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


# What a run writes (or rewrites, or prunes) in its output_dir.
RUN_OUTPUTS = ("config.json", "config.given", "checkpoints", "hf", "adapter", "metrics.jsonl", "report")


def refuse_inputs_in_outputs(output_dir: Path, inputs: dict[str, Path]) -> None:
    """An input of the run (model folder, data file, tokenizer) that is output_dir itself or inside what the run
    writes there would be overwritten (config.json) or pruned (checkpoints) while the run reads it."""
    out = output_dir.resolve()
    written = [out / name for name in RUN_OUTPUTS]
    for key, path in inputs.items():
        where = path.resolve()
        if where == out or any(where == w or w in where.parents for w in written):
            raise UserError(
                f"{key}: '{path}' is training.output_dir '{output_dir}' or inside what a run writes there "
                f"({', '.join(RUN_OUTPUTS)}); give an output_dir apart from the run's inputs"
            )
