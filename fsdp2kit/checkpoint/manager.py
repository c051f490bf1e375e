"""Sharded DCP checkpoints with an atomic commit.

A checkpoint is written to `checkpoints/.tmp-step_N/` by every rank; only when every rank's shards and DCP's
metadata are on disk does rank 0 write `trainer_state.json` and rename the folder to `checkpoints/step_N/`.
A folder named `step_N` with a `trainer_state.json` is therefore complete; anything else is ignored by resume.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
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


def _write_durable(path: Path, text: str) -> None:
    with path.open("w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def committed_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))


class CheckpointManager:
    def __init__(self, output_dir: Path, rank: int, async_save: bool, keep: int | None,
                 hf_config=None, tokenizer_path: Path | None = None):
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

    def save(self, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, trainer_state: dict,
             blocking: bool = False) -> None:
        self.wait()
        tmp, final = self.root / f".tmp-step_{step}", self.root / f"step_{step}"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            if self.hf_config is not None:
                write_config_and_tokenizer(tmp, self.hf_config, self.tokenizer_path, next(model.parameters()).dtype)
        dist.barrier()
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        torch.save({"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
                   tmp / f"rng_rank{self.rank}.pt")
        if self.async_save and not blocking:
            future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
            self.pending = (future, tmp, final, trainer_state)
        else:
            dcp.save(state, checkpoint_id=str(tmp))
            self._commit(tmp, final, trainer_state)

    def wait(self) -> None:
        """Finish and publish the checkpoint still being written in the background, if any."""
        if self.pending is not None:
            future, tmp, final, trainer_state = self.pending
            self.pending = None
            future.result()
            self._commit(tmp, final, trainer_state)

    def _commit(self, tmp: Path, final: Path, trainer_state: dict) -> None:
        dist.barrier()  # every rank's shards (and rank 0's .metadata) are written
        if self.rank == 0:
            for file in tmp.iterdir():
                with file.open("rb") as handle:
                    os.fsync(handle.fileno())
            _write_durable(tmp / STATE_FILE, json.dumps(trainer_state, indent=2))
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()

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
            raise UserError(f"training.resume: '{path}' is not a complete checkpoint (it needs {STATE_FILE} and .metadata)")
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(state, checkpoint_id=str(path))
        except Exception as exc:  # DCP reports missing keys, shape mismatches and unreadable files alike
            raise UserError(f"training.resume: checkpoint '{path}' cannot be loaded into this model: "
                            f"{str(exc).strip().splitlines()[-1][:300]}") from None
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=True)
            torch.set_rng_state(rng["cpu"])
            if torch.cuda.is_available() and rng["cuda"]:
                torch.cuda.set_rng_state_all(rng["cuda"])
        return json.loads((path / STATE_FILE).read_text())
