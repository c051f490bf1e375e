"""`fsdp2kit train`: the training loop, top to bottom."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from fsdp2kit.checkpoint.manager import CheckpointManager, fault_point
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.data.dataset import IGNORE_INDEX, GlobalBatches, load_documents, tokenize_samples
from fsdp2kit.distributed import Runtime
from fsdp2kit.errors import UserError
from fsdp2kit.models.export import export_hf
from fsdp2kit.train.metrics import MetricsWriter, device_peak_flops, flops_per_token, peak_memory, truncate_metrics
from fsdp2kit.train.optim import build_optimizer, build_scheduler
from fsdp2kit.train.setup import build_sharded_model, count_parameters

MAX_NONFINITE_STEPS = 5


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def token_loss_sum(model: torch.nn.Module, batch: dict[str, torch.Tensor], aux_loss_weight: float = 0.0) -> torch.Tensor:
    """Summed next-token cross-entropy over the batch's target tokens (normalised by the caller), plus
    `aux_loss_weight` times the router's load-balancing loss where the model returns one (a mixture of experts
    with `output_router_logits`). No KV cache: training never reuses one, and a recomputed (checkpointed) layer
    would append to it twice."""
    outputs = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
    loss = F.cross_entropy(outputs.logits.float().flatten(0, 1), batch["labels"].flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")
    aux_loss = getattr(outputs, "aux_loss", None)
    if aux_loss_weight and isinstance(aux_loss, torch.Tensor):
        loss = loss + aux_loss_weight * aux_loss.float()
    return loss


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Global L2 norm over sharded (DTensor) and replicated (ignored-module) gradients; clip if max_norm > 0."""
    with_grad = [p for p in params if p.grad is not None]
    # Kept apart: one foreach op cannot mix DTensors and plain tensors.
    sharded = [p for p in with_grad if isinstance(p.grad, DTensor)]
    plain = [p for p in with_grad if not isinstance(p.grad, DTensor)]
    squares = torch.zeros((), dtype=torch.float32)
    if sharded:
        squares = squares + torch.nn.utils.get_total_norm([p.grad for p in sharded]).full_tensor().float().cpu() ** 2
    if plain:
        squares = squares + torch.nn.utils.get_total_norm([p.grad for p in plain]).float().cpu() ** 2
    total = squares.sqrt()
    if max_norm > 0 and math.isfinite(total.item()):
        for group in (sharded, plain):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def all_reduce_replicated_grads(params: list[torch.Tensor], world_size: int) -> None:
    """Parameters of ignored modules are outside FSDP: average their gradients as DDP would."""
    for param in params:
        if param.grad is not None and not isinstance(param.grad, DTensor):
            dist.all_reduce(param.grad)
            param.grad.div_(world_size)


