"""The training step and what surrounds it: loss normalisation by global token count, one gradient reduction per
step, clipping, the schedule, fp16 loss scaling and bf16, the non-finite guard, and the logs (console, TensorBoard,
W&B, profiler traces). Runs are in-process at 1 rank unless a second rank is the point."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import io
import itertools
import json
import sys
import types
from collections import Counter

import pytest
import torch
import yaml
from conftest import as_overrides, plain_model, read_metrics, reference_run, run_cli, set_args

from fsdp2kit.cli import main
from fsdp2kit.config.load import load_config
from fsdp2kit.data.builtin import corpus_documents
from fsdp2kit.data.samples import GlobalBatches, TrainingSamples
from fsdp2kit.errors import TrainingDiverged
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.train.grads import LossScaler, NonFiniteGuard, clip_grad_norm
from fsdp2kit.train.loggers import ConsoleProgress
from fsdp2kit.train.optim import lr_factor
from fsdp2kit.train.step import token_loss_sum

STEPS = 4
AGREEMENT = 1e-5  # relative, per step, fp32
CONFIG = {
    "model": {"name_or_path": "builtin:tiny-llama", "dtype": "fp32", "config": {"num_hidden_layers": 1}},
    "data": {"seq_len": 64, "pack": False},  # padded samples of very different lengths
    "training": {
        "learning_rate": 4.0e-3,
        "weight_decay": 0.01,
        "warmup_steps": 2,
        "lr_scheduler_type": "cosine",
        "max_steps": STEPS,
        "max_grad_norm": 1.0,
        "seed": 3,
        "export_hf": False,
        "report_to": [],
        "per_device_train_batch_size": 1,
        "gradient_accumulation_steps": 4,
    },
    "strategy_args": {"strategy_config": {"async_save_ckpt": False}},
}
SPLITS = {  # name: (ranks, per_device_train_batch_size, gradient_accumulation_steps, token budget); 4 samples a step
    "1 rank, 1 micro-batch of 4": (1, 4, 1, None),
    "1 rank, 4 micro-batches of 1": (1, 1, 4, None),
    "2 ranks, 2 micro-batches of 1": (2, 1, 2, None),
    "1 rank, micro-batches of <= 100 tokens": (1, 1, 4, 100),
    "2 ranks, micro-batches of <= 100 tokens": (2, 1, 2, 100),
}


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("loop")
    documents = [d[: 20 + (i * 97) % 500] for i, d in enumerate(corpus_documents()[:64])]
    (folder / "uneven.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    config = CONFIG | {"data": CONFIG["data"] | {"source": str(folder / "uneven.jsonl")}}
    (folder / "loop.yaml").write_text(yaml.safe_dump(config))
    return folder / "loop.yaml"


def train_here(config_file, out_dir, **settings) -> int:
    """`fsdp2kit train` in this process (one rank); `settings` are --set overrides with `__` for dots."""
    settings = {key.replace("__", "."): value for key, value in settings.items()}
    return main(["train", str(config_file), *set_args({"training.output_dir": str(out_dir)} | settings)])


def losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def split_losses(config_file, tmp_path_factory) -> dict[str, list[float]]:
    result = {}
    for name, (ranks, micro_batch, accumulation, budget) in SPLITS.items():
        out = tmp_path_factory.mktemp("split")
        settings = {
            "training.per_device_train_batch_size": micro_batch,
            "training.gradient_accumulation_steps": accumulation,
            "training.output_dir": str(out),
            "data.max_tokens_per_micro_batch": budget,
        }
        if ranks == 1:
            assert main(["train", str(config_file), *set_args(settings)]) == 0
        else:
            run = run_cli("train", config_file, "--nproc", ranks, *set_args(settings))
            assert run.returncode == 0, run.stderr[-3000:]
        result[name] = losses(out)
    return result


@pytest.mark.slow
def test_loss_is_the_mean_over_the_global_batch_tokens_at_any_split(split_losses):
    """Samples of very different lengths, split over 1 or 4 micro-batches, 1 or 2 ranks, or into micro-batches under a
    token budget (the ranks' counts evened out): the same loss curve."""
    reference = split_losses["1 rank, 1 micro-batch of 4"]
    assert len(reference) == STEPS
    for name, curve in split_losses.items():
        assert curve == pytest.approx(reference, rel=AGREEMENT), name


@pytest.mark.slow
def test_per_micro_batch_means_would_not_agree(config_file, split_losses):
    """The agreement above means something: on this data the mean of per-micro-batch means (what normalising each
    micro-batch by its own tokens gives) is far from the global token mean, which is what the run logs."""
    cfg = load_config(config_file, as_overrides({"training.per_device_train_batch_size": 1}))
    model, tokenizer = plain_model(cfg)  # the run's initial weights
    samples = TrainingSamples.from_config(cfg.data, tokenizer)
    batches = GlobalBatches(samples, 1, 4, 1, 0, cfg.training.seed, cfg.data.shuffle, tokenizer.pad_token_id)
    sums, counts = [], []
    with torch.no_grad():
        for batch in batches.micro_batches(0):
            sums.append(token_loss_sum(model, batch).item())
            counts.append(int((batch["labels"] != IGNORE_INDEX).sum()))
    token_mean = sum(sums) / sum(counts)
    micro_batch_mean = sum(s / c for s, c in zip(sums, counts, strict=True)) / len(counts)
    assert max(counts) > 2 * min(counts)
    assert split_losses["1 rank, 4 micro-batches of 1"][0] == pytest.approx(token_mean, rel=AGREEMENT)
    assert abs(micro_batch_mean - token_mean) > 100 * AGREEMENT * token_mean  # even at the untrained first step


def test_gradients_are_reduced_once_per_step_not_per_micro_batch(config_file, tmp_path, monkeypatch):
    """FSDP2 reduces (reduce-scatters, at world size > 1) each shard group's gradients in `foreach_reduce`; with 4
    micro-batches a step it must run once per group per step."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    calls = Counter()
    original = _fsdp_param_group.foreach_reduce

    def counting(fsdp_params, *args, **kwargs):
        calls[id(fsdp_params[0])] += 1
        return original(fsdp_params, *args, **kwargs)

    monkeypatch.setattr(_fsdp_param_group, "foreach_reduce", counting)
    assert train_here(config_file, tmp_path, training__max_steps=2) == 0
    assert len(calls) >= 2  # the decoder layer and the root are separate shard groups
    assert set(calls.values()) == {2}


def test_clipping_scales_the_update_exactly_as_clip_grad_norm(config_file, tmp_path):
    """One step with a tiny max_grad_norm, its norm taken over the sharded gradients of 2 micro-batches, gives the
    weights of the same step in one plain process with one micro-batch, which differ clearly from the unclipped
    update (AdamW divides by sqrt(v) + eps, and eps dominates tiny gradients)."""
    from transformers import AutoModelForCausalLM

    max_norm = 1e-6
    settings = {
        "training.max_steps": 1,
        "training.max_grad_norm": max_norm,
        "training.export_hf": True,
        "training.per_device_train_batch_size": 2,
        "training.gradient_accumulation_steps": 2,
    }
    assert main(["train", str(config_file), *set_args(settings | {"training.output_dir": str(tmp_path)})]) == 0
    trained = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    (record,) = read_metrics(tmp_path)

    def one_step(clip: bool) -> tuple[dict, float]:
        """The same step in one plain process (one micro-batch of all 4 samples), clipped or not (0: no clipping)."""
        one_batch = {"training.per_device_train_batch_size": 4, "training.gradient_accumulation_steps": 1}
        cfg = load_config(
            config_file, as_overrides(settings | one_batch | {"training.max_grad_norm": max_norm if clip else 0.0})
        )
        run = reference_run(cfg, 1)
        return run.model.state_dict(), run.results[0].grad_norm

    clipped, norm = one_step(clip=True)
    unclipped, _ = one_step(clip=False)
    assert record["grad_norm"] == pytest.approx(norm, rel=1e-5)  # logged before clipping
    assert norm > 1e5 * max_norm
    for name, value in clipped.items():
        torch.testing.assert_close(trained[name], value, rtol=0, atol=1e-7, msg=name)
    assert max((unclipped[n] - clipped[n]).abs().max().item() for n in clipped) > 1e-5


def test_schedule_shapes_of_warmup_and_decay():
    total, warmup = 20, 5
    ramp = [lr_factor(s, total, warmup, "cosine") for s in range(warmup)]
    assert ramp == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])  # linear warmup reaches the peak at its last step
    for kind in ("linear", "cosine"):
        decay = [lr_factor(s, total, warmup, kind) for s in range(warmup - 1, total + 1)]
        assert decay[0] == 1.0 and decay[-1] == pytest.approx(0.0)
        assert all(a >= b for a, b in itertools.pairwise(decay))
    # cosine stays above linear in the first half of the decay and below it in the second
    assert lr_factor(8, total, warmup, "cosine") > lr_factor(8, total, warmup, "linear")
    assert lr_factor(16, total, warmup, "cosine") < lr_factor(16, total, warmup, "linear")
    assert {lr_factor(s, total, warmup, "constant") for s in range(warmup, total)} == {1.0}


@pytest.mark.slow
@pytest.mark.parametrize("dtype, tolerance", [("fp16", 2e-3), ("bf16", 2e-2)])
def test_half_precision_compute_follows_fp32(config_file, tmp_path, split_losses, dtype, tolerance):
    """fp32 master weights, compute (and gradient reduction) in fp16 or bf16: the same curve within rounding."""
    assert (
        train_here(
            config_file,
            tmp_path,
            strategy_args__strategy_config__param_dtype=dtype,
            training__per_device_train_batch_size=4,
            training__gradient_accumulation_steps=1,
        )
        == 0
    )
    records = read_metrics(tmp_path)
    assert not any(r.get("skipped") for r in records)
    assert ("loss_scale" in records[0]) == (dtype == "fp16")  # bf16 has fp32's exponent range: no scaling
    assert [r["loss"] for r in records] == pytest.approx(split_losses["1 rank, 1 micro-batch of 4"], rel=tolerance)


def test_fp16_overflow_halves_the_loss_scale_and_training_goes_on(config_file, tmp_path):
    """A loss scale too large for fp16 gradients (2^20 here): the step is skipped and the scale halved until the
    gradients fit; those skips do not count as divergence (max_nonfinite_steps is 1). The scale is checkpointed."""
    assert (
        train_here(
            config_file,
            tmp_path,
            strategy_args__strategy_config__param_dtype="fp16",
            training__fp16_initial_scale=2.0**20,
            training__max_nonfinite_steps=1,
            training__max_steps=5,
        )
        == 0
    )
    records = read_metrics(tmp_path)
    scale = 2.0**20
    for record in records:
        assert record["loss_scale"] == (scale / 2 if record.get("skipped") else scale)
        scale = record["loss_scale"]
    assert records[0].get("skipped") and sum(not r.get("skipped") for r in records) >= 2
    state = json.loads((tmp_path / "checkpoints" / "step_5" / "trainer_state.json").read_text())
    assert state["loss_scaler"]["scale"] == records[-1]["loss_scale"]


def test_a_loss_scale_too_large_for_a_short_run_is_named_not_blamed_on_the_weights(config_file, tmp_path, capsys):
    """fp16 with fp16_initial_scale 2^32: each of 3 steps overflows and halves the scale (the scaler's business, not
    divergence), so nothing trains; the run ends naming the loss scale in one line, exit 2 (it said "training
    diverged ... are the model's weights finite?"), and writes nothing."""
    rc = train_here(
        config_file,
        tmp_path,
        strategy_args__strategy_config__param_dtype="fp16",
        training__fp16_initial_scale=2.0**32,
        training__max_steps=3,
    )
    assert (rc, capsys.readouterr().err) == (
        2,
        "error: training.fp16_initial_scale = 4294967296: every one of this run's 3 steps overflowed fp16 at its loss "
        "scale (halved after each, to 536870912), so nothing trained and nothing was saved or exported; lower "
        "training.fp16_initial_scale (default 65536, halved until the gradients fit)\n",
    )
    assert [r["loss_scale"] for r in read_metrics(tmp_path)] == [2.0**31, 2.0**30, 2.0**29]
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "hf").exists()


def test_the_gradient_norm_on_the_cpu_is_exact_to_fp32_rounding_at_any_size():
    """torch's CPU norm kernel accumulates a whole tensor in fp32: on 4M values it is off by about 1e-4, so the norm
    of one rank's whole gradient and the norm over N ranks' shards differed (1e-5 on the tiny models). fsdp2kit's
    is float64's to 1e-7, for one tensor and across tensors of every size, and clips by it."""
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1 << 22, 1000, 7)]
    for param in params:
        param.grad = torch.randn(param.shape, generator=generator)
    exact = torch.stack([p.grad.double().norm() for p in params]).norm().item()
    assert abs(torch.linalg.vector_norm(params[0].grad).item() / params[0].grad.double().norm().item() - 1) > 1e-5
    assert clip_grad_norm(params, 0.0).item() == pytest.approx(exact, rel=1e-7)
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(exact, rel=1e-7)  # the norm before clipping
    assert torch.stack([p.grad.double().norm() for p in params]).norm().item() == pytest.approx(1.0, rel=1e-6)


