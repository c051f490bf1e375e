"""`fsdp2kit train`: a client of `Strategy`. Construction (the strategy, the data, the resume) is separate from the
loop, and the loop reads top to bottom: wait for the batches, one `Strategy.step`, log, save."""

from __future__ import annotations

import json
import shutil
import signal
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

from fsdp2kit.checkpoint.manager import CheckpointManager, fault_point
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.data.dataset import source_files
from fsdp2kit.data.mixture import data_lines, describe_source, named_as, samples_taken
from fsdp2kit.data.samples import GlobalBatches, Prefetcher
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import Interrupted, UserError
from fsdp2kit.models.build import check_data_fits
from fsdp2kit.strategy import Strategy
from fsdp2kit.train.evaluate import EvalBatches
from fsdp2kit.train.interrupt import StopSignals, stopping_at_once
from fsdp2kit.train.loggers import RunLoggers, phase
from fsdp2kit.train.memory import StepMemory
from fsdp2kit.train.metrics import device_peak_flops, flops_per_token
from fsdp2kit.train.optim import schedule_warnings
from fsdp2kit.train.profiling import StepProfiler
from fsdp2kit.train.resume import check_data_unchanged, check_unchanged, data_files
from fsdp2kit.train.run_dir import OutputDirLock, refuse_inputs_in_outputs
from fsdp2kit.train.run_layout import run_layout
from fsdp2kit.train.step import StepResult


def train(cfg: JobConfig, runtime: Runtime) -> None:
    """The run, holding output_dir's lock from before the model loads until the last file is written; SIGINT,
    SIGTERM and SIGUSR1 stop it at the next step boundary, saving that step (training.save_on_stop)."""
    refuse_inputs_in_outputs(Path(cfg.training.output_dir), run_inputs(cfg))
    with OutputDirLock(Path(cfg.training.output_dir), runtime.is_main), StopSignals() as stop:
        Trainer(cfg, runtime, stop).run()


def run_inputs(cfg: JobConfig) -> dict[str, Path]:
    """The files and folders a run reads, by the key that names them."""
    data = cfg.data
    inputs = {f"data.source ({path.name})": path for path in source_files(data.source, data.dataset_dir)}
    if data.eval_source is not None:
        with named_as("data.eval_source"):
            inputs |= {f"data.eval_source ({p.name})": p for p in source_files(data.eval_source, data.dataset_dir)}
    if not cfg.model.name_or_path.startswith("builtin:"):
        inputs["model.name_or_path"] = Path(cfg.model.name_or_path)
    if cfg.data.tokenizer:
        inputs["data.tokenizer"] = Path(cfg.data.tokenizer)
    return inputs


