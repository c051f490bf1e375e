"""`fsdp2kit plan`: each rank's memory for a config, predicted without allocating it.

The config's own sharded model (the builder `train` uses, on the meta device) is given fake storage
(FakeTensorMode) in a fake process group of the planned world size, and two training steps run on it under torch's
FSDPMemTracker: the same tracker `training.track_memory` measures real runs with. That peak and its categories are
*traced*. Parameter, gradient, optimizer-state and all-gather sizes are also *computed* from the shard shapes, and CPU
offload (which needs a GPU) is computed from a traced run without it. Activation offload is traced: the planned
modules' saved activations leave the device in forward and come back one module ahead of their backward.

The plan predicts an accelerator's memory, so what depends on the device is decided as on CUDA (PLANNED_DEVICE),
and it says so: it names that device, how a run there attends packed documents in `check`'s words for it, and, where
this machine is another device, how `check` and `train` attend them here (not what the plan counts). Its figures are
tracked tensor bytes, what a run measures with `training.track_memory: true`, not the process's RSS.

On CUDA, where the build attends packed documents with FlexAttention (parallel/document_attention.py's
`document_path`), no dense [T, T] document mask exists, and the step is traced on rows without document boundaries
(plain causal attention saves what FlexAttention saves; its block mask, a few int32 per 128 x 128 block, is left
out). Where the dense mask stays (model.attn_implementation: sdpa or eager, a family without FlexAttention), the
rows carry their documents and the trace counts it.

Under Ulysses (k) and context parallelism (c) each rank holds T/(k c) of a sequence's tokens, and the trace runs
that rank's share; `attention_per_rank` also computes, from the layout alone, what one decoder layer's attention
holds on a rank: heads/k of the heads, T/c queries over all T keys (the key/value blocks all-gathered), so its scores
shrink by k c and its gathered keys and values by k only.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp2kit.config import load_config
from fsdp2kit.config.schema import JobConfig, TrainingConfig
from fsdp2kit.data.dataset import Sample, collate
from fsdp2kit.distributed import Runtime, destroy_process_group, require_supported_versions
from fsdp2kit.dtypes import torch_dtype
from fsdp2kit.errors import UserError
from fsdp2kit.models.build import attention_implementation
from fsdp2kit.models.heads import ValueHead
from fsdp2kit.models.sharded import ShardedModel, build_sharded_model
from fsdp2kit.parallel.activation_offload import Departed, apply_activation_offload
from fsdp2kit.parallel.document_attention import DOCUMENT_FLEX, document_route
from fsdp2kit.parallel.float8 import gathered_element_size
from fsdp2kit.parallel.fsdp import before_micro_batch, fsdp_states, stays_gathered
from fsdp2kit.parallel.token_logprobs import chunk_tokens, install_token_head
from fsdp2kit.strategy import HeadOutputLoss
from fsdp2kit.train.memory import tracker_peak
from fsdp2kit.train.muon import MuonWithAdamW, gathered_matrix_bytes
from fsdp2kit.train.optim import build_optimizer
from fsdp2kit.train.step import MicroBatchLoss, TokenCrossEntropy

Batch = dict[str, torch.Tensor]
GIB = 1024**3
PLANNED_DEVICE = torch.device("cuda")  # the device whose memory the plan predicts (the trace itself runs on the CPU)
# What torch's module tracker warns of on every plan (its module parents out of order in the fake-tensor trace): the
# tracker's per-module statistics, which the plan does not read; silenced only while the plan traces.
_TRACKER_WARNING = "The module hierarchy tracking maybe be messed up"
TRACKED_BYTES_NOTE = (
    "figures: tracked tensor bytes (torch's FSDPMemTracker), not the process's RSS; the comparable measured figure is "
    "a run's with `training.track_memory: true` (metrics peak_mem_categories, and on a CPU peak_mem_bytes, "
    "kind cpu_live_tensors; without it a CPU run's peak_mem_bytes and `report` show the RSS)"
)
_STRATEGY = "strategy_args.strategy_config"
# Fastest first (seed 002's throughput table): less sharding, no recompute, no offload.
STRATEGIES = {
    "NO_SHARD": [f"{_STRATEGY}.sharding_strategy=NO_SHARD", f"{_STRATEGY}.reshard_after_forward=false"],
    "SHARD_GRAD_OP": [f"{_STRATEGY}.sharding_strategy=SHARD_GRAD_OP", f"{_STRATEGY}.reshard_after_forward=false"],
    "FULL_SHARD": [f"{_STRATEGY}.sharding_strategy=FULL_SHARD", f"{_STRATEGY}.reshard_after_forward=true"],
}


@dataclass
class ConfigSource:
    """How the user named the config, so that variants are loaded exactly as the printed --set lines would be."""

    path: str
    overrides: list[str]
    role: str | None
    strategy_file: str | None
    trust_remote_code: bool = False  # --trust-remote-code

    def load(self, extra: list[str] = ()) -> JobConfig:  # type: ignore[assignment]
        return load_config(
            self.path,
            [*self.overrides, *extra],
            role=self.role,
            strategy_file=self.strategy_file,
            trust_remote_code=self.trust_remote_code,
        )


@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[Runtime]:
    """Rank 0 of `world_size` ranks in this process: torch's fake backend, whose collectives move nothing."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    require_supported_versions()
    if dist.is_initialized():
        raise RuntimeError("fsdp2kit plan runs in a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield Runtime(0, world_size, 0, torch.device("cpu"))
    finally:
        destroy_process_group()


def _synthetic_micro_batch(cfg: JobConfig, dense_documents: bool) -> dict[str, torch.Tensor]:
    """A micro-batch shaped like the data pipeline's (full seq_len windows), with document positions when packing
    makes a dense document mask (`dense_documents`: the run keeps one, FlexAttention does not replace it)."""
    length = cfg.data.seq_len + 1
    documents = cfg.data.pack and cfg.data.document_mask and dense_documents
    sample = Sample(
        torch.arange(length) % 64,
        torch.ones(length, dtype=torch.bool),
        torch.arange(length) % max(1, length // 2) if documents else None,
    )
    return collate([sample] * cfg.training.per_device_train_batch_size, pad_id=0)


def _local_optimizer(
    optimizer: torch.optim.Optimizer, cfg: TrainingConfig
) -> tuple[torch.optim.Optimizer, list[tuple[torch.Tensor, nn.Parameter]]]:
    """The same optimizer over each parameter's local shard. Under FakeTensorMode the tracker also counts DTensor's
    sharding-propagation tensors as allocations (it tells them apart only in eager mode), which would double the
    optimizer's share; the local shards hold exactly the bytes the real step touches. Muon's matrices are
    orthogonalised shard by shard here: `computed` adds the whole matrix the real step gathers."""
    pairs: list[tuple[torch.Tensor, nn.Parameter]] = []

    def local(param: torch.Tensor) -> nn.Parameter:
        shard = nn.Parameter(param.to_local() if isinstance(param, DTensor) else param.data)
        pairs.append((param, shard))
        return shard

    def local_adamw(adamw: torch.optim.Optimizer) -> torch.optim.AdamW:
        groups = [{**group, "params": [local(p) for p in group["params"]]} for group in adamw.param_groups]
        return torch.optim.AdamW(groups)

    if isinstance(optimizer, MuonWithAdamW):
        matrices = [(name, local(param)) for name, param in zip(optimizer.names, optimizer.matrices, strict=True)]
        adamw = local_adamw(optimizer.adamw) if optimizer.adamw is not None else None
        return MuonWithAdamW(matrices, adamw, cfg), pairs
    return local_adamw(optimizer), pairs


class GroupedMMInAnyDtype(TorchDispatchMode):
    """torch's fake grouped_mm (what MoE experts run by default, transformers' grouped_mm) takes bf16 only, the CUDA
    kernel's rule, while the CPU kernel computes in any dtype: an fp32 model is traced with an output of the shape
    and dtype the kernel gives. The gradients' grouped_mms in backward are the same op."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            shape = _grouped_mm_shape(args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None))
            if shape is not None:
                return torch.empty(shape, dtype=kwargs.get("out_dtype") or args[0].dtype, device=args[0].device)
        return func(*args, **kwargs)


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...] | None:
    """grouped_mm's output shape: rows of `a` by groups of `b` (2-D x 3-D), one product per group (2-D x 2-D, cut by
    `offs`; 3-D x 3-D); None for what MoE layers do not run."""
    if a.dim() == 2 and b.dim() == 3:
        return (a.shape[0], b.shape[2])
    if a.dim() == 2 and b.dim() == 2 and offs is not None:
        return (offs.shape[0], a.shape[0], b.shape[1])
    if a.dim() == 3 and b.dim() == 3:
        return (a.shape[0], a.shape[1], b.shape[2])
    return None


_TRACES: dict[tuple[str, int], dict[str, object]] = {}


def trace_step_memory(cfg: JobConfig, world_size: int) -> dict[str, object]:
    """Two optimizer steps of rank 0 on fake tensors; the tracker's peak (traced) and shard sizes (computed).
    Remembered per resolved config: the table and the budget search meet the same configs again."""
    key = (cfg.model_dump_json(), world_size)
    if key not in _TRACES:
        _TRACES[key] = _trace(cfg, world_size)
    return _TRACES[key]


def this_device() -> torch.device:
    """The device a run on this machine trains on (distributed.init_distributed's choice)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _trace(cfg: JobConfig, world_size: int) -> dict[str, object]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_TRACKER_WARNING, category=UserWarning)
        return _traced(cfg, world_size)


def _traced(cfg: JobConfig, world_size: int) -> dict[str, object]:
    with fake_world(world_size) as runtime:
        sharded = build_sharded_model(
            cfg.model,
            cfg.strategy_args.strategy_config,
            cfg.data,
            runtime,
            training=True,
            seed=cfg.training.seed,
            compile_layers=cfg.training.compile,
            materialize=False,
        )
        model = sharded.model
        # How the run on PLANNED_DEVICE attends packed documents. The fake world's model was built for the CPU (sdpa
        # or eager, under Ulysses too; DOCUMENT_SDPA takes the dense mask on fake tensors), which keeps the dense mask
        # unless FlexAttention would replace it there.
        switch, document_attention = document_route(model, cfg.model, cfg.data, PLANNED_DEVICE)
        here = this_device()  # and how a run on this machine attends them, as `check` here says
        document_attention_here = document_route(model, cfg.model, cfg.data, here)[1]
        # Only eager attention holds a layer's [heads, queries, keys] scores: sdpa, FlexAttention and flash never do.
        scores_in_peak = "eager" in attention_implementation(model)
        # The fake world runs on the CPU, where the build leaves activation offload out: here the planned modules'
        # saved activations leave the device as they do on CUDA (only their shapes are kept).
        apply_activation_offload(model, sharded.plan.activation_offload_modules, Departed(), torch.device("cpu"))
        accumulation = cfg.training.gradient_accumulation_steps
        synthetic = [_synthetic_micro_batch(cfg, switch != DOCUMENT_FLEX) for _ in range(accumulation)]
        loss, micro_batches = _training_loss(sharded, cfg, synthetic)
        with FakeTensorMode(allow_non_fake_inputs=True), GroupedMMInAnyDtype():
            model.to_empty(device="cpu")
            sharded_optimizer = build_optimizer(model, cfg.training)
            optimizer, pairs = _local_optimizer(sharded_optimizer, cfg.training)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(micro_batches))
            with tracker:
                each = cfg.strategy_args.strategy_config.sync_each_batch
                for _ in range(2):  # the second step is the steady state: optimizer states exist during backward
                    _traced_step(sharded, loss, micro_batches, each, tracker)
                    for param, local in pairs:
                        local.grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    model.zero_grad(set_to_none=True)
            peak = tracker_peak(tracker, torch.device("cpu"))
            computed = computed_sizes(
                model, sharded_optimizer
            )  # after the first forward: FSDP sets compute dtypes lazily
    return {
        "peak_bytes": peak.pop("total", 0),
        "categories": peak,
        "computed": computed,
        "attention": attention_per_rank(cfg, sharded.source.hf_config.get_text_config()),
        "scores_in_peak": scores_in_peak,
        "planned_device": PLANNED_DEVICE.type,
        "document_attention": document_attention,  # as on PLANNED_DEVICE
        "this_device": here.type,
        "document_attention_here": document_attention_here,
    }


def _traced_step(
    sharded: ShardedModel, loss: MicroBatchLoss, micro_batches: list[dict[str, Any]], each: bool, tracker: Any
) -> None:
    """One step's forwards and backwards under the tracker, gradients reduced after the last micro-batch (or after
    each, strategy_config.sync_each_batch), each micro-batch cut for the sequence group as a run cuts it."""
    model, gathered = sharded.model, stays_gathered(sharded.model)
    for index, batch in enumerate(micro_batches):
        before_micro_batch(model, index == len(micro_batches) - 1, each, gathered)
        if sharded.sp_group is not None:
            with unset_fake_temporarily():
                batch = sharded.variant.shard_batch(batch, sharded.sp_group)
        loss(model, index, batch, 0.0).loss_sum.backward()
        tracker.reset_mod_stats()


def attention_per_rank(cfg: JobConfig, text_config: Any) -> dict[str, int]:
    """One decoder layer's attention on a rank, computed from the layout (issue 48). Ulysses (k) all-to-alls the
    heads: a rank attends with ceil(heads / k) heads (its key/value heads repeated when fewer than k) over the whole
    sequence; context parallel (c) holds chunks r and 2c-1-r of 2c: a rank's T/c queries attend over all T keys,
    all-gathered. The sequence is padded as the run pads it (to a multiple of k, or of 2 c k). The scores, [queries,
    keys] per head, are what eager attention (and a dense document mask, per row) materialises; fused kernels never
    do. Tensor parallelism (t) leaves a rank heads / t of them before Ulysses divides those."""
    k, c, t = cfg.model.ulysses_size, cfg.model.context_parallel_size, cfg.model.tensor_parallel_size
    multiple = 2 * c * k if c > 1 else k
    keys = -(-cfg.data.seq_len // multiple) * multiple
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    heads, kv_heads = heads // t, kv_heads // t
    dtype = cfg.strategy_args.strategy_config.param_dtype or cfg.model.dtype
    itemsize, batch = torch_dtype(dtype).itemsize, cfg.training.per_device_train_batch_size
    heads_per_rank, kv_per_rank = -(-heads // k), -(-kv_heads // k)
    queries = keys // c
    return {
        "tokens_per_rank": keys // (k * c),
        "heads_per_rank": heads_per_rank,
        "queries_per_rank": queries,
        "keys_per_rank": keys,
        "scores_bytes": batch * heads_per_rank * queries * keys * itemsize,
        "keys_values_bytes": 2 * batch * kv_per_rank * keys * head_dim * itemsize,
    }


def _training_loss(
    sharded: ShardedModel, cfg: JobConfig, micro_batches: list[Batch]
) -> tuple[MicroBatchLoss, list[Batch]]:
    """The loss a run of this model computes, and the micro-batches its model reads (real values: sharding a batch
    reads them, its documents and its padding). A causal LM: next-token cross-entropy, chunked through its LM head
    above a 32k vocabulary. A value or reward model (trained through the API, its head num_labels wide): its values
    or scores at every position under a stand-in loss_fn, as `Strategy.train_step` computes them; the caller's own
    loss on [B, T] values or [B] scores adds nothing that counts."""
    model, head = sharded.model, sharded.variant.head
    if not isinstance(head, ValueHead):
        install_token_head(model)
        vocab = model.get_output_embeddings().weight.shape[0]  # type: ignore[operator]
        chunk = chunk_tokens(cfg.training.loss_chunk_tokens, vocab, cfg.model.tensor_parallel_size)
        return TokenCrossEntropy(chunk), micro_batches
    head.install(model, torch.device("cpu"), "fsdp2kit plan")
    keys = set(inspect.signature(model.forward).parameters) - {"labels"}
    model_batches = [head.model_batch(batch, keys) for batch in micro_batches]
    return HeadOutputLoss(_summed_outputs, micro_batches, sharded.sp_group, 0, head=head), model_batches


def _summed_outputs(outputs: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The stand-in loss_fn of a value or reward model's trace: its outputs summed, one unit of weight."""
    return outputs.sum(), torch.ones(())


def computed_sizes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Per-rank bytes from the shard shapes alone: what the ZeRO tables count. AdamW keeps two moments per parameter,
    Muon one momentum buffer per matrix (and gathers a whole matrix while it orthogonalises it). A delta weight sync
    keeps one bf16 copy of the rank's shards in host memory (a tensor sent whole by one rank, such as fused experts,
    is that rank's whole: more there, less elsewhere), and a background sync a second while it runs."""

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        return local.numel() * local.element_size()

    params = list(dict.fromkeys(model.parameters()))
    trainable = [p for p in params if p.requires_grad]
    matrices = {id(p) for p in optimizer.matrices} if isinstance(optimizer, MuonWithAdamW) else set()
    gathered = (
        {"muon_gathered_matrix": gathered_matrix_bytes(optimizer)} if isinstance(optimizer, MuonWithAdamW) else {}
    )
    groups = []  # unsharded bytes of each fully_shard group, in its compute dtype (float8 where gathered in float8)
    for state in fsdp_states(model):
        if (group := state._fsdp_param_group) is not None:
            groups.append(
                sum(
                    fp._orig_size.numel() * gathered_element_size(fp.sharded_param, fp.param_dtype or fp.orig_dtype)
                    for fp in group.fsdp_params
                )
            )
    return {
        "sharded_params": sum(local_bytes(p) for p in params),
        "sharded_grads": sum(local_bytes(p) for p in trainable),
        "optimizer_states": sum((1 if id(p) in matrices else 2) * local_bytes(p) for p in trainable),
        "largest_unsharded_group": max(groups, default=0),
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        **gathered,
        # host memory, not the device's: a delta weight sync's diff base (Strategy.weight_sender, bf16 rollout)
        "weight_sync_host_bf16": sum(2 * local_bytes(p) // p.element_size() for p in params),
    }


_OFF_DEVICE = ("sharded_param", "sharded_grad", "optstate")  # where CPUOffloadPolicy keeps them: host memory


def predict(source: ConfigSource, world_size: int, extra: list[str] = ()) -> dict[str, object]:  # type: ignore[assignment]
    """The traced prediction for the config plus `extra` --set lines. With offload_policy the step is traced
    without it and the offloaded categories (sharded parameters, gradients, optimizer states) are taken out."""
    cfg = source.load(list(extra))
    offload = cfg.strategy_args.strategy_config.offload_policy
    if offload:
        cfg = source.load([*extra, f"{_STRATEGY}.offload_policy=false", f"{_STRATEGY}.pin_memory=false"])
    traced = trace_step_memory(cfg, world_size)
    if not offload:
        return {**traced, "source": "traced"}
    categories = dict(traced["categories"])  # type: ignore[call-overload]
    host = {key: categories.pop(key, 0) for key in _OFF_DEVICE}
    return {
        **traced,
        "peak_bytes": int(traced["peak_bytes"]) - sum(host.values()),  # type: ignore[call-overload]
        "categories": categories,
        "host_bytes": sum(host.values()),
        "source": "computed (traced without offload, minus what offload keeps on the host)",
    }


def _variant(strategy: str, recompute: bool) -> list[str]:
    return [*STRATEGIES[strategy], f"model.gradient_checkpointing={str(recompute).lower()}"]


def strategy_table(source: ConfigSource, world_size: int) -> list[dict[str, object]]:
    """Seed 002's table for this model, batch and world size: each strategy with and without recompute
    (traced), and FULL_SHARD with CPU offload (computed from the traced FULL_SHARD rows)."""
    rows: list[dict[str, object]] = []
    for recompute in (False, True):
        for strategy in STRATEGIES:
            try:
                result = predict(source, world_size, _variant(strategy, recompute))
            except UserError as exc:  # e.g. NO_SHARD with an explicit fsdp_size
                rows.append({"strategy": strategy, "recompute": recompute, "offload": False, "error": str(exc)})
                continue
            rows.append(_row(strategy, recompute, False, result))
            if strategy == "FULL_SHARD":
                categories = result["categories"]
                host = sum(categories.get(key, 0) for key in _OFF_DEVICE)  # type: ignore[attr-defined]
                offloaded = {**result, "peak_bytes": result["peak_bytes"] - host, "source": "computed"}  # type: ignore[operator]
                rows.append(_row(strategy, recompute, True, offloaded))
    return rows


def _row(strategy: str, recompute: bool, offload: bool, result: dict[str, object]) -> dict[str, object]:
    return {
        "strategy": strategy,
        "recompute": recompute,
        "offload": offload,
        "peak_bytes": result["peak_bytes"],
        "source": "computed" if offload else result["source"],
    }


def _micro_batch_choices(cfg: JobConfig) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs keeping the per-rank batch of a step, largest micro-batch first."""
    per_rank = cfg.training.per_device_train_batch_size * cfg.training.gradient_accumulation_steps
    return [(size, per_rank // size) for size in range(per_rank, 0, -1) if per_rank % size == 0]


def candidate_configs(source: ConfigSource) -> Iterator[dict[str, object]]:
    """Every configuration of the budget search, in an order of expected speed: no offload before offload, no
    recompute before recompute, larger micro-batches before smaller, less sharding before more (communication).
    The per-rank batch of a step is kept (micro-batch x accumulation)."""
    choices = _micro_batch_choices(source.load())
    for offload in (False, True):
        for recompute in (False, True):
            for micro_batch, accumulation in choices:
                batch = [
                    f"training.per_device_train_batch_size={micro_batch}",
                    f"training.gradient_accumulation_steps={accumulation}",
                ]
                for strategy in ("FULL_SHARD",) if offload else STRATEGIES:
                    overrides = [*_variant(strategy, recompute), *batch]
                    if offload:
                        overrides.append(f"{_STRATEGY}.offload_policy=true")
                    yield {
                        "overrides": overrides,
                        "strategy": strategy,
                        "recompute": recompute,
                        "offload": offload,
                        "micro_batch": micro_batch,
                        "accumulation": accumulation,
                    }


def planned_fit(
    source: ConfigSource, world_size: int, budget_bytes: int, candidate: dict[str, object]
) -> dict[str, object] | None:
    """The candidate with its predicted peak when that fits the budget; None when it does not or is invalid."""
    try:
        result = predict(source, world_size, candidate["overrides"])  # type: ignore[arg-type]
    except UserError:  # e.g. NO_SHARD with an explicit fsdp_size
        return None
    if result["peak_bytes"] > budget_bytes:  # type: ignore[operator]
        return None
    row = _row(str(candidate["strategy"]), bool(candidate["recompute"]), bool(candidate["offload"]), result)
    return {**candidate, **row}


def fitting_candidates(source: ConfigSource, world_size: int, budget_bytes: int) -> Iterator[dict[str, object]]:
    """The candidates that fit, in `candidate_configs`' order, each with its predicted peak."""
    for candidate in candidate_configs(source):
        if (fits := planned_fit(source, world_size, budget_bytes, candidate)) is not None:
            yield fits


def fastest_within(source: ConfigSource, world_size: int, budget_bytes: int) -> dict[str, object] | None:
    """The first configuration that fits, in the order of `fitting_candidates`: the heuristic answer."""
    return next(fitting_candidates(source, world_size, budget_bytes), None)


def plan_report(source: ConfigSource, world_size: int, budget_gb: float | None) -> dict[str, object]:
    report: dict[str, object] = {"world_size": world_size, **predict(source, world_size)}
    report["strategies"] = strategy_table(source, world_size)
    if budget_gb is not None:
        report["budget"] = {"gb": budget_gb, "fits": fastest_within(source, world_size, int(budget_gb * GIB))}
    return report


def print_plan(report: dict[str, object], as_json: bool) -> None:
    """The report as a JSON object or tables. With a measured budget answer (`plan_measure`) the heuristic's pick
    is named here and the --set lines are the measured winner's, printed after the measurement's table."""
    if as_json:
        print(json.dumps(report), flush=True)
        return
    from rich.console import Console
    from rich.table import Table

    console = Console()
    world_size = report["world_size"]
    for line in _headline(report):
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    categories = Table("at the peak (traced)", "GiB")
    for key, value in report["categories"].items():  # type: ignore[attr-defined]
        categories.add_row(key, _gib(value))
    console.print(categories)
    computed = Table("from the shard shapes (computed)", "GiB")
    for key, value in report["computed"].items():  # type: ignore[attr-defined]
        computed.add_row(key, _gib(value))
    console.print(computed)
    attention = Table("one layer's attention on a rank (computed)", "value")
    for key, value in report["attention"].items():  # type: ignore[attr-defined]
        if key == "scores_bytes":
            key += " (in the peak)" if report.get("scores_in_peak") else " (not in the peak)"
        attention.add_row(key, _gib(value) + " GiB" if key.startswith(_BYTES) else str(value))
    console.print(attention)
    console.print(_scores_note(bool(report.get("scores_in_peak"))), soft_wrap=True, markup=False, highlight=False)
    strategies = Table("strategy", "recompute", "offload", "peak GiB", "how")
    for row in report["strategies"]:  # type: ignore[attr-defined]
        peak = _gib(row["peak_bytes"]) if "peak_bytes" in row else row["error"]
        strategies.add_row(row["strategy"], str(row["recompute"]), str(row["offload"]), peak, row.get("source", ""))
    console.print(strategies)
    if "budget" in report:
        _print_budget(console, report["budget"], world_size)  # type: ignore[arg-type]


_BYTES = ("scores_bytes", "keys_values_bytes")


def _scores_note(in_peak: bool) -> str:
    """What scores_bytes is: one layer's [heads, queries, keys] scores, which only eager attention stores."""
    if in_peak:
        return "scores_bytes: one layer's attention scores, which eager attention stores: the traced peak holds them"
    return (
        "scores_bytes: what eager attention would store for one layer; this config's attention (sdpa, FlexAttention "
        "or flash) never stores them, and neither the peak nor any figure above counts them"
    )


def _headline(report: dict[str, object]) -> list[str]:
    """Which device the plan is for, its peak, what its figures are, and how packed documents are attended there (and
    on this machine, where that differs), each in `check`'s words for that device."""
    planned, here = report.get("planned_device", PLANNED_DEVICE.type), report.get("this_device")
    traced_on = f"; this machine: {here}" if here and here != planned else ""
    peak = _gib(report["peak_bytes"])
    lines = [
        f"planned for: {planned} (its memory, traced on the CPU with fake tensors{traced_on})",
        f"per-rank memory at {report['world_size']} rank(s), GiB ({report['source']}): peak {peak}",
        TRACKED_BYTES_NOTE,
    ]
    if report.get("document_attention"):
        lines.append(f"document_attention on {planned} (counted): {report['document_attention']}")
    if here and here != planned and report.get("document_attention_here"):
        lines.append(
            f"document_attention on this machine ({here}, as `check` and `train` run here, not counted): "
            f"{report['document_attention_here']}"
        )
    return lines


def _gib(value: object) -> str:
    return f"{int(value) / GIB:.3f}"  # type: ignore[call-overload]


def _print_budget(console: object, budget: dict[str, object], world_size: object) -> None:
    fits, budget_gb = budget["fits"], budget["gb"]
    if fits is None:
        console.print(f"nothing fits {budget_gb} GB per rank at {world_size} rank(s): add ranks or cut seq_len")  # type: ignore[attr-defined]
    elif "measured" in budget:
        pick = ", ".join(line.rsplit(".", 1)[-1] for line in fits["overrides"])  # type: ignore[index]
        console.print(f"heuristic pick within {budget_gb} GB (first that fits, not measured): {pick}")  # type: ignore[attr-defined]
    else:
        console.print(f"fastest within {budget_gb} GB per rank ({_gib(fits['peak_bytes'])} GiB):")  # type: ignore[attr-defined, index]
        for line in fits["overrides"]:  # type: ignore[index]
            print(f"--set {line}", flush=True)
