"""Memory: `training.track_memory` counts live tensors by category, and `fsdp2kit plan` (fake tensors, no allocation)
predicts the per-rank peak a real run measures."""

from __future__ import annotations

import json

import pytest
from conftest import make_hf_folder, process_group, read_metrics, run_cli, run_python, sharded_model

from fsdp2kit.cli import main
from fsdp2kit.config import load_config
from fsdp2kit.memory_plan import ConfigSource, plan_report, predict

SMALL = [
    "model.config.num_hidden_layers=2",
    "data.seq_len=64",
    "training.per_device_train_batch_size=2",
    "training.gradient_accumulation_steps=2",
]
# About 50M parameters (7 layers of 768, 4096-token vocabulary), one short sample per micro-batch: widths and an
# optimizer state 20 times the tiny model's (the cost of a run grows with the parameters, so not more layers).
LLAMA_50M = [
    "model.config.hidden_size=768",
    "model.config.intermediate_size=2048",
    "model.config.num_hidden_layers=7",
    "model.config.num_attention_heads=12",
    "model.config.num_key_value_heads=4",
    "data.seq_len=32",
    "training.per_device_train_batch_size=1",
    "training.gradient_accumulation_steps=1",
]
# Qwen3-MoE's 4 experts a layer split over 2 ranks (expert parallelism): the trace assumes balanced routing.
MOE_EP2 = [*SMALL, "model.name_or_path=builtin:tiny-qwen3-moe", "strategy_args.strategy_config.ep_size=2"]
# The head and loss in chunks of 16 tokens (fake tensors: every row counted, where the run skips untargeted ones).
CHUNKED = [*SMALL, "training.loss_chunk_tokens=16"]
# Context parallel 2, and Ulysses 2 with sdpa named, over the demo's packed documents: the run attends by blocks
# (the CPU's path); the trace as CUDA would, whose memory the plan predicts: CP through FlexAttention (no mask, no
# scores), Ulysses' sdpa with the dense mask.
CONTEXT_PARALLEL = [*SMALL, "model.context_parallel_size=2"]
ULYSSES_SDPA = [*SMALL, "model.ulysses_size=2", "model.attn_implementation=sdpa"]
MODELS = {"tiny": SMALL, "50M": LLAMA_50M, "moe-ep2": MOE_EP2, "tiny-chunked": CHUNKED}
MODELS |= {"tiny-cp2": CONTEXT_PARALLEL, "tiny-ulysses2-sdpa": ULYSSES_SDPA}
ZERO = {
    3: ["strategy_args.strategy_config.reshard_after_forward=true"],
    2: ["strategy_args.strategy_config.reshard_after_forward=false"],
}