class Trainer:
    """The `train` command: a strategy, the run's global batches and its checkpoints, from the resumed step on."""

    def __init__(self, cfg: JobConfig, runtime: Runtime, stop: StopSignals) -> None:
        self.cfg, self.runtime, self.stop = cfg, runtime, stop
        self.tc = cfg.training
        self.output_dir = Path(self.tc.output_dir)
        with phase(f"loading the model ({cfg.model.name_or_path})", runtime.is_main):
            self.strategy = Strategy(cfg, runtime)
        check_data_fits(self.strategy.sharded.source.hf_config, cfg.data.seq_len, self.strategy.tokenizer)
        if runtime.is_main:
            for line in run_layout(self.strategy.sharded, cfg.model, cfg.data, cfg.training, runtime.device):
                print(line, flush=True)
        self.batches = self._global_batches()
        self.eval_set = self._eval_batches()
        self.data_files = data_files(cfg.data)  # recorded in each checkpoint: a resume refuses edited data
        steps_per_epoch = self.batches.steps_per_epoch
        self.total_steps = (
            self.tc.max_steps if self.tc.max_steps > 0 else max(1, int(self.tc.num_train_epochs * steps_per_epoch))
        )
        self.strategy.set_schedule(self.total_steps)
        if runtime.is_main:
            for warning in schedule_warnings(self.tc, self.total_steps):
                print(f"warning: {warning}", flush=True)
        self.checkpoints: CheckpointManager = self.strategy.checkpoint_manager(
            self.output_dir, self.tc.save_total_limit
        )
        stop.abandon_message = self.checkpoints.abandoned_message
        self.resumed_from = self._resume()
        self.start_step = self.strategy.steps_done
        self.saved_step: int | None = None  # the step of this run's newest save (a stop need not save it again)
        self._write_run_config()

    def _global_batches(self) -> GlobalBatches:
        """The same global batches at any world size; the ranks of a sequence-parallel group share their samples."""
        cfg, strategy, layout = self.cfg, self.strategy, self.strategy.sharded.layout
        order = (
            self.tc.per_device_train_batch_size,
            self.tc.gradient_accumulation_steps,
            layout.data_parallel_size,
            layout.data_parallel_rank(self.runtime.rank),
            self.tc.seed,
            cfg.data.shuffle,
            strategy.tokenizer.pad_token_id or 0,
            cfg.data.max_tokens_per_micro_batch,
        )
        with phase(
            f"{strategy.sharded.variant.modality.data_phase} {describe_source(cfg.data.source)}", self.runtime.is_main
        ):
            batches = strategy.sharded.variant.global_batches(
                cfg.data, strategy.tokenizer, strategy.sharded.source, order
            )
        if self.runtime.is_main:
            for line in data_lines(batches.samples, batches.eval_samples, cfg.data):
                print(line, flush=True)
        return batches

    def _eval_batches(self) -> EvalBatches | None:
        """This rank's share of the evaluation set, if the run has one."""
        samples, layout = self.batches.eval_samples, self.strategy.sharded.layout
        if samples is None:
            if self.tc.eval_steps and self.runtime.is_main:
                print(
                    "warning: training.eval_steps is set but there is no evaluation set (give data.eval_source "
                    "or data.eval_fraction); nothing is evaluated",
                    flush=True,
                )
            return None
        return EvalBatches(
            partial(self.batches.collate_indices, samples=samples),
            len(samples),
            self.tc.per_device_eval_batch_size or self.tc.per_device_train_batch_size,
            layout.data_parallel_size,
            layout.data_parallel_rank(self.runtime.rank),
        )

    def _resume(self) -> Path | None:
        """From the newest complete checkpoint (or the one named), refusing one of another run or batch size."""
        resume_from = self.checkpoints.resolve(self.tc.resume)
        if resume_from is None:
            return None
        state = self.strategy.load_from(self.checkpoints, resume_from)
        check_unchanged(resume_from, state.get("config", {}), self.cfg.saved_dict(), self.tc.resume_allow_changes)
        check_data_unchanged(resume_from, state, self.cfg.data, self.tc.resume_allow_changes)
        step, global_batch = state["step"], self.batches.global_batch_size
        if state["consumed_samples"] != step * global_batch:
            raise UserError(
                f"training.resume: '{resume_from}' was trained with a global batch of "
                f"{state['consumed_samples'] // max(1, step)} samples, this run has {global_batch}; keep "
                "per_device_train_batch_size x gradient_accumulation_steps x data-parallel ranks the same to "
                "continue the same run"
            )
        if self.runtime.is_main:
            print(f"resumed from {resume_from} at step {step}", flush=True)
        if step > self.total_steps:
            raise UserError(
                f"training.resume: '{resume_from}' is at step {step}, past this run's {self.total_steps} steps; "
                "raise training.max_steps or start a new output_dir"
            )
        return resume_from

    def _write_run_config(self) -> None:
        """config.json (the resolved config) and config.given/ (the files as the user gave them)."""
        if not self.runtime.is_main:
            return
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.json").write_text(json.dumps(self.cfg.saved_dict(), indent=2))
        given = self.output_dir / "config.given"  # a foreign dialect's files included
        given.mkdir(exist_ok=True)
        for path in self.cfg.given_files:
            shutil.copyfile(path, given / Path(path).name)

    # ---- the loop ---------------------------------------------------------------------------------------------

    def run(self) -> None:
        strategy, tc = self.strategy, self.tc
        memory = StepMemory(strategy.model, strategy.optimizer, self.runtime.device, tc.track_memory)  # type: ignore[arg-type]
        strategy.model.train()
        steps = range(self.start_step, self.total_steps)
        with ExitStack() as stack:
            loggers = stack.enter_context(
                RunLoggers(
                    self.cfg, self.runtime.is_main, self.total_steps, self.start_step if self.resumed_from else None
                )
            )
            profiler = stack.enter_context(
                StepProfiler(tc.profile_steps, self.output_dir, self.runtime.rank, self.runtime.device)
            )
            prefetched = stack.enter_context(
                Prefetcher(self.batches, steps, pin_memory=self.runtime.device.type == "cuda")
            )
            metrics = StepMetrics(self.cfg, strategy)
            for step in steps:
                self._stop_if_asked(step)
                profiler.step_started(step + 1)
                started = time.perf_counter()
                micro_batches = [
                    {k: v.to(self.runtime.device, non_blocking=True) for k, v in mb.items()} for mb in prefetched.next()
                ]
                data_time = time.perf_counter() - started  # waiting for the prefetching thread, and the copy
                with self._compiling(step), memory.step(micro_batches):
                    result = strategy.step(micro_batches, on_micro_batch_done=memory.micro_batch_done)
                elapsed = time.perf_counter() - started
                record = metrics.record(step + 1, result, elapsed, data_time, memory.fields())
                loggers.write(record | self._evaluate(step + 1))
                profiler.step_finished(step + 1)
                strategy.guard.stop_if_diverged(step + 1)
                self._after_step(step + 1)
        self._finish()

    def _stop_if_asked(self, step: int) -> None:
        """At a step boundary every rank agrees on a stop signal: with training.save_on_stop the steps done are saved
        (a preempted job loses none of them), else the save in flight is finished and published."""
        signum = self.stop.requested()
        if not signum:
            return
        name = signal.Signals(signum).name
        if self.tc.save_on_stop and step > self.start_step:
            if self.saved_step != step:
                self._save(step, blocking=True)
            self.checkpoints.wait()  # a save of this step still being written in the background
            raise Interrupted(self.checkpoints.saved_at_stop_message(name, step), signum)
        self.checkpoints.wait()
        raise Interrupted(self.checkpoints.interrupted_message(name, step), signum)

    def _compiling(self, step: int) -> AbstractContextManager[Any]:
        """torch.compile works on the first call: say so, or the run looks hung."""
        compiled = self.strategy.sharded.plan.compiled_modules
        if compiled and step == self.start_step:
            return phase(f"step {step + 1}: torch.compile of {len(compiled)} modules", self.runtime.is_main)
        return nullcontext()

    def _evaluate(self, done: int) -> dict[str, Any]:
        """eval_loss over the evaluation set every training.eval_steps and after the last step; {} otherwise."""
        eval_set, every = self.eval_set, self.tc.eval_steps
        if eval_set is None or not (done == self.total_steps or (every and done % every == 0)):
            return {}
        started = time.perf_counter()
        result = self.strategy.evaluate(eval_set.micro_batches())
        return {"eval_loss": result.loss, "eval_tokens": result.tokens, "eval_time": time.perf_counter() - started}

    def _after_step(self, done: int) -> None:
        fault_point("step", done, self.runtime.rank)
        self.checkpoints.poll()
        if done < self.total_steps and self.tc.save_steps and done % self.tc.save_steps == 0:
            save_started = time.perf_counter()
            self._save(done)
            stall = time.perf_counter() - save_started  # the time training waits; the write may go on
            if self.runtime.is_main:
                print(f"checkpoint step_{done}: training paused {stall:.2f}s", flush=True)

    def _save(self, step: int, blocking: bool = False) -> None:
        strategy = self.strategy
        self.saved_step = step
        state = {**strategy.trainer_state(step * self.batches.global_batch_size), "data_files": self.data_files}
        self.checkpoints.save(step, strategy.model, strategy.optimizer, state, blocking=blocking)  # type: ignore[arg-type]

    def _finish(self) -> None:
        """A blocking save of the last step, then the exports."""
        self.strategy.guard.stop_if_nothing_trained(self.total_steps - self.start_step)
        if self.start_step < self.total_steps:  # a run resumed at its end has nothing new to save
            self._save(self.total_steps, blocking=True)
        strategy, variant = self.strategy, self.strategy.sharded.variant
        # No step boundary is left to stop at: a signal now (or one that came during the last save) stops the
        # exports at once, with the checkpoint just saved intact.
        outcome = f"the exports were not finished; checkpoint step_{self.total_steps} is intact"
        with stopping_at_once(outcome):
            signum = self.stop.requested()  # every rank, or one rank would stop alone inside the exports' gathers
            if signum:
                raise Interrupted(f"interrupted by {signal.Signals(signum).name}: {outcome}", signum)
            fault_point("before_export", self.total_steps, self.runtime.rank)
            variant.export_parts(
                strategy.model, self.output_dir, self.cfg.model.name_or_path, self.tc, self.runtime.is_main
            )
            if variant.exports_hf(self.tc):  # LoRA with export_merged: the adapters merged in
                with phase(f"writing the HF folder {self.output_dir / 'hf'}", self.runtime.is_main):
                    strategy.export_hf(self.output_dir / "hf")
        if self.runtime.is_main:
            for line in samples_taken(self.batches, range(self.start_step, self.total_steps)):
                print(line, flush=True)
            print(f"done: {self.total_steps} steps; outputs in {self.output_dir}", flush=True)


class StepMetrics:
    """One metrics.jsonl record per step: loss, lr, grad norm, tokens/s, MFU where the device's peak is known."""

    def __init__(self, cfg: JobConfig, strategy: Strategy) -> None:
        self.flops_token = flops_per_token(strategy.model, cfg.data.seq_len)
        self.peak_flops = device_peak_flops(strategy.runtime.device)
        self.world_size = strategy.runtime.world_size
        self.scaler = strategy.scaler

    def record(
        self, step: int, result: StepResult, elapsed: float, data_time: float, memory: dict[str, Any]
    ) -> dict[str, Any]:
        record: dict[str, Any] = {
            "step": step,
            "loss": result.loss,
            "lr": result.lr,
            "grad_norm": result.grad_norm,
            "tokens": int(result.input_tokens),
            "tokens_per_s": result.input_tokens / elapsed,
            "step_time": elapsed,
            "data_time": data_time,
            **memory,
        }
        if self.peak_flops:
            record["mfu"] = self.flops_token * result.input_tokens / elapsed / (self.peak_flops * self.world_size)
        if self.scaler.enabled:
            record["loss_scale"] = self.scaler.scale  # the scale of the next step
        if not result.applied:
            record["skipped"] = True
        return record
