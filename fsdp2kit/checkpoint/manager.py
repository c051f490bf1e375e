"""Sharded DCP checkpoints with an atomic commit.

A checkpoint is written to `checkpoints/.tmp-step_N/` by every rank; only when every rank's shards and DCP's
metadata are on disk does rank 0 write `trainer_state.json` and rename the folder to `checkpoints/step_N/`.
A folder named `step_N` with a `trainer_state.json` is therefore complete; anything else is ignored by resume.
A checkpoint is deleted (keep-last-K, or replaced by a new save of its step) the same way round: renamed to
`.old-step_N` first, then removed, so a process killed while deleting never leaves a `step_N` with files missing.
"""

from __future__ import annotations

import errno
import io
import json
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from fsdp2kit.checkpoint.committed import CHECKPOINTS, STATE_FILE, committed_checkpoints
from fsdp2kit.checkpoint.dcp_io import (
    METADATA_FILE,
    damage,
    failure_reason,
    read_dcp,
    refuse_extra_model_tensors,
    stored_model_keys,
)
from fsdp2kit.distributed import failing_together
from fsdp2kit.durable import disk_full_message, folder_bytes, fsync_dir, fsync_file, ran_out_of_space, write_durable
from fsdp2kit.errors import PROCESS_STOP, RunFault, UserError
from fsdp2kit.models.export import write_config_and_tokenizer
from fsdp2kit.parallel.module_paths import model_class_name
from fsdp2kit.parallel.moe import refuse_other_expert_layout

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FAULT_ENV = "FSDP2KIT_FAULT"


def fault_point(name: str, step: int, rank: int) -> None:
    """Crash-test hook: with `FSDP2KIT_FAULT=name:step[:rank[:SIGNAL[@launcher]|ENOSPC]]` (several separated by
    commas) the process sends itself SIGNAL (default SIGKILL), or fails as a full disk would, here, on the first
    attempt only (not after an elastic restart). The tests use it to stop a run at exact moments of a save."""
    specs = os.environ.get(FAULT_ENV)
    if not specs or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return
    for parts in (spec.split(":") for spec in specs.split(",")):
        if parts[0] == name and int(parts[1]) == step and (len(parts) < 3 or parts[2] in ("*", str(rank))):
            _fault(parts[3] if len(parts) > 3 else "SIGKILL")


def _fault(what: str) -> None:
    """`fault_point`'s fault: a full disk, a signal to this process, or (`SIGNAL@launcher`) a signal to its launcher,
    waited for until the launcher has forwarded it here: a scheduler's signal to the whole job, landing at this
    moment."""
    if what == "ENOSPC":  # a full disk, as a write would report it
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    name, _, target = what.partition("@")
    signum = getattr(signal, name)
    if target != "launcher":
        os.kill(os.getpid(), signum)
        return
    os.kill(os.getppid(), signum)
    deadline = time.monotonic() + 60
    while PROCESS_STOP.signum != signum and time.monotonic() < deadline:
        time.sleep(0.01)


