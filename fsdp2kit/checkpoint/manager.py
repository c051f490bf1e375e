"""Sharded DCP checkpoints with an atomic commit.

A checkpoint is written to `checkpoints/.tmp-step_N/` by every rank; only when every rank's shards and DCP's
metadata are on disk does rank 0 write `trainer_state.json` and rename the folder to `checkpoints/step_N/`.
A folder named `step_N` with a `trainer_state.json` is therefore complete; anything else is ignored by resume.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp2kit.errors import UserError
from fsdp2kit.models.export import write_config_and_tokenizer

STATE_FILE = "trainer_state.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def _write_durable(path: Path, payload: bytes) -> None:
    with path.open("wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


FAULT_ENV = "FSDP2KIT_FAULT"


def fault_point(name: str, step: int, rank: int) -> None:
    """Crash-test hook: with `FSDP2KIT_FAULT=name:step[:rank]` the process SIGKILLs itself here, on the first
    attempt only (not after an elastic restart). The tests use it to stop a run at exact moments of a save."""
    spec = os.environ.get(FAULT_ENV)
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    parts = spec.split(":")
    if parts[0] == name and int(parts[1]) == step and (len(parts) < 3 or int(parts[2]) == rank):
        os.kill(os.getpid(), signal.SIGKILL)


def read_dcp(state: dict, folder: Path, error_prefix: str, no_dist: bool = False) -> None:
    """`dcp.load` into `state` in place; any failure (missing key or rank file, shape mismatch, truncated file)
    becomes one UserError sentence. DCP raises CheckpointException, a BaseException, wrapping each rank's error."""
    try:
        dcp.load(state, checkpoint_id=str(folder), no_dist=no_dist)
    except (Exception, CheckpointException) as exc:
        error: BaseException = exc
        if isinstance(exc, CheckpointException) and exc.failures:
            error, _ = next(iter(exc.failures.values()))  # the rank's own exception and its stack summary
        reason = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
        raise UserError(f"{error_prefix}: {reason}") from None


def committed_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


class CheckpointManager:
    def __init__(
        self,
        output_dir: Path,
        rank: int,
        async_save: bool,
        keep: int | None,
        hf_config=None,
        tokenizer_path: Path | None = None,
    ):
        self.root = output_dir / "checkpoints"
        # Each checkpoint carries the model's config and tokenizer, so it is a model source by itself
        # (`model.name_or_path: .../step_N`, `fsdp2kit convert`).
        self.hf_config = hf_config
        self.tokenizer_path = tokenizer_path
        self.rank = rank
        self.keep = keep
        self.async_save = async_save
        # Async writes run collectives from a background thread: give them their own gloo group.
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.pending: tuple[Any, Path, Path, dict] | None = None
        if rank == 0:  # folders of saves that a crash interrupted: never complete, never resumed from
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)

    def save(
        self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict, blocking: bool = False
    ) -> None:
        self.wait()
        tmp, final = self.root / f".tmp-step_{step}", self.root / f"step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self.hf_config is not None:
                write_config_and_tokenizer(tmp, self.hf_config, self.tokenizer_path, next(model.parameters()).dtype)
                for file in tmp.iterdir():  # only rank 0's files exist yet; DCP syncs the shards it writes
                    _fsync_file(file)
        dist.barrier()
        fault_point("before_save", step, self.rank)
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        rng = io.BytesIO()
        torch.save(
            {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
            rng,
        )
        _write_durable(tmp / f"rng_rank{self.rank}.pt", rng.getvalue())
        if self.async_save and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = (future, tmp, final, trainer_state)
        else:
            dcp.save(state, checkpoint_id=str(tmp))  # DCP fsyncs every file it writes
            self._commit(tmp, final, trainer_state)

    def poll(self) -> None:
        """Publish a background write as soon as every rank has finished it (one tiny all-reduce per step),
        rather than at the next save."""
        if self.pending is None:  # the same on every rank: all ranks save at the same steps
            return
        done = torch.tensor([int(self.pending[0].done())])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            self.wait()

    def wait(self) -> None:
        """Finish and publish the checkpoint still being written in the background, if any."""
        if self.pending is not None:
            future, tmp, final, trainer_state = self.pending
            self.pending = None
            future.result()
            self._commit(tmp, final, trainer_state)

    def _commit(self, tmp: Path, final: Path, trainer_state: dict) -> None:
        step = trainer_state["step"]
        fault_point("after_shards", step, self.rank)
        dist.barrier()  # every rank's shards (and rank 0's .metadata) are written and synced
        if self.rank == 0:
            fault_point("before_state", step, self.rank)
            _write_durable(tmp / STATE_FILE, json.dumps(trainer_state, indent=2).encode())
            fault_point("before_rename", step, self.rank)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()
        fault_point("after_commit", step, self.rank)

    def _prune(self) -> None:
        if self.keep is None:
            return
        complete = committed_checkpoints(self.root)
        for old in complete[: max(0, len(complete) - self.keep)]:
            shutil.rmtree(old, ignore_errors=True)

    def resolve(self, resume: str) -> Path | None:
        """`auto`: the newest complete checkpoint (None if there is none); `never`; or an explicit folder."""
        if resume == "never":
            return None
        if resume == "auto":
            complete = committed_checkpoints(self.root)
            return complete[-1] if complete else None
        path = Path(resume)
        if not (path / STATE_FILE).is_file() or not (path / ".metadata").is_file():
            raise UserError(
                f"training.resume: '{path}' is not a complete checkpoint (it needs {STATE_FILE} and .metadata)"
            )
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        read_dcp(state, path, f"training.resume: checkpoint '{path}' cannot be loaded into this model")
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if torch.cuda.is_available() and rng["cuda"]:
                torch.cuda.set_rng_state_all(rng["cuda"])
        return json.loads((path / STATE_FILE).read_text())