def train(cfg: JobConfig, runtime: Runtime) -> None:
    tc = cfg.training
    output_dir = Path(tc.output_dir)
    torch.manual_seed(tc.seed)

    # Model: meta-device build, sharding plan, fully_shard, each rank's shards initialised or loaded.
    sharded = build_sharded_model(cfg, runtime, training=True)
    model = sharded.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, tc)

    # Data: the same global batches at any world size.
    tokenizer = load_tokenizer(sharded.source.tokenizer_path)
    samples = tokenize_samples(load_documents(cfg.data), tokenizer, cfg.data)
    batches = GlobalBatches(samples, tc.per_device_train_batch_size, tc.gradient_accumulation_steps,
                            runtime.world_size, runtime.rank, tc.seed, cfg.data.shuffle, tokenizer.pad_token_id or 0)
    total_steps = tc.max_steps if tc.max_steps > 0 else max(1, int(tc.num_train_epochs * batches.steps_per_epoch))
    scheduler = build_scheduler(optimizer, tc, total_steps)

    # Resume from the newest complete checkpoint (or the one named).
    checkpoints = CheckpointManager(output_dir, runtime.rank, cfg.strategy_args.strategy_config.async_save_ckpt,
                                    tc.save_total_limit, sharded.source.hf_config, sharded.source.tokenizer_path)
    metrics_path = output_dir / "metrics.jsonl"
    start_step = 0
    resume_from = checkpoints.resolve(tc.resume)
    if resume_from is not None:
        state = checkpoints.load(resume_from, model, optimizer)
        start_step = state["step"]
        if state["consumed_samples"] != start_step * batches.global_batch_size:
            raise UserError(f"training.resume: '{resume_from}' was trained with a global batch of "
                            f"{state['consumed_samples'] // max(1, start_step)} samples, this run has "
                            f"{batches.global_batch_size}; keep per_device_train_batch_size x gradient_accumulation_steps "
                            "x ranks the same to continue the same run")
        scheduler.load_state_dict(state["scheduler"])
        if runtime.is_main:
            print(f"resumed from {resume_from} at step {start_step}", flush=True)
    if runtime.is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.json").write_text(cfg.model_dump_json(indent=2))
        if resume_from is not None:
            truncate_metrics(metrics_path, start_step)
        else:
            metrics_path.unlink(missing_ok=True)
    metrics = MetricsWriter(metrics_path, runtime.is_main)

    trainable, _ = count_parameters(model)
    flops_token = flops_per_token(sharded.source.hf_config, trainable, cfg.data.seq_len)
    peak_flops = device_peak_flops(runtime.device)
    aux_loss_coef = getattr(sharded.source.hf_config, "router_aux_loss_coef", 0.0)
    nonfinite_in_a_row = 0
    model.train()

    for step in range(start_step, total_steps):
        started = time.perf_counter()
        micro_batches = [{k: v.to(runtime.device) for k, v in mb.items()} for mb in batches.micro_batches(step)]
        data_time = time.perf_counter() - started
        # The loss is the mean over every target token of the global batch: normalise by their global count.
        counts = torch.tensor([sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches),
                               sum(int(mb["attention_mask"].sum()) for mb in micro_batches)], dtype=torch.float64)
        dist.all_reduce(counts)
        target_tokens, input_tokens = counts.tolist()
        # A mixture of experts adds router_aux_loss_coef x its load-balancing loss averaged over all micro-batches
        # of all ranks, as transformers adds it to each batch's mean loss; in units of summed token losses:
        aux_loss_weight = aux_loss_coef * target_tokens / (len(micro_batches) * runtime.world_size)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            model.set_requires_gradient_sync(last)  # reduce-scatter once per step, not per micro-batch
            micro_loss = token_loss_sum(model, batch, aux_loss_weight)
            # FSDP averages gradients over all ranks; scale so the result is the global token mean.
            (micro_loss * (runtime.world_size / target_tokens)).backward()
            loss_sum += micro_loss.detach().double().cpu()
        all_reduce_replicated_grads(params, runtime.world_size)
        dist.all_reduce(loss_sum)
        loss = loss_sum.item() / target_tokens
        grad_norm = clip_grad_norm(params, tc.max_grad_norm).item()
        lr = scheduler.get_last_lr()[0]

        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            scheduler.step()
            nonfinite_in_a_row = 0
        else:
            nonfinite_in_a_row += 1
        optimizer.zero_grad(set_to_none=True)

        elapsed = time.perf_counter() - started
        peak_bytes, peak_kind = peak_memory(runtime.device)
        record = {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens": int(input_tokens),
                  "tokens_per_s": input_tokens / elapsed, "step_time": elapsed, "data_time": data_time,
                  "peak_mem_bytes": peak_bytes, "peak_mem_kind": peak_kind}
        if peak_flops:
            record["mfu"] = flops_token * input_tokens / elapsed / (peak_flops * runtime.world_size)
        if not finite:
            record["skipped"] = True
        metrics.write(record)
        if runtime.is_main and ((step + 1) % tc.logging_steps == 0 or step + 1 == total_steps):
            print(f"step {step + 1}/{total_steps} loss {loss:.4f} lr {lr:.2e} grad_norm {grad_norm:.3f} "
                  f"tokens/s {record['tokens_per_s']:.0f}" + (" (skipped: non-finite)" if not finite else ""), flush=True)
        if nonfinite_in_a_row >= MAX_NONFINITE_STEPS:
            raise RuntimeError(f"the loss or gradient norm was non-finite for {MAX_NONFINITE_STEPS} steps in a row "
                               f"(last at step {step + 1}); lower training.learning_rate or use fp32/bf16")

        done = step + 1
        fault_point("step", done, runtime.rank)
        checkpoints.poll()
        if done < total_steps and tc.save_steps and done % tc.save_steps == 0:
            save_started = time.perf_counter()
            checkpoints.save(done, model, optimizer, _trainer_state(done, scheduler, batches, cfg))
            stall = time.perf_counter() - save_started  # the time training waits; the write may go on
            if runtime.is_main:
                print(f"checkpoint step_{done}: training paused {stall:.2f}s", flush=True)

    checkpoints.save(total_steps, model, optimizer, _trainer_state(total_steps, scheduler, batches, cfg), blocking=True)
    if tc.export_hf:
        export_hf(model, output_dir / "hf", sharded.source.tokenizer_path, cfg.model.dtype, runtime.is_main)
    if runtime.is_main:
        print(f"done: {total_steps} steps; outputs in {output_dir}", flush=True)


def _trainer_state(step: int, scheduler, batches: GlobalBatches, cfg: JobConfig) -> dict:
    return {"step": step, "consumed_samples": step * batches.global_batch_size, "scheduler": scheduler.state_dict(),
            "config": json.loads(cfg.model_dump_json())}