def read_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.json, or one sentence saying it is corrupt."""
    state_file = path / STATE_FILE
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"training.resume: '{state_file}' cannot be read: {exc}") from None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise UserError(f"training.resume: '{state_file}' is not a trainer state (it has no step)")
    return state


def replaceable_problem(target: Path) -> str | None:
    """Why a checkpoint may not be written at `target` (None: it may). Only an empty folder or an earlier checkpoint
    is replaced: anything else there (a file, a folder of the user's) would be deleted by the commit's rename."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        return f"'{target}' exists and is not a folder; give a new folder or an earlier checkpoint to replace"
    if target.is_dir() and any(target.iterdir()) and not (target / STATE_FILE).is_file():
        return (
            f"'{target}' holds files that are not a checkpoint; give a new folder or an earlier checkpoint to replace"
        )
    try:  # a real write, not os.access: root passes that on a read-only mount
        target.parent.mkdir(parents=True, exist_ok=True)
        probe, name = tempfile.mkstemp(prefix=".probe-", dir=target.parent)
        os.close(probe)
        os.unlink(name)
    except OSError as exc:  # mkdir says "File exists" where the folder to hold it is a file
        reason = "it is a file, not a folder" if target.parent.is_file() else exc.strerror or exc
        return f"'{target.parent}' cannot be written ({reason}): the checkpoint cannot be saved there"
    return None


def retire(checkpoint: Path) -> Path | None:
    """Rename a checkpoint folder out of resume's sight (`.old-step_N`) before it is deleted: a deletion cut short by a
    kill must not leave a `step_N` that still has its trainer_state.json but lacks shards. The new name, or None when
    there is no such folder."""
    if not checkpoint.exists():
        return None
    old = checkpoint.with_name(f".old-{checkpoint.name}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(checkpoint, old)
    fsync_dir(checkpoint.parent)
    return old


class CheckpointManager:
    def __init__(
        self,
        output_dir: Path,
        rank: int,
        async_save: bool,
        keep: int | None,
        hf_config: PretrainedConfig | None = None,
        tokenizer_path: Path | None = None,
        saved_config: Any = None,
    ) -> None:
        self.root = output_dir / CHECKPOINTS
        # Each checkpoint carries the model's config and tokenizer, so it is a model source by itself
        # (`model.name_or_path: .../step_N`, `fsdp2kit convert`). A LoRA run's checkpoint holds only what trains
        # (adapters, modules to save, their optimizer state) and the adapter's peft config: the frozen base is
        # read again from its source at resume.
        self.hf_config = hf_config
        self.tokenizer_path = tokenizer_path
        self.saved_config = saved_config  # written with save_pretrained instead of the HF config (LoRA's peft config)
        self.options = StateDictOptions(ignore_frozen_params=saved_config is not None)
        self.rank = rank
        self.keep = keep
        self.async_save = async_save
        # Async writes run collectives from a background thread: give them their own gloo group.
        self.group = dist.new_group(backend="gloo") if async_save else None
        self.pending: tuple[Any, Path, Path, dict] | None = None
        self.writing: int | None = None  # the step whose save the main thread is in
        if rank == 0:  # saves and deletions that a crash interrupted: never complete, never resumed from
            for stale in (*self.root.glob(".tmp-step_*"), *self.root.glob(".old-step_*")):
                shutil.rmtree(stale, ignore_errors=True)

    def save(
        self,
        step: int,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        trainer_state: dict,
        blocking: bool = False,
        final: Path | None = None,
    ) -> None:
        """Checkpoint `step` as checkpoints/step_N, or as the folder `final` (the Strategy API's save_checkpoint; rank 0
        decides whether it may be replaced, so every rank refuses together)."""
        self.wait()
        if final is not None:
            self._refuse_unwritable(final)
        final = final if final is not None else self.root / f"step_{step}"
        tmp = final.with_name(f".tmp-{final.name}")
        with self._writing(step, tmp):
            trainer_state = {**trainer_state, "world_size": dist.get_world_size()}  # which ranks' RNG files it holds
            with failing_together(f"checkpoint {final.name}"):  # also the barrier: the folder exists for all
                if self.rank == 0:
                    self._prepare(tmp, model)
            with failing_together(f"checkpoint {final.name}"):  # a rank failing here would leave the others in DCP
                fault_point("before_save", step, self.rank)
                model_state, optim_state = get_state_dict(model, optimizer, options=self.options)
                state = {"model": model_state, "optim": optim_state}
                rng = io.BytesIO()
                torch.save(
                    {
                        "cpu": torch.get_rng_state(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    },
                    rng,
                )
                write_durable(tmp / f"rng_rank{self.rank}.pt", rng.getvalue())
            if self.async_save and not blocking:
                future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
                self.pending = (future, tmp, final, trainer_state)
            else:
                dcp.save(state, checkpoint_id=str(tmp))  # DCP fsyncs every file it writes
                self._commit(tmp, final, trainer_state)

    def _refuse_unwritable(self, final: Path) -> None:
        """Every rank refuses together a folder that may not be written, or one that is not the same on every rank
        (a checkpoint is one folder holding every rank's shards)."""
        folders: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(folders, str(final))
        if len(set(folders)) > 1:
            given = ", ".join(f"rank {rank}: '{folder}'" for rank, folder in enumerate(folders))
            raise UserError(f"save_checkpoint: every rank must give the same folder (one checkpoint of all); {given}")
        problem = [replaceable_problem(final) if self.rank == 0 else None]
        dist.broadcast_object_list(problem, src=0)
        if problem[0] is not None:
            raise UserError(f"save_checkpoint: {problem[0]}")

    def _prepare(self, tmp: Path, model: nn.Module) -> None:
        """Rank 0: the empty folder being written, with the model's config and tokenizer."""
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.saved_config is not None:
            self.saved_config.save_pretrained(str(tmp))
        elif self.hf_config is not None:
            dtype = next(model.parameters()).dtype
            write_config_and_tokenizer(tmp, self.hf_config, self.tokenizer_path, dtype, model_class_name(model))
        for file in tmp.iterdir():  # only rank 0's files exist yet; DCP syncs the shards it writes
            fsync_file(file)

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
            with self._writing(trainer_state["step"], tmp):
                future.result()
                self._commit(tmp, final, trainer_state)

    @contextmanager
    def _writing(self, step: int, tmp: Path) -> Iterator[None]:
        """A failed write of step_N: a full disk or DCP's own failure is one sentence on every rank (`_fault`)."""
        self.writing = step
        try:
            yield
        except (Exception, CheckpointException) as exc:
            self._fault(step, tmp, exc)
            raise
        finally:
            self.writing = None

    def _fault(self, step: int, tmp: Path, exc: BaseException) -> None:
        """Raise the RunFault a failed write of step_N is: a full disk, told with the space it needs and what is
        intact, the partial folder removed so that the space it held is free again; or DCP's failure (its
        CheckpointException, with every rank's stack) in one sentence. Returns for any other error."""
        full, written = ran_out_of_space(tmp.parent, exc), folder_bytes(tmp)
        if isinstance(exc, CheckpointException):
            # DCP raises it on every rank: they judge together, before any rank removes the partial folder (a rank
            # that judged after it was removed saw room and raised DCP's exception, a traceback beside the one line).
            views: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(views, (full, written))
            full, written = any(view[0] for view in views), max(view[1] for view in views)
        complete = committed_checkpoints(self.root)
        intact = f"checkpoint {complete[-1].name} is intact" if complete else "no earlier checkpoint was written"
        if full:
            shutil.rmtree(tmp, ignore_errors=True)
            needed = max(written, folder_bytes(complete[-1]) if complete else 0)
            raise RunFault(disk_full_message(tmp.parent, f"checkpoint step_{step}", needed, intact)) from None
        if isinstance(exc, CheckpointException):
            raise RunFault(f"checkpoint step_{step} could not be written ({failure_reason(exc)}); {intact}") from None

    def _commit(self, tmp: Path, final: Path, trainer_state: dict) -> None:
        step = trainer_state["step"]
        fault_point("after_shards", step, self.rank)
        dist.barrier()  # every rank's shards (and rank 0's .metadata) are written and synced
        with failing_together(f"checkpoint {final.name}"):
            if self.rank == 0:
                fault_point("before_state", step, self.rank)
                write_durable(tmp / STATE_FILE, json.dumps(trainer_state, indent=2).encode())
                fault_point("before_rename", step, self.rank)
                old = retire(final)
                os.rename(tmp, final)
                fsync_dir(final.parent)
                if old is not None:
                    shutil.rmtree(old, ignore_errors=True)
                self._prune()
        fault_point("after_commit", step, self.rank)

    def _complete(self) -> str:
        complete = committed_checkpoints(self.root)
        return (
            f"checkpoint {complete[-1].name} is complete and the same command resumes from it"
            if complete
            else "no checkpoint was written yet"
        )

    def interrupted_message(self, signal_name: str, step: int) -> str:
        """`step`: the steps done, counting a resumed run's earlier ones (0: none yet)."""
        when = f"after step {step}" if step else "before its first step"
        return f"interrupted by {signal_name} {when}: {self._complete()}"

    def saved_at_stop_message(self, signal_name: str, step: int) -> str:
        """A stop that leaves the step it stopped after saved: where that checkpoint is."""
        saved, resumes = self.root / f"step_{step}", "the same command resumes from it"
        return f"interrupted by {signal_name} after step {step}: saved checkpoint {saved}; {resumes}"

    def abandoned_message(self, signal_name: str) -> str:
        """What a second signal leaves behind: the save in flight abandoned (a `.tmp-step_N` folder, never resumed
        from, removed by the next run) and the last complete checkpoint."""
        step = self.writing if self.writing is not None else self.pending[3]["step"] if self.pending else None
        complete = committed_checkpoints(self.root)
        if step is None or (complete and complete[-1].name == f"step_{step}"):
            return f"{signal_name} again: stopped at once; {self._complete()}"
        return f"{signal_name} again: abandoned checkpoint step_{step} while it was being written; {self._complete()}"

    def _prune(self) -> None:
        if self.keep is None:
            return
        complete = committed_checkpoints(self.root)
        for checkpoint in complete[: max(0, len(complete) - self.keep)]:
            old = retire(checkpoint)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)

    def resolve(self, resume: str) -> Path | None:
        """The checkpoint `training.resume` names (`resume_checkpoint`), a damaged newer one passed over said once."""
        path, passed_over = resume_checkpoint(self.root, resume)
        if passed_over is not None and self.rank == 0:
            print(f"warning: {passed_over}", flush=True)
        return path

    def load(self, path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """Model, optimizer and RNG state in place; returns the trainer state. A checkpoint of a larger model (more
        layers, another head) would load into this one without a word, truncated: refused, as is a lost RNG file."""
        trainer_state = read_trainer_state(path)
        model_state, optim_state = get_state_dict(model, optimizer, options=self.options)
        cannot_load = f"training.resume: checkpoint '{path}' cannot be loaded into this model"
        refuse_other_expert_layout(model, stored_model_keys(path, cannot_load), cannot_load)
        refuse_extra_model_tensors(path, model_state, cannot_load)
        state: dict[str, Any] = {"model": model_state, "optim": optim_state}
        read_dcp(state, path, cannot_load)
        # A LoRA checkpoint sets only the trainable tensors (DCP has already refused any it lacks); the frozen base
        # was read from its source.
        loading = StateDictOptions(
            ignore_frozen_params=self.options.ignore_frozen_params, strict=not self.options.ignore_frozen_params
        )
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=loading
        )
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = read_rng_file(rng_file)
            torch.set_rng_state(rng["cpu"])
            if torch.cuda.is_available() and rng["cuda"]:
                torch.cuda.set_rng_state_all(rng["cuda"])
        elif self.rank < trainer_state.get("world_size", 0):  # its saver had this rank: the file was lost
            raise UserError(
                f"training.resume: '{rng_file}' is missing, so this rank's random state cannot be restored and the "
                "run would not continue exactly; restore the file or resume from another checkpoint"
            )
        return trainer_state


def read_rng_file(rng_file: Path) -> dict[str, Any]:
    """A rank's saved random state, read as plain tensors only: a file holding any other pickled object is refused
    (a crafted one could run code), in fsdp2kit's words; torch's own refusal advises weights_only=False, which is
    exactly what must not be done with it."""
    try:
        return cast(dict[str, Any], torch.load(rng_file, weights_only=True))
    except pickle.UnpicklingError:
        raise UserError(
            f"training.resume: '{rng_file}' holds pickled objects other than tensors; refusing to unpickle it (a "
            "crafted file can run code that way): resume from a checkpoint fsdp2kit wrote"
        ) from None
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise UserError(f"training.resume: '{rng_file}' cannot be read: {reason}") from None


def resume_checkpoint(root: Path, resume: str) -> tuple[Path | None, str | None]:
    """The checkpoint `training.resume` names under the checkpoints folder `root`, read as a run resumes (train, and
    check before it), and what was passed over on the way. `auto`: the newest complete checkpoint whose files are
    whole (None if there is none; a damaged newer one is skipped, saying so); `never`; or an explicit folder, which
    must be a whole checkpoint. A UserError naming the key where none can be resumed."""
    if resume == "never":
        earlier = [p.name for p in committed_checkpoints(root)]
        if earlier:  # this run's saves would mix with them, and keep-last-K would delete this run's
            raise UserError(
                f"training.resume: never, but '{root}' holds another run's checkpoints "
                f"({', '.join(earlier[-3:])}); move them away or give another training.output_dir"
            )
        return None, None
    if resume == "auto":
        return _newest_whole(root)
    path = Path(resume)
    if not path.is_dir():
        what = "is a file, not a checkpoint folder" if path.exists() else "does not exist"
        raise UserError(f"training.resume: '{path}' {what}; give a checkpoint folder, auto or never")
    if not (path / STATE_FILE).is_file() or not (path / METADATA_FILE).is_file():
        raise UserError(f"training.resume: '{path}' is not a complete checkpoint (it needs {STATE_FILE} and .metadata)")
    read_trainer_state(path)
    problem = damage(path)
    if problem is not None:
        raise UserError(f"training.resume: checkpoint '{path}' is damaged: {problem}")
    return path, None


def _newest_whole(root: Path) -> tuple[Path | None, str | None]:
    """`training.resume: auto`: the newest committed checkpoint whose files are whole, and the newest damaged one
    passed over, said as a warning."""
    newest_damaged: tuple[str, str] | None = None
    for candidate in reversed(committed_checkpoints(root)):
        problem = damage(candidate)
        if problem is None:
            if newest_damaged is None:
                return candidate, None
            name, why = newest_damaged
            return candidate, (
                f"checkpoint {name} is damaged ({why}); resuming from {candidate.name}, the newest whole checkpoint"
            )
        newest_damaged = newest_damaged or (candidate.name, problem)
    if newest_damaged is not None:
        raise UserError(
            f"training.resume: every checkpoint in '{root}' is damaged (the newest, {newest_damaged[0]}: "
            f"{newest_damaged[1]}); move them away or set training.resume: never"
        )
    return None, None
