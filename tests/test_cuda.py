"""What only a GPU shows (`pytest -m cuda`; skipped where no CUDA device is visible, so CI stays CPU): the demo, the
GRPO example, CPU offload of the shards, compile, MoE/LoRA/VL steps and the chunked loss on CUDA, `offload_states`'
speed and exactness, and `plan` against the CUDA allocator's peak. `benchmarks/gpu_suite.sh` runs it with
FSDP2KIT_GPU_RESULTS set: each measured figure is then appended there as one JSON line."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest
import torch
from conftest import read_metrics, run_cli, run_python, set_args, token_batch
from test_strategy import strategy
from torch.distributed.tensor import DTensor

from fsdp2kit.memory_plan import ConfigSource, predict
from fsdp2kit.train.host_states import state_tensors

pytestmark = pytest.mark.cuda

RESULTS_ENV = "FSDP2KIT_GPU_RESULTS"
BF16 = {"param_dtype": "bf16", "reduce_dtype": "fp32"}


def record(case: str, **figures: object) -> None:
    """A measured figure: printed, and appended to $FSDP2KIT_GPU_RESULTS (gpu_suite.sh) when set."""
    line = json.dumps({"case": case, "device": torch.cuda.get_device_name(), **figures})
    print(line)
    if os.environ.get(RESULTS_ENV):
        with open(os.environ[RESULTS_ENV], "a") as handle:
            handle.write(line + "\n")


def job(model: dict | None = None, strategy_config: dict | None = None, **training: object) -> dict:
    """A Strategy config of the built-in tiny Llama (or `model`), bf16 compute over fp32 master weights."""
    return {
        "model": {"name_or_path": "builtin:tiny-llama", "config": {"num_hidden_layers": 2}, **(model or {})},
        "training": {"learning_rate": 1e-3, "lr_scheduler_type": "constant", "max_steps": 20, "seed": 0, **training},
        "strategy_args": {"strategy_config": {**BF16, **(strategy_config or {})}},
    }


def losses(config: dict, steps: int, rows: int = 4, length: int = 128) -> list[float]:
    """The default loss of `steps` train_steps on one seeded token batch (which it learns: the loss falls)."""
    batch = token_batch(rows, length)
    batch["labels"] = batch["input_ids"]
    with strategy(config) as s:
        return [s.train_step([batch])["loss"] for _ in range(steps)]


# ---- the demo and the examples ------------------------------------------------------------------------------------


def test_the_demo_trains_on_cuda(tmp_path):
    settings = {"training.max_steps": 20, "training.save_steps": 0, "training.export_hf": False}
    settings |= {"training.report_to": [], "training.output_dir": str(tmp_path / "run")}
    result = run_cli("train", "examples/demo.yaml", "--nproc", "1", *set_args(settings))
    assert result.returncode == 0, result.stderr[-3000:]
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == list(range(1, 21))
    assert {r["peak_mem_kind"] for r in records} == {"cuda_max_allocated"}
    assert all(0 < r["mfu"] < 1 for r in records)
    first, last = (statistics.mean(r["loss"] for r in part) for part in (records[:5], records[-5:]))
    assert last < first - 0.5, (first, last)


def test_the_grpo_example_learns_on_cuda(tmp_path):
    """examples/rl_grpo.py on one GPU (it stopped at its stats line: a CPU tensor among CUDA ones), with as many
    samples per step as its CPU test's two ranks."""
    command = ["examples/rl_grpo.py", "--nproc", "1", "--steps", "15", "--prompts", "8", "--output-dir", str(tmp_path)]
    result = run_python(*command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 16))
    first, last = (sum(r["reward"] for r in part) / 5 for part in (records[:5], records[-5:]))
    assert last > first + 0.3, (first, last)