def test_loss_scaler_grows_after_clean_steps_and_guard_counts_only_real_divergence():
    scaler = LossScaler(enabled=True, initial_scale=8.0)
    scaler.GROWTH_INTERVAL = 3
    guard = NonFiniteGuard(limit=2, scaler=scaler)
    assert [guard.step_is_finite(1.0, 1.0) for _ in range(3)] == [True] * 3
    assert scaler.scale == 16.0
    assert not guard.step_is_finite(1.0, float("inf"))  # an overflow: skipped, scale halved, not counted
    assert (scaler.scale, guard.skipped_in_a_row) == (8.0, 0)
    assert not guard.step_is_finite(float("nan"), float("nan"))  # a non-finite loss counts
    guard.stop_if_diverged(7)
    assert not guard.step_is_finite(float("inf"), 1.0)
    with pytest.raises(TrainingDiverged, match=r"non-finite for 2 steps in a row \(steps 7-8"):
        guard.stop_if_diverged(8)
    scaler = LossScaler(enabled=True, initial_scale=1.0)
    guard = NonFiniteGuard(limit=5, scaler=scaler)
    guard.step_is_finite(1.0, float("inf"))
    with pytest.raises(TrainingDiverged, match="fp16 gradients overflow even unscaled"):
        guard.stop_if_diverged(1)