def _measured(tmp_path, nproc: int, overrides: list[str]) -> dict:
    """The step record with the highest tracked peak of a real 2-step run."""
    run = [
        f"training.output_dir={tmp_path / 'run'}",
        "training.max_steps=2",
        "training.track_memory=true",
        "training.export_hf=false",
        "training.report_to=[]",
    ]
    sets = [arg for item in [*overrides, *run] for arg in ("--set", item)]
    result = run_cli("train", "examples/demo.yaml", "--nproc", nproc, *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    return max(read_metrics(tmp_path / "run"), key=lambda r: r["peak_mem_bytes"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, nproc, zero, recompute",
    [
        ("tiny", 1, 3, False),
        ("tiny", 2, 2, True),
        ("tiny", 4, 3, True),
        ("50M", 2, 3, False),
        ("moe-ep2", 2, 3, False),
        ("tiny-chunked", 1, 3, False),
        ("tiny-cp2", 2, 3, False),
        ("tiny-ulysses2-sdpa", 2, 3, False),
    ],
)
def test_plan_predicts_the_measured_peak(tmp_path, model, nproc, zero, recompute):
    overrides = [*MODELS[model], *ZERO[zero]]
    overrides.append(f"model.gradient_checkpointing={str(recompute).lower()}")
    predicted = predict(ConfigSource("examples/demo.yaml", overrides, None, None), nproc)
    measured = _measured(tmp_path, nproc, overrides)

    assert measured["peak_mem_kind"] == "cpu_live_tensors"
    assert measured["peak_rss_bytes"] > measured["peak_mem_bytes"]  # RSS also holds the runtime and libraries
    # The accounting itself: this rank's parameter shards are exactly what the shard shapes say.
    assert measured["peak_mem_categories"]["sharded_param"] == predicted["computed"]["sharded_params"]
    assert predicted["peak_bytes"] == pytest.approx(measured["peak_mem_bytes"], rel=0.10)


@pytest.mark.slow
def test_plan_table_and_budget(run_main):
    """The table by strategy shards memory as ZeRO says and recompute saves activations; `plan --budget-gb` answers
    with a configuration that fits, printed as --set lines that load."""
    tiny = [  # four layers: with fewer, ZeRO-3's backward all-gather buffers outweigh what it frees
        "data.seq_len=32",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=1",
    ]
    report = plan_report(ConfigSource("examples/demo.yaml", tiny, None, None), 2, None)
    rows = {(r["strategy"], r["recompute"], r["offload"]): r["peak_bytes"] for r in report["strategies"]}
    assert len(rows) == 8
    for recompute in (False, True):
        assert rows["NO_SHARD", recompute, False] > rows["SHARD_GRAD_OP", recompute, False]
        assert rows["SHARD_GRAD_OP", recompute, False] > rows["FULL_SHARD", recompute, False]
        assert rows["FULL_SHARD", recompute, False] > rows["FULL_SHARD", recompute, True]
        assert rows["FULL_SHARD", True, False] < rows["FULL_SHARD", False, False]
    assert report["peak_bytes"] == rows["FULL_SHARD", False, False]  # the demo is FULL_SHARD without recompute

    # Between FULL_SHARD with recompute and the next smallest without offload: that is the fastest that fits.
    next_smallest = min(rows["SHARD_GRAD_OP", True, False], rows["FULL_SHARD", False, False])
    budget = (rows["FULL_SHARD", True, False] + next_smallest) / 2 / 1024**3
    sets = [arg for item in tiny for arg in ("--set", item)]
    code, out, err = run_main("plan", "examples/demo.yaml", "--nproc", "2", "--budget-gb", f"{budget:.6f}", *sets)
    assert code == 0, err[-3000:]
    lines = [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith("--set ")]
    assert "strategy_args.strategy_config.sharding_strategy=FULL_SHARD" in lines
    assert "model.gradient_checkpointing=true" in lines
    chosen = predict(ConfigSource("examples/demo.yaml", [*tiny, *lines], None, None), 2)
    assert chosen["peak_bytes"] == rows["FULL_SHARD", True, False] <= budget * 1024**3


@pytest.mark.parametrize("budget", ["0", "nan", "inf"])
def test_plan_refuses_a_bad_budget(budget, capsys):
    assert main(["plan", "examples/demo.yaml", "--budget-gb", budget]) == 2
    given = float(budget)
    assert (
        capsys.readouterr().err == f"error: --budget-gb {given}: give the memory per rank in GiB, a finite number > 0\n"
    )


def test_plan_leaves_no_rank_behind_in_this_process():
    """`plan` traces as fake rank 0. DTensor caches sharding results under a key that compares device meshes without
    their rank: left in place, a later process group of rank 1 in the same process (a notebook, these tests) got
    DTensors on plan's rank-0 mesh, and so rank 0's rows of every weight."""
    tiny = ["model.config.num_hidden_layers=2", "data.seq_len=32", "training.per_device_train_batch_size=1"]
    plan_report(ConfigSource("examples/demo.yaml", tiny, None, None), 2, None)
    with process_group(size=2, rank=1) as runtime:
        model = sharded_model(load_config("examples/demo.yaml", tiny), runtime, training=False).model
        assert {tuple(p.device_mesh.get_coordinate()) for p in model.parameters()} == {(1,)}  # a list on torch 2.10


@pytest.mark.slow
def test_plan_measure_picks_the_fastest_measured_configuration(run_main):
    """`plan --budget-gb X --measure` trains a few real steps of each configuration that fits (in the heuristic's
    order, skipping those that cannot win) and picks the one with the most measured tokens/s."""
    tiny = [
        "model.config.num_hidden_layers=1",
        "data.seq_len=32",
        "training.per_device_train_batch_size=1",
        "training.gradient_accumulation_steps=2",
    ]
    sets = [arg for item in tiny for arg in ("--set", item)]
    code, out, err = run_main(
        "plan", "examples/demo.yaml", "--budget-gb", "1", "--measure", "--measure-steps", "2", "--json", *sets
    )
    assert code == 0, err[-3000:]
    measured = json.loads(out.splitlines()[-1])["budget"]["measured"]
    rows = measured["candidates"]
    runs = [row for row in rows if row["status"] == "measured"]
    assert {(r["strategy"], r["micro_batch"]) for r in runs} == {
        (s, m) for s in ("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD") for m in (2, 1)
    }
    assert all(r["peak_bytes"] <= 1024**3 and r["tokens_per_s"] > 0 for r in runs)
    # Recompute with the same sharding and micro-batch as a measured run cannot win; offload needs CUDA.
    assert all(row["status"] == "skipped" for row in rows if row["recompute"] or row["offload"])
    fastest = measured["fastest"]
    assert fastest["tokens_per_s"] == max(r["tokens_per_s"] for r in runs)
    assert measured["heuristic_pick"] == 1
    assert measured["heuristic_agrees"] == (fastest["index"] == 1)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--measure"], "--measure measures the configurations that fit a budget: give --budget-gb X too"),
        (
            ["--budget-gb", "1", "--measure", "--measure-steps", "1"],
            "--measure-steps 1: give >= 2 (the first step warms up and is not timed)",
        ),
    ],
    ids=["no_budget", "one_step"],
)
def test_plan_measure_mistakes_exit_2_with_one_line(args, message, run_main):
    result = run_main("plan", "examples/demo.yaml", *args)
    assert result.returncode == 2
    assert result.stderr == f"error: {message}\n"