# ---- offload ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pin_memory", [False, True])
def test_offload_policy_trains_like_the_run_without(pin_memory):
    """strategy_config.offload_policy: the shards live (pinned, when asked) on the host, where AdamW steps them;
    20 steps give the losses of the run without offload to bf16's precision."""
    plain = losses(job(), 20)
    offloaded = job(strategy_config={"offload_policy": True, "pin_memory": pin_memory})
    batch = token_batch(4, 128)
    batch["labels"] = batch["input_ids"]
    with strategy(offloaded) as s:
        shards = [p.to_local() for p in s.model.parameters()]
        assert {t.device.type for t in shards} == {"cpu"}
        assert all(t.is_pinned() == pin_memory for t in shards if t.numel())
        assert all(b.is_cuda for b in s.model.buffers())
        run = [s.train_step([batch])["loss"] for _ in range(20)]
        assert {v.device.type for state in s.optimizer.state.values() for v in state.values() if v.dim()} == {"cpu"}
    assert plain[-1] < plain[0] - 1.0
    assert run == pytest.approx(plain, rel=2e-2, abs=2e-2)


def _local_snapshot(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [(t.to_local() if isinstance(t, DTensor) else t).detach().clone() for t in tensors]


def test_offload_states_round_trip_is_bitwise_at_10_gb_per_s_each_way():
    """A ~0.5B model's parameters and AdamW state (about 6 GB): offload frees the device memory, load brings every
    byte back, at >= 10 GB/s each way once the host buffers exist (the first offload allocates them)."""
    big = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8, "vocab_size": 32000}
    big |= {"num_attention_heads": 16, "num_key_value_heads": 4}
    with strategy(job(model={"config": big})) as s:
        batch = token_batch(2, 64)
        s.train_step([batch])
        kinds = ("model_params", "optimizer_states")
        tensors = [t for kind in kinds for t in state_tensors(s.model, s.optimizer, kind)]
        before = _local_snapshot(tensors)
        moved = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in _locals(tensors)}.values())
        s.offload_states()
        s.load_states()  # the host buffers exist from here on
        allocated = torch.cuda.memory_allocated()
        start = time.perf_counter()
        s.offload_states()
        offload_s = time.perf_counter() - start
        freed = allocated - torch.cuda.memory_allocated()
        start = time.perf_counter()
        s.load_states()
        load_s = time.perf_counter() - start
        after = _local_snapshot(tensors)
        s.train_step([batch])  # and training goes on
    record("offload_states", bytes=moved, offload_gb_s=moved / offload_s / 1e9, load_gb_s=moved / load_s / 1e9)
    assert moved > 4e9 and freed >= 0.99 * moved
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert moved / offload_s >= 10e9 and moved / load_s >= 10e9, (moved / offload_s / 1e9, moved / load_s / 1e9)


