"""`fsdp2kit train`: the training loop, top to bottom."""

from __future__ import annotations

import json
import shutil
import signal
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from fsdp2kit.checkpoint.manager import CheckpointManager, fault_point
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.data.dataset import load_tokenizer
from fsdp2kit.data.samples import GlobalBatches, Prefetcher, TrainingSamples
from fsdp2kit.data.vl import VLEncoder, VLGlobalBatches, load_conversations
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import Interrupted, UserError
from fsdp2kit.models.export import export_hf
from fsdp2kit.models.lora import export_adapter, file_config
from fsdp2kit.models.sharded import build_sharded_model, count_parameters
from fsdp2kit.parallel.ulysses import shard_sequence
from fsdp2kit.parallel.vision import shard_vision_batch
from fsdp2kit.train.grads import LossScaler, NonFiniteGuard
from fsdp2kit.train.interrupt import StopSignals
from fsdp2kit.train.loggers import RunLoggers, phase
from fsdp2kit.train.memory import StepMemory
from fsdp2kit.train.metrics import device_peak_flops, flops_per_token
from fsdp2kit.train.optim import build_optimizer, build_scheduler, schedule_warnings
from fsdp2kit.train.profiling import StepProfiler
from fsdp2kit.train.resume import check_unchanged
from fsdp2kit.train.run_dir import OutputDirLock
from fsdp2kit.train.step import train_step


def train(cfg: JobConfig, runtime: Runtime) -> None:
    """The run, holding output_dir's lock from before the model loads until the last file is written; SIGINT and
    SIGTERM stop it at the next step boundary."""
    with OutputDirLock(Path(cfg.training.output_dir), runtime.is_main), StopSignals() as stop:
        _train(cfg, runtime, stop)