def test_sync_each_batch_holds_only_sharded_gradients():
    """strategy_config.sync_each_batch reduce-scatters after every micro-batch: between micro-batches each rank holds
    its gradient shard, not the whole unsharded gradient that skipping the sync accumulates (FSDP1's behaviour)."""
    tiny = [*SMALL, *ZERO[3]]
    source = ConfigSource("examples/demo.yaml", tiny, None, None)
    once = predict(source, 2)
    each = predict(source, 2, ["strategy_args.strategy_config.sync_each_batch=true"])
    assert "unsharded_grad" in once["categories"] and "unsharded_grad" not in each["categories"]
    assert each["categories"]["sharded_grad"] == once["computed"]["sharded_grads"]
    assert each["peak_bytes"] < once["peak_bytes"]


def test_cpu_ranks_share_one_heap_among_their_threads(tmp_path):
    """On CPU with peers, glibc is limited to one arena before gloo starts its threads (distributed.share_one_heap):
    threads that allocate then leave no heaps of their own, whose free memory no other thread could reuse. Set by
    `init_distributed`, and where a framework starts the process group itself (verl, ROLL), by importing
    `fsdp2kit.integrations` before it. One rank keeps glibc's arenas (its collectives move nothing). Counted with
    malloc_info in fresh processes: 2 ranks under torchrun each way, and one alone."""
    from pathlib import Path

    from fsdp2kit.distributed import free_port

    tests = Path(__file__).resolve().parent
    counts = {}
    for start in ("init_distributed", "framework"):
        script = tmp_path / f"heaps_{start}.py"
        call = f"import test_memory as t; t._heaps_after_threads({start!r})"
        script.write_text(f"import sys; sys.path.insert(0, {str(tests)!r}); {call}")
        launch = ("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port())
        counts[start] = run_python(*launch, script)
    counts["alone"] = run_python(tmp_path / "heaps_init_distributed.py")
    for name, done in counts.items():
        assert done.returncode == 0, done.stderr[-3000:]
        counts[name] = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("heaps ")]
    assert counts["init_distributed"] == counts["framework"] == [1, 1], counts
    assert len(counts["alone"]) == 1 and counts["alone"][0] > 1, counts