def _locals(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


# ---- compile, model variants, the chunked loss -------------------------------------------------------------------


def test_compile_trains_like_eager():
    eager = losses(job(), 10)
    compiled = losses(job(compile=True), 10)
    assert compiled == pytest.approx(eager, rel=2e-2, abs=2e-2)


@pytest.mark.parametrize(
    "sharding",
    [{"reshard_after_forward": False}, {"sharding_strategy": "NO_SHARD", "reshard_after_forward": False}],
    ids=["zero2", "no_shard"],
)
def test_groups_kept_gathered_between_micro_batches_train_like_zero3_and_are_released_after_each_step(sharding):
    """ZeRO-2 and NO_SHARD keep every group gathered between the micro-batches of a step and release it after the
    last backward (parallel/fsdp.py:before_micro_batch). On CUDA, with FSDP2's own streams, three micro-batches a
    step give ZeRO-3's losses to bf16's precision, and after each step the parameters are shards again."""
    batch = token_batch(6, 128)
    micro_batches = [{key: value[i : i + 2] for key, value in batch.items()} for i in (0, 2, 4)]

    def run(config: dict) -> list[float]:
        with strategy(config) as s:
            weight = s.model.model.layers[0].mlp.up_proj
            steps = []
            for _ in range(10):
                steps.append(s.train_step(micro_batches)["loss"])
                assert isinstance(weight.weight, DTensor)  # released: the gathered copy is gone
            return steps

    zero3 = run(job())
    assert zero3[-1] < zero3[0] - 0.5
    assert run(job(strategy_config=sharding)) == pytest.approx(zero3, rel=2e-2, abs=2e-2)


@pytest.mark.parametrize(
    "model",
    [
        {"name_or_path": "builtin:tiny-qwen3-moe"},
        {"lora": {"rank": 8}},
        {"name_or_path": "builtin:tiny-qwen2.5-vl", "config": {}},  # text-only batches: the tower's dummy image
    ],
    ids=["moe", "lora", "vl"],
)
def test_moe_lora_and_vl_models_learn_on_cuda(model):
    run = losses(job(model=model, learning_rate=3e-3), 8)
    assert all(torch.isfinite(torch.tensor(run))) and run[-1] < run[0] - 0.5, run  # 8.3 to 4.3-7.5 on a CPU


def test_the_chunked_loss_matches_the_unchunked_one_in_bf16():
    """A 152k vocabulary (the chunked head's case): the losses of 5 steps with and without chunks agree to bf16's
    precision."""
    qwen = {"name_or_path": "builtin:tiny-qwen3", "config": {"num_hidden_layers": 2, "vocab_size": 151936}}
    whole = losses(job(model=qwen, loss_chunk_tokens=0), 5)
    chunked = losses(job(model=qwen, loss_chunk_tokens=128), 5)
    assert chunked == pytest.approx(whole, rel=1e-2, abs=1e-2)


# ---- plan against the CUDA allocator ------------------------------------------------------------------------------

PLAN_SHAPE = [
    "model.dtype=bf16",
    "model.config.hidden_size=1024",
    "model.config.intermediate_size=4096",
    "model.config.num_hidden_layers=8",
    "model.config.num_attention_heads=16",
    "model.config.num_key_value_heads=4",
    "model.config.vocab_size=32000",
    "strategy_args.strategy_config.param_dtype=bf16",
    "strategy_args.strategy_config.reduce_dtype=fp32",
    "data.seq_len=2048",
    "training.per_device_train_batch_size=4",
    "training.gradient_accumulation_steps=1",
]


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recompute"])
def test_plan_predicts_the_cuda_peak_within_10_percent(tmp_path, recompute):
    overrides = [*PLAN_SHAPE, f"model.gradient_checkpointing={str(recompute).lower()}"]
    predicted = predict(ConfigSource("examples/demo.yaml", overrides, None, None), 1)["peak_bytes"]
    run = ["training.max_steps=4", "training.save_steps=0", "training.export_hf=false", "training.report_to=[]"]
    run.append(f"training.output_dir={tmp_path / 'run'}")
    sets = [arg for item in [*overrides, *run] for arg in ("--set", item)]
    result = run_cli("train", "examples/demo.yaml", "--nproc", "1", *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = max(r["peak_mem_bytes"] for r in read_metrics(tmp_path / "run"))
    record(f"plan_vs_cuda_peak_{'recompute' if recompute else 'plain'}", plan=predicted, cuda_peak=measured)
    assert predicted == pytest.approx(measured, rel=0.10)


def test_a_delta_weight_sync_from_cuda_keeps_a_rollout_model_bitwise_equal():
    """The shards live on the GPU: each sync copies this rank's bf16 blocks to the host, diffs them there and the
    rollout model (on the GPU too) ends with the trainer's weights cast to bf16, bit for bit; a background sync's
    step costs at most 10% more than a step alone (median of 5 pairs, recorded)."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.weight_sync import WeightReceiver

    batch = token_batch(4, 128)
    batch["labels"] = batch["input_ids"]
    with strategy(job(learning_rate=1e-6)) as s:
        rollout = AutoModelForCausalLM.from_config(s.sharded.source.hf_config, dtype=torch.bfloat16).cuda()
        receiver = WeightReceiver.for_model(rollout)
        sender = s.weight_sender(dtype=torch.bfloat16)
        sender.sync(receiver.version, receiver.receive)
        alone, beside = [], []
        for _ in range(5):
            start = time.perf_counter()
            s.train_step([batch])
            torch.cuda.synchronize()
            alone.append(time.perf_counter() - start)
            sender.start(receiver.version, receiver.receive)
            start = time.perf_counter()
            s.train_step([batch])
            torch.cuda.synchronize()
            beside.append(time.perf_counter() - start)
            stats = sender.wait()
            assert stats is not None and not stats.full and receiver.version == s.steps_done - 1
            sender.sync(receiver.version, receiver.receive)
            want = dict(s.full_weights(dtype=torch.bfloat16))
            assert all(torch.equal(receiver.tensors[name], tensor.to(rollout.device)) for name, tensor in want.items())
        ratio = statistics.median(beside) / statistics.median(alone)
        record("weight_sync_background", step_ratio=ratio, delta_fraction=stats.changed_fraction)
        assert ratio <= 1.10
