"""Shared test helpers: run the real command line in a subprocess, read a run's metrics, a process group in this
process."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
# Each pytest process (`make test` runs two, pytest-xdist's) copies remote-code models' modules into a cache of its
# own, which its subprocesses inherit: two processes writing one module file at once could import it half-written.
# Removed when the process that made it ends (its subprocesses have ended by then).
_HF_MODULES = tempfile.mkdtemp(prefix="fsdp2kit-hf-modules-")
os.environ["HF_MODULES_CACHE"] = _HF_MODULES
atexit.register(shutil.rmtree, _HF_MODULES, ignore_errors=True)


def run_cli(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m fsdp2kit ARGS` from the repo root, capturing text output."""
    return run_python("-m", "fsdp2kit", *args, timeout=timeout, env=env)


def run_python(*args: str, timeout: int = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python ARGS` in a fresh interpreter from the repo root, as a user's single process (no launcher's RANK),
    capturing text output."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("RANK", None)
    full_env.pop("WORLD_SIZE", None)
    return subprocess.run(
        [sys.executable, *map(str, args)],
        cwd=REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# What a launcher (torchrun, `train --nproc`) or an in-process run sets for its ranks.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class CliResult(NamedTuple):
    """What an in-process command left: the fields of run_cli's subprocess.CompletedProcess, in a tuple."""

    returncode: int
    stdout: str
    stderr: str


@contextmanager
def without_launcher_variables():
    """For commands run in this process: launcher variables left by earlier in-process runs are cleared first, and
    what the runs set is undone after."""
    saved = dict(os.environ)
    for name in LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def run_main(capsys):
    """`fsdp2kit ARGS` inside this process, as a single-rank command: run_cli without an interpreter start and a
    second import of torch and transformers, for claims that are not about processes."""
    from fsdp2kit.cli import main

    def run(*args) -> CliResult:
        capsys.readouterr()  # what the test printed before: not this command's output
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return CliResult(code, out.out, out.err)

    with without_launcher_variables():
        yield run


def launch_two_ranks(worker: str, *args: object, timeout: int = 600, ranks: int = 2) -> None:
    """`tests/<worker>` on 2 ranks (or `ranks`) through torch's launcher (a fresh port, no RANK/WORLD_SIZE of ours),
    required to succeed: the workers write what the test compares."""
    from fsdp2kit.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port"]
    command += [str(free_port()), str(REPO / "tests" / worker), *map(str, args)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(
        command, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr[-3000:]


@contextmanager
def process_group(size: int = 1, rank: int = 0):
    """A process group in this process, yielding its Runtime: real gloo for one rank, torch's fake backend
    (collectives do nothing) to be rank `rank` of a larger world."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp2kit.distributed import Runtime, destroy_process_group

    if size == 1:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=size)
    try:
        yield Runtime(rank, size, 0, torch.device("cpu"))
    finally:
        destroy_process_group()


def sharded_model(cfg, runtime, **kwargs):
    """`build_sharded_model` with the sections of a whole JobConfig, as train and infer call it."""
    from fsdp2kit.models.sharded import build_sharded_model

    return build_sharded_model(
        cfg.model,
        cfg.strategy_args.strategy_config,
        cfg.data,
        runtime,
        seed=cfg.training.seed,
        compile_layers=cfg.training.compile,
        **kwargs,
    )


def plain_model(cfg):
    """The config's model and tokenizer in this process, no FSDP, no sequence parallel, with the weights every rank
    of a run would have (fresh ones are seeded per module name)."""
    from fsdp2kit.data.dataset import load_tokenizer
    from fsdp2kit.models.build import build_meta_model, materialise, resolve_model

    source = resolve_model(cfg.model, cfg.data.tokenizer)
    model = build_meta_model(source, cfg.model)
    materialise(model, source, torch.device("cpu"), cfg.training.seed)
    return model, load_tokenizer(source.tokenizer_path)


@dataclass
class ReferenceRun:
    model: torch.nn.Module
    results: list = field(default_factory=list)  # a StepResult per step
    initial: dict[str, torch.Tensor] = field(default_factory=dict)  # the weights before the first step
    first_grads: dict[str, torch.Tensor] = field(default_factory=dict)  # the gradients the first update used

    @property
    def losses(self) -> list[float]:
        return [result.loss for result in self.results]


def reference_run(cfg, steps: int) -> ReferenceRun:
    """The plain reference the multi-rank runs are compared with: one process, no FSDP, no sequence parallel,
    `train_step` on each global batch of the config's data (its per_device_train_batch_size x
    gradient_accumulation_steps samples, in the order every run reads them), AdamW and the schedule."""
    from fsdp2kit.data.samples import GlobalBatches, TrainingSamples
    from fsdp2kit.train.grads import LossScaler, NonFiniteGuard
    from fsdp2kit.train.optim import build_optimizer, build_scheduler
    from fsdp2kit.train.step import train_step

    tc = cfg.training
    model, tokenizer = plain_model(cfg)
    run = ReferenceRun(model, initial={name: p.detach().clone() for name, p in model.named_parameters()})
    optimizer = build_optimizer(model, tc)
    scheduler = build_scheduler(optimizer, tc, steps)
    guard = NonFiniteGuard(tc.max_nonfinite_steps, LossScaler(False, tc.fp16_initial_scale))

    def keep_first_grads(*_):
        if not run.first_grads:
            run.first_grads.update({name: p.grad.clone() for name, p in model.named_parameters()})

    optimizer.register_step_pre_hook(keep_first_grads)
    samples = TrainingSamples.from_config(cfg.data, tokenizer)
    batches = GlobalBatches(
        samples,
        tc.per_device_train_batch_size,
        tc.gradient_accumulation_steps,
        1,
        0,
        tc.seed,
        cfg.data.shuffle,
        tokenizer.pad_token_id,
    )
    aux_loss = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)  # a MoE's router loss, as train's
    with process_group():
        for step in range(steps):
            run.results.append(
                train_step(model, batches.micro_batches(step), optimizer, scheduler, guard, tc.max_grad_norm, aux_loss)
            )
    return run


@torch.no_grad()
def logit_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[list[float], list[int]]:
    """A reference independent of fsdp2kit's chunked head: per sample of a shifted batch, the sum of the log-softmax
    of the model's logits at the target tokens, and their count."""
    from fsdp2kit.labels import IGNORE_INDEX

    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logprobs = torch.log_softmax(model(**inputs, use_cache=False).logits.float(), dim=-1)
    mask = batch["labels"] != IGNORE_INDEX
    picked = logprobs.gather(-1, batch["labels"].clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    return picked.sum(dim=1).double().tolist(), mask.sum(dim=1).tolist()


def token_batch(rows: int = 2, length: int = 16) -> dict[str, torch.Tensor]:
    """A training batch of seeded random tokens of the built-in vocabulary, every position a target."""
    from fsdp2kit.data.builtin import VOCAB_SIZE

    tokens = torch.randint(0, VOCAB_SIZE, (rows, length + 1), generator=torch.Generator().manual_seed(0))
    return {
        "input_ids": tokens[:, :-1],
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": tokens[:, 1:],
    }


def as_overrides(settings: dict) -> list[str]:
    """`--set` values, key.path=value, the value written as JSON (which YAML reads back as the same value)."""
    return [f"{key}={json.dumps(value)}" for key, value in settings.items()]


def set_args(settings: dict) -> list[str]:
    """`settings` as command-line arguments: --set key.path=value ..."""
    return [arg for item in as_overrides(settings) for arg in ("--set", item)]


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines() if line]


# A collective that no other rank joins fails after this long: long enough that a slow machine never trips it
# (a healthy collective of these tiny models waits milliseconds), short enough for a test.
HANG_TIMEOUT_S = 20


def two_ranks_hang(code: str, args: list[str], log_dir: Path) -> tuple[bool, str]:
    """Two ranks of `python -c code *args`, launched here (no launcher to tear them down) so that `code` can take a
    patch out of them, with a collective timeout of HANG_TIMEOUT_S. Waits for both to end and returns whether a rank
    reported a collective that timed out (a hang: the other rank never joined it) and their output. gloo may instead
    abort at once on mismatched sizes, which the output says too."""
    from fsdp2kit.distributed import COLLECTIVE_TIMEOUT_ENV, free_port

    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), COLLECTIVE_TIMEOUT_ENV: str(HANG_TIMEOUT_S)}
    logs = [log_dir / f"rank{rank}.log" for rank in range(2)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", code, *args],
            cwd=REPO,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        for rank in ranks:
            rank.wait(timeout=600)  # a safety net only: the collective timeout ends a hung rank long before
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
    output = "".join(log.read_text() for log in logs)
    return "timed out in a collective that another rank did not join" in output, output


# A fast run of the built-in tiny Llama: 2 layers, 64-token samples, no HF export.
SMALL_RUN = {"model.config.num_hidden_layers": 2, "data.seq_len": 64, "training.export_hf": False}


@pytest.fixture
def small_run(tmp_path):
    """--set overrides for SMALL_RUN into tmp_path/run (no checkpoints but the last)."""
    return set_args({**SMALL_RUN, "training.output_dir": str(tmp_path / "run")})


def make_hf_folder(
    path: Path,
    builtin: str,
    max_shard_size: str | None = None,
    layers: int = 2,
    auto_class: str = "AutoModelForCausalLM",
    **config,
):
    """A seeded HF model folder of a built-in architecture (`config` overrides its settings), with the built-in
    tokenizer: what a user's downloaded model looks like, without a download. Returns the model. `auto_class`: the
    transformers auto class that builds it (AutoModelForTokenClassification: a critic's)."""
    import shutil

    import transformers
    from transformers import AutoConfig

    from fsdp2kit.data.builtin import tokenizer_dir
    from fsdp2kit.models.builtin import BUILTIN_MODELS

    settings = dict(BUILTIN_MODELS[builtin], num_hidden_layers=layers, **config)
    hf_config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    torch.manual_seed(3)
    model = getattr(transformers, auto_class).from_config(hf_config)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    for file in tokenizer_dir().iterdir():
        shutil.copy(file, path / file.name)
    return model


def cli_without_patch(patch: str, announce_forwards: bool = False) -> str:
    """Code for `python -c` running the command line with `fsdp2kit.models.variant.<patch>` made a no-op (and each
    training forward announced as `forward: images True|False`): a run that shows what the patch prevents."""
    lines = ["import sys", "import fsdp2kit.models.variant as variant", f"variant.{patch} = lambda model: None"]
    if announce_forwards:
        lines += [
            "import fsdp2kit.train.step as step",
            "forward = step.token_loss_sum",
            "def announced(model, batch, *args):",
            "    print(f\"forward: images {'pixel_values' in batch}\", flush=True)",
            "    return forward(model, batch, *args)",
            "step.token_loss_sum = announced",
        ]
    return "\n".join([*lines, "from fsdp2kit.cli import main", "sys.exit(main(sys.argv[1:]))", ""])


def pytest_collection_modifyitems(config, items) -> None:
    """`cuda`-marked tests are skipped where no CUDA device is visible (CI is CPU-only; gpu_suite.sh runs them)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