def _heaps_after_threads(start: str) -> None:
    """Print how many heaps glibc's malloc_info lists in this rank after its process group started (by
    `init_distributed`, or as a framework's worker starts it: `init_process_group` after importing its adapter), a
    collective, and 4 threads that allocated a tensor each."""
    import sys
    import threading

    import torch
    import torch.distributed as dist

    from fsdp2kit.distributed import malloc_heaps

    if start == "init_distributed":
        from fsdp2kit.distributed import init_distributed

        init_distributed(None)
    else:
        import fsdp2kit.integrations  # noqa: F401  (what a verl or ROLL worker imports first)

        dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1 << 16))
    threads = [threading.Thread(target=lambda: torch.ones(1 << 16).sum()) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sys.stdout.write(f"heaps {malloc_heaps()}\n")  # one write: the ranks share torchrun's (unbuffered) stdout
    sys.stdout.flush()
    dist.destroy_process_group()


def _steady_faults(strategy, batches: list[dict]) -> float:
    """The fewer page faults per step of two windows of 3 steps: one window can still catch the heap's last growth
    (a CI run under load once saw 5.3k a step after the export's 2 warm-up steps, against 28k returned)."""
    return min(_page_faults_per_step(strategy, batches, 3) for _ in range(2))


def _page_faults_per_step(strategy, batches: list[dict], steps: int) -> float:
    """Minor page faults of this process per `train_step` (each one a fresh page the kernel zeroes)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        strategy.train_step(batches)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def test_cpu_steps_reuse_freed_memory_instead_of_faulting_it_in(tmp_path):
    """On CPU the steps keep freed buffers for the next step (distributed.reuse_freed_memory): a steady-state step
    faults almost no fresh pages in, where returning every large buffer to the OS (the setting loading keeps)
    faults each one in again every step; after an export, which returns them, the steps reuse again. Measured in a
    fresh interpreter: the allocator is process-wide, and this process's heap carries every earlier test's."""
    from pathlib import Path

    tests = Path(__file__).resolve().parent
    probe = f"import sys; sys.path.insert(0, {str(tests)!r}); import test_memory as t; t._steps_faults(sys.argv[1])"
    done = run_python("-c", probe, tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    faults = json.loads(done.stdout.splitlines()[-1])
    reused = max(faults["reused"], faults["reused_after_export"])
    assert faults["returned"] > 8 * reused, faults


def _steps_faults(folder: str) -> None:
    """Print the minor page faults per steady-state step of a small model in this process: reusing freed memory,
    the same after an export, and returning large frees to the OS."""
    from pathlib import Path

    import torch

    import fsdp2kit
    import fsdp2kit.strategy
    from fsdp2kit.distributed import return_large_frees_to_os, shutdown

    # ~8 MiB MLP activations and ~31 MiB logits: above the 4 MiB mmap threshold loading uses, below the 32 MiB that
    # glibc's threshold can be raised to (a larger block is mapped afresh every time, whatever the setting)
    model = Path(folder) / "model"
    make_hf_folder(model, "tiny-llama", vocab_size=4096, hidden_size=256, intermediate_size=1024)
    config = {
        "model": {"name_or_path": str(model)},
        "training": {"lr_scheduler_type": "constant", "max_steps": 100, "output_dir": f"{folder}/out"},
    }
    batches = [{"input_ids": torch.randint(3, 4096, (4, 500), generator=torch.Generator().manual_seed(0))}]
    strategy = fsdp2kit.Strategy.from_config(config)
    _page_faults_per_step(strategy, batches, 4)  # the heap grows to the step's size
    faults = {"reused": _steady_faults(strategy, batches)}
    strategy.export_hf(Path(folder) / "hf")
    _page_faults_per_step(strategy, batches, 3)
    faults["reused_after_export"] = _steady_faults(strategy, batches)
    fsdp2kit.strategy.reuse_freed_memory = lambda device: None  # the steps no longer switch back
    return_large_frees_to_os()
    _page_faults_per_step(strategy, batches, 1)
    faults["returned"] = _page_faults_per_step(strategy, batches, 2)
    shutdown()
    print(json.dumps(faults))


def _page_faults_per_step(strategy, batches: list[dict], steps: int) -> float:
    """Minor page faults of this process per `train_step` (each one a fresh page the kernel zeroes)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(steps):
        strategy.train_step(batches)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / steps


def test_plan_computes_one_layers_attention_per_rank_under_ulysses_and_context_parallel():
    """Issue 48 (5): under Ulysses k a rank attends with heads/k over the whole sequence, under context parallel c with
    its T/c queries over all T keys (gathered): the scores shrink by k x c, the gathered keys and values by k only,
    and the rank holds T/(k c) tokens; the sequence is padded as the run pads it (a multiple of 2 c k)."""
    from transformers import AutoConfig

    from fsdp2kit.memory_plan import attention_per_rank
    from fsdp2kit.models.builtin import BUILTIN_MODELS

    settings = dict(BUILTIN_MODELS["tiny-llama"])  # 4 heads, 2 key/value heads of 64
    text = AutoConfig.for_model(settings.pop("model_type"), **settings)
    batch, fp32 = 2, 4
    sizes = {}
    for k, c in ((1, 1), (2, 1), (1, 2), (2, 2)):
        cfg = load_config(
            "examples/demo.yaml",
            ["data.seq_len=60", f"training.per_device_train_batch_size={batch}", f"model.ulysses_size={k}"]
            + [f"model.context_parallel_size={c}"],
        )
        sizes[k, c] = attention_per_rank(cfg, text)
    assert sizes[1, 1] == {
        "tokens_per_rank": 60,
        "heads_per_rank": 4,
        "queries_per_rank": 60,
        "keys_per_rank": 60,
        "scores_bytes": batch * 4 * 60 * 60 * fp32,
        "keys_values_bytes": 2 * batch * 2 * 60 * 64 * fp32,
    }
    assert (sizes[2, 1]["tokens_per_rank"], sizes[2, 1]["heads_per_rank"], sizes[2, 1]["keys_per_rank"]) == (30, 2, 60)
    assert sizes[2, 1]["scores_bytes"] * 2 == sizes[1, 1]["scores_bytes"]
    # context parallel 2: 60 tokens, a multiple of 4 (chunks r and 3-r of 4): 30 queries a rank over 60 keys
    cp2 = sizes[1, 2]
    assert (cp2["tokens_per_rank"], cp2["queries_per_rank"], cp2["keys_per_rank"]) == (30, 30, 60)
    assert sizes[1, 2]["scores_bytes"] == batch * 4 * 30 * 60 * fp32
    assert sizes[1, 2]["keys_values_bytes"] == sizes[1, 1]["keys_values_bytes"]  # all keys and values gathered
    # both: padded to a multiple of 8 (64 tokens), 16 a rank; 2 heads, 32 queries over 64 keys
    assert sizes[2, 2] == {
        "tokens_per_rank": 16,
        "heads_per_rank": 2,
        "queries_per_rank": 32,
        "keys_per_rank": 64,
        "scores_bytes": batch * 2 * 32 * 64 * fp32,
        "keys_values_bytes": 2 * batch * 1 * 64 * 64 * fp32,
    }


def test_plan_reports_the_attention_of_its_layout():
    """`plan`'s report carries the computed attention beside the traced peak: under Ulysses 2 at 2 ranks, 2 heads a
    rank over the whole sequence."""
    tiny = ["model.config.num_hidden_layers=2", "data.seq_len=32", "training.per_device_train_batch_size=1"]
    report = predict(ConfigSource("examples/demo.yaml", [*tiny, "model.ulysses_size=2"], None, None), 2)
    assert report["attention"] == {
        "tokens_per_rank": 16,
        "heads_per_rank": 2,
        "queries_per_rank": 32,
        "keys_per_rank": 32,
        "scores_bytes": 2 * 32 * 32 * 4,
        "keys_values_bytes": 2 * 1 * 32 * 64 * 4,
    }


@pytest.mark.slow
def test_plan_under_context_parallel():
    """Issue 48 (5), traced (needs branch `cp`'s runtime): with eager attention over 512 tokens the scores dominate a
    layer's activations; context parallel 2 at 2 ranks traces each rank's half of the queries against all keys, and
    the predicted peak falls by at least the computed scores' saving of one layer."""
    long = ["model.attn_implementation=eager", "data.seq_len=512", "training.per_device_train_batch_size=1"]
    long += ["training.gradient_accumulation_steps=1"]
    plain = predict(ConfigSource("examples/demo.yaml", long, None, None), 2)
    context = predict(ConfigSource("examples/demo.yaml", [*long, "model.context_parallel_size=2"], None, None), 2)
    assert context["attention"]["scores_bytes"] * 2 == plain["attention"]["scores_bytes"]
    saving = plain["attention"]["scores_bytes"] - context["attention"]["scores_bytes"]
    assert plain["peak_bytes"] - context["peak_bytes"] >= saving


def test_plan_of_context_parallel_counts_no_scores():
    """A CP rank attends (FlexAttention on CUDA, the blocks on a CPU) keeping no [heads, T/c, T] scores: the plan's
    trace of CP 2 over packed documents at 2048 tokens (one layer's scores 32 MiB) peaks within a quarter of that
    of Ulysses 2's (the same tokens a rank, no mask), not a layer's scores above it as the math kernel would."""
    tiny = ["model.config.num_hidden_layers=2", "data.seq_len=2048", "training.per_device_train_batch_size=1"]
    peaks = {}
    for layout in ("model.context_parallel_size=2", "model.ulysses_size=2"):
        report = predict(ConfigSource("examples/demo.yaml", [*tiny, layout], None, None), 2)
        peaks[layout] = report["peak_bytes"]
        if layout.startswith("model.context"):
            scores = report["attention"]["scores_bytes"]
            assert scores == 4 * 1024 * 2048 * 4
    difference = peaks["model.context_parallel_size=2"] - peaks["model.ulysses_size=2"]
    assert abs(difference) < scores / 4, (difference, scores)