def _train(cfg: JobConfig, runtime: Runtime, stop: StopSignals) -> None:
    tc = cfg.training
    output_dir = Path(tc.output_dir)
    torch.manual_seed(tc.seed)

    # Model: meta-device build, sharding plan, fully_shard, each rank's shards initialised or loaded.
    with phase(f"loading the model ({cfg.model.name_or_path})", runtime.is_main):
        sharded = build_sharded_model(
            cfg.model,
            cfg.strategy_args.strategy_config,
            cfg.data,
            runtime,
            training=True,
            seed=tc.seed,
            compile_layers=tc.compile,
        )
    model = sharded.model
    optimizer = build_optimizer(model, tc)
    # fp32 master weights; computing or reducing gradients in fp16 needs loss scaling.
    scaler = LossScaler("fp16" in (sharded.plan.param_dtype, sharded.plan.reduce_dtype), tc.fp16_initial_scale)

    # Data: the same global batches at any world size. The ranks of a sequence-parallel group share their samples.
    # A vision-language model's conversations are encoded (images read) as their batches are built.
    tokenizer = load_tokenizer(sharded.source.tokenizer_path, cfg.model.trust_remote_code)
    vision = sharded.plan.vision_patch
    layout = sharded.layout
    order = (
        tc.per_device_train_batch_size,
        tc.gradient_accumulation_steps,
        layout.data_parallel_size,
        layout.data_parallel_rank(runtime.rank),
        tc.seed,
        cfg.data.shuffle,
        tokenizer.pad_token_id or 0,
        cfg.data.max_tokens_per_micro_batch,
    )
    batches: GlobalBatches
    if vision:
        encoder = VLEncoder.load(sharded.source.tokenizer_path, sharded.source.hf_config, cfg.data.seq_len)
        batches = VLGlobalBatches(load_conversations(cfg.data), *order, encoder=encoder)
    else:
        with phase(f"the token store of {cfg.data.source}", runtime.is_main):
            samples = TrainingSamples.from_config(cfg.data, tokenizer)  # tokenized once, memory-mapped
        batches = GlobalBatches(samples, *order)
    total_steps = tc.max_steps if tc.max_steps > 0 else max(1, int(tc.num_train_epochs * batches.steps_per_epoch))
    scheduler = build_scheduler(optimizer, tc, total_steps)
    if runtime.is_main:
        for warning in schedule_warnings(tc, total_steps, batches.steps_per_epoch):
            print(f"warning: {warning}", flush=True)

    # Resume from the newest complete checkpoint (or the one named).
    checkpoints = CheckpointManager(
        output_dir,
        runtime.rank,
        cfg.strategy_args.strategy_config.async_save_ckpt,
        tc.save_total_limit,
        sharded.source.hf_config,
        sharded.source.tokenizer_path,
        file_config(model, cfg.model.name_or_path) if sharded.plan.adapters else None,
    )
    stop.abandon_message = checkpoints.abandoned_message
    start_step = 0
    resume_from = checkpoints.resolve(tc.resume)
    if resume_from is not None:
        state = checkpoints.load(resume_from, model, optimizer)
        check_unchanged(resume_from, state.get("config", {}), cfg.saved_dict(), tc.resume_allow_changes)
        start_step = state["step"]
        if state["consumed_samples"] != start_step * batches.global_batch_size:
            raise UserError(
                f"training.resume: '{resume_from}' was trained with a global batch of "
                f"{state['consumed_samples'] // max(1, start_step)} samples, this run has "
                f"{batches.global_batch_size}; keep per_device_train_batch_size x gradient_accumulation_steps "
                "x data-parallel ranks the same to continue the same run"
            )
        scheduler.load_state_dict(state["scheduler"])
        if "loss_scaler" in state:
            scaler.load_state_dict(state["loss_scaler"])
        if runtime.is_main:
            print(f"resumed from {resume_from} at step {start_step}", flush=True)
        if start_step > total_steps:
            raise UserError(
                f"training.resume: '{resume_from}' is at step {start_step}, past this run's "
                f"{total_steps} steps; raise training.max_steps or start a new output_dir"
            )
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(json.dumps(cfg.saved_dict(), indent=2))
        given = output_dir / "config.given"  # the files as the user gave them (a foreign dialect's included)
        given.mkdir(exist_ok=True)
        for path in cfg.given_files:
            shutil.copyfile(path, given / Path(path).name)
    guard = NonFiniteGuard(tc.max_nonfinite_steps, scaler)

    trainable, _ = count_parameters(model)
    flops_token = flops_per_token(sharded.source.hf_config, trainable, cfg.data.seq_len)
    peak_flops = device_peak_flops(runtime.device)
    aux_loss_coef = getattr(sharded.source.hf_config, "router_aux_loss_coef", 0.0)
    memory = StepMemory(model, optimizer, runtime.device, tc.track_memory)
    model.train()

    with (
        RunLoggers(cfg, runtime.is_main, total_steps, start_step if resume_from is not None else None) as loggers,
        StepProfiler(tc.profile_steps, output_dir, runtime.rank, runtime.device) as profiler,
        Prefetcher(batches, range(start_step, total_steps), pin_memory=runtime.device.type == "cuda") as prefetched,
    ):
        for step in range(start_step, total_steps):
            signum = stop.requested()
            if signum:
                checkpoints.wait()  # the save in flight is finished and published
                raise Interrupted(checkpoints.interrupted_message(signal.Signals(signum).name, step), signum)
            profiler.step_started(step + 1)
            started = time.perf_counter()
            micro_batches = [
                {k: v.to(runtime.device, non_blocking=True) for k, v in mb.items()} for mb in prefetched.next()
            ]
            data_time = time.perf_counter() - started  # waiting for the prefetching thread, and the copy
            compiled = sharded.plan.compiled_modules
            compiling = (  # torch.compile works on the first call: say so, or the run looks hung
                phase(f"step {step + 1}: torch.compile of {len(compiled)} modules", runtime.is_main)
                if compiled and step == start_step
                else nullcontext()
            )
            with compiling, memory.step(micro_batches):
                result = train_step(
                    model,
                    micro_batches,
                    optimizer,
                    scheduler,
                    guard,
                    tc.max_grad_norm,
                    aux_loss_coef,
                    sharded.sp_group,
                    shard_vision_batch if vision else shard_sequence,  # VL: the tokens are sliced inside the model
                    on_micro_batch_done=memory.micro_batch_done,
                )

            elapsed = time.perf_counter() - started
            record = {
                "step": step + 1,
                "loss": result.loss,
                "lr": result.lr,
                "grad_norm": result.grad_norm,
                "tokens": int(result.input_tokens),
                "tokens_per_s": result.input_tokens / elapsed,
                "step_time": elapsed,
                "data_time": data_time,
                **memory.fields(),
            }
            if peak_flops:
                record["mfu"] = flops_token * result.input_tokens / elapsed / (peak_flops * runtime.world_size)
            if scaler.enabled:
                record["loss_scale"] = scaler.scale  # the scale of the next step
            if not result.applied:
                record["skipped"] = True
            loggers.write(record)
            profiler.step_finished(step + 1)
            guard.stop_if_diverged(step + 1)

            done = step + 1
            fault_point("step", done, runtime.rank)
            checkpoints.poll()
            if done < total_steps and tc.save_steps and done % tc.save_steps == 0:
                save_started = time.perf_counter()
                checkpoints.save(done, model, optimizer, _trainer_state(done, scheduler, scaler, batches, cfg))
                stall = time.perf_counter() - save_started  # the time training waits; the write may go on
                if runtime.is_main:
                    print(f"checkpoint step_{done}: training paused {stall:.2f}s", flush=True)

    if start_step < total_steps:  # a run resumed at its end has nothing new to save
        checkpoints.save(
            total_steps, model, optimizer, _trainer_state(total_steps, scheduler, scaler, batches, cfg), blocking=True
        )
    if sharded.plan.adapters and tc.export_hf:
        export_adapter(model, output_dir / "adapter", cfg.model.name_or_path, runtime.is_main)
    if (tc.export_hf and not sharded.plan.adapters) or tc.export_merged:  # LoRA: the adapters merged in
        with phase(f"writing the HF folder {output_dir / 'hf'}", runtime.is_main):
            export_hf(model, output_dir / "hf", sharded.source.tokenizer_path, cfg.model.dtype, runtime.is_main)
    if runtime.is_main:
        print(f"done: {total_steps} steps; outputs in {output_dir}", flush=True)


def _trainer_state(step: int, scheduler, scaler: LossScaler, batches: GlobalBatches, cfg: JobConfig) -> dict:
    return {
        "step": step,
        "consumed_samples": step * batches.global_batch_size,
        "scheduler": scheduler.state_dict(),
        "loss_scaler": scaler.state_dict(),
        "config": cfg.saved_dict(),
    }