DIVERGED = (
    "error: training diverged: the loss or gradient norm was non-finite for 2 steps in a row (steps 2-3, "
    "training.max_nonfinite_steps = 2); lower training.learning_rate or compute in bf16/fp32\n"
)


def test_non_finite_steps_are_skipped_then_the_run_stops_with_one_line(config_file, tmp_path, capsys):
    """A learning rate of 1e30 blows the weights up in one step; later steps' gradients are NaN."""
    rc = train_here(
        config_file, tmp_path, training__learning_rate=1e30, training__max_nonfinite_steps=2, training__max_steps=6
    )
    assert rc == 1
    assert capsys.readouterr().err == DIVERGED
    records = read_metrics(tmp_path)
    assert [r.get("skipped", False) for r in records] == [False, True, True]
    assert records[1]["lr"] == records[2]["lr"]  # a skipped step does not advance the schedule


@pytest.mark.slow
def test_divergence_under_the_launcher_is_one_line_exit_1(config_file, tmp_path):
    result = run_cli(
        "train",
        config_file,
        "--nproc",
        2,
        *set_args(
            {
                "training.learning_rate": 1e30,
                "training.max_nonfinite_steps": 2,
                "training.max_steps": 6,
                "training.gradient_accumulation_steps": 2,
                "training.output_dir": str(tmp_path),
            }
        ),
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] + "\n" == DIVERGED
    assert "Traceback" not in result.stdout + result.stderr


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in `wandb` module recording what the run sends it."""
    calls = []
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)

    class Run:
        def log(self, values, step):
            calls.append(("log", step, values))

        def finish(self):
            calls.append(("finish",))

    def init(**kwargs):
        calls.append(("init", kwargs))
        return Run()

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def test_console_tensorboard_wandb_profiler_and_lr_schedule(config_file, tmp_path, capsys, fake_wandb):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert (
        train_here(
            config_file,
            tmp_path,
            training__logging_steps=2,
            training__profile_steps=[2, 3],
            training__report_to=["tensorboard", "wandb"],
        )
        == 0
    )
    records = read_metrics(tmp_path)
    tc = load_config(config_file).training
    assert [r["lr"] for r in records] == pytest.approx(
        [tc.learning_rate * lr_factor(s, STEPS, tc.warmup_steps, "cosine") for s in range(STEPS)]
    )

    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["2/4", "4/4"]  # not a TTY: a plain line every logging_steps
    assert lines[0].startswith(f"step 2/4 loss {records[1]['loss']:.4f} lr ") and " eta " in lines[0]

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("train/loss")
    assert [e.step for e in scalars] == [r["step"] for r in records]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in records], rel=1e-6)  # stored as float32
    assert {"train/lr", "train/grad_norm", "train/tokens_per_s", "train/peak_mem_bytes"} <= set(
        events.Tags()["scalars"]
    )

    assert fake_wandb[0][0] == "init" and fake_wandb[0][1]["name"] == tmp_path.name
    assert [(c[1], c[2]["loss"]) for c in fake_wandb if c[0] == "log"] == [(r["step"], r["loss"]) for r in records]
    assert fake_wandb[-1] == ("finish",)

    trace = json.loads((tmp_path / "profile" / "rank0_steps2-3.json").read_text())
    forwards = [e for e in trace["traceEvents"] if e.get("name") == "FSDP::root_pre_forward" and e.get("ph") == "X"]
    assert len(forwards) == 2 * 4  # steps 2 and 3, 4 micro-batches each


def test_asking_for_wandb_without_it_installed_is_a_user_error(config_file, tmp_path, capsys, monkeypatch):
    """wandb made unfindable whether or not this machine has it, as on a machine without it."""
    find_spec = importlib.util.find_spec
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *args: None if name == "wandb" else find_spec(name, *args)
    )
    assert train_here(config_file, tmp_path, training__report_to=["wandb"]) == 2
    assert capsys.readouterr().err == (
        "error: training.report_to: 'wandb' needs the wandb package, which is not "
        "installed; `pip install wandb` or leave it out (valid: tensorboard, wandb)\n"
    )


def test_progress_bar_on_a_terminal(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    progress = ConsoleProgress(total_steps=4, start_step=0, every=1)
    for step in range(1, 5):
        progress.write({"step": step, "loss": 5.0 - step, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1234.0})
    progress.close()
    shown = terminal.getvalue()
    assert "4/4" in shown and "loss 1.0000 tokens/s 1234" in shown and "eta" in shown
    assert "grad_norm" not in shown  # the bar, not the plain lines
