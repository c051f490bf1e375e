"""Checkpoints that survive anything: SIGKILL after and during saves, resume at other world sizes and meshes,
elastic restarts under torchrun, a two-"node" run on localhost, and corrupt checkpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import REPO, SMALL_RUN, read_metrics, run_cli, set_args

from fsdp2kit.checkpoint.manager import committed_checkpoints
from fsdp2kit.distributed import free_port

DEMO = "examples/demo.yaml"
pytestmark = pytest.mark.slow


def base(run_dir, steps=12, save=6, async_save=False):
    return set_args(
        {
            **SMALL_RUN,
            "training.per_device_train_batch_size": 1,
            "training.gradient_accumulation_steps": 1,
            "training.output_dir": str(run_dir),
            "training.max_steps": steps,
            "training.save_steps": save,
            "strategy_args.strategy_config.async_save_ckpt": async_save,
        }
    )


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir)}


def train(*args, fault=None, nproc=2):
    result = run_cli("train", DEMO, "--nproc", nproc, *args, env={"FSDP2KIT_FAULT": fault} if fault else None)
    if fault is None:
        assert result.returncode == 0, result.stderr
    else:
        assert result.returncode != 0, "the injected fault did not fire"
    return result


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """12 steps, 2 ranks, never interrupted: the curve every interrupted run must reproduce."""
    run = tmp_path_factory.mktemp("straight") / "run"
    train(*base(run))
    return losses(run)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_after_checkpoint_then_resume_is_exact(tmp_path, straight, async_save):
    run = tmp_path / "run"
    train(*base(run, async_save=async_save), fault="after_commit:6")  # every rank SIGKILLs itself
    assert [p.name for p in committed_checkpoints(run / "checkpoints")] == ["step_6"]
    result = train(*base(run, async_save=async_save))
    assert "resumed from" in result.stdout and "step_6" in result.stdout
    got = losses(run)
    assert sorted(got) == list(range(1, 13))
    for step in range(7, 13):
        assert abs(got[step] - straight[step]) <= 1e-6, (step, got[step], straight[step])


def test_sigterm_to_the_launcher_saves_the_step_the_run_stops_after_and_the_resume_is_exact(tmp_path, straight):
    """Issue 63 (5): a stop lost every step since the last checkpoint. SIGTERM reaches the `--nproc 2` launcher as
    step 5 ends (rank 0 sends it there and waits until the launcher has forwarded it back: a scheduler's signal to
    the job, at an exact step; no save is due until step 6): the ranks save step 5, committed as any save, exit with
    one line saying where, and the same command resumes from it on the uninterrupted run's curve."""
    run = tmp_path / "run"
    stopped = train(*base(run), fault="step:5:0:SIGTERM@launcher")
    checkpoints = run / "checkpoints"
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("error: ")]
    saved = f"saved checkpoint {checkpoints / 'step_5'}; the same command resumes from it"
    assert lines == [f"error: interrupted by SIGTERM after step 5: {saved}"], stopped.stderr
    assert stopped.returncode == 128 + signal.SIGTERM and "Traceback" not in stopped.stderr
    assert [p.name for p in committed_checkpoints(checkpoints)] == ["step_5"] and not list(checkpoints.glob(".tmp-*"))
    result = train(*base(run))
    assert f"resumed from {checkpoints / 'step_5'} at step 5" in result.stdout
    got = losses(run)
    assert sorted(got) == list(range(1, 13))
    assert [got[step] for step in range(6, 13)] == [straight[step] for step in range(6, 13)]


@pytest.mark.parametrize("moment", ["before_save:8", "after_shards:8:1", "before_state:8", "before_rename:8"])
def test_sigkill_during_save_leaves_only_complete_checkpoints(tmp_path, straight, moment):
    """Killed while step 8 is being saved: resume must take step 4 (complete), never a half-written step 8."""
    run = tmp_path / "run"
    train(*base(run, save=4), fault=moment)
    assert [p.name for p in committed_checkpoints(run / "checkpoints")] == ["step_4"]
    result = train(*base(run, save=4))
    assert "step_4 at step 4" in result.stdout
    got = losses(run)
    assert all(abs(got[s] - straight[s]) <= 1e-6 for s in range(5, 13))


@pytest.fixture(scope="module")
def saved_at_two_ranks(tmp_path_factory):
    """8 steps, 2 ranks (1-D mesh, 2 micro-batches each), a checkpoint at step 4: its losses are the curve a resume
    from that checkpoint must continue, whatever world size and mesh resume it."""
    run = tmp_path_factory.mktemp("saved") / "run"
    train(*base(run, steps=8, save=4), "--set", "training.gradient_accumulation_steps=2")
    return run / "checkpoints" / "step_4", losses(run)


@pytest.mark.parametrize("nproc, accumulation, fsdp_size", [(4, 1, 2), (1, 4, "auto")], ids=["4-ranks-hsdp", "1-rank"])
def test_resume_at_another_world_size_and_mesh(tmp_path, saved_at_two_ranks, nproc, accumulation, fsdp_size, run_main):
    """Saved by 2 ranks (1-D mesh, 2 micro-batches each), resumed by 4 ranks on a 2x2 HSDP mesh or by 1 rank (in
    this process): the same global batches, model, optimizer state and position, so the same losses as the
    uninterrupted 2-rank run."""
    checkpoint, expected = saved_at_two_ranks
    resumed = tmp_path / "resumed"
    settings = [f"training.gradient_accumulation_steps={accumulation}", f"training.resume={checkpoint}"]
    settings.append(f"strategy_args.strategy_config.fsdp_size={fsdp_size}")
    args = [*base(resumed, steps=8, save=4), *(arg for item in settings for arg in ("--set", item))]
    if nproc == 1:
        result = run_main("train", DEMO, *args)
        assert result.returncode == 0, result.stderr
    else:
        train(*args, nproc=nproc)
    got = losses(resumed)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(expected[step], rel=1e-5)


def test_global_batch_change_on_resume_is_refused(tmp_path):
    run = tmp_path / "run"
    train(*base(run, steps=4, save=2), fault="after_commit:2")
    result = run_cli(
        "train", DEMO, "--nproc", 2, *base(run, steps=4, save=2), "--set", "training.gradient_accumulation_steps=2"
    )
    assert result.returncode == 2
    assert "was trained with a global batch of 2 samples, this run has 4" in result.stderr


def _torchrun(*args, log: Path, env=None) -> subprocess.Popen:
    """`python -m torch.distributed.run ARGS`, its output (stdout and stderr) to the file `log`: launchers that run
    side by side must never block on a full pipe that nobody reads."""
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    with log.open("w") as output:
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *args],
            cwd=REPO,
            env=full_env,
            stdout=output,
            stderr=subprocess.STDOUT,
            text=True,
        )


def test_rank_killed_under_torchrun_max_restarts_recovers(tmp_path, straight):
    """Rank 1 is SIGKILLed after step 8; torchrun restarts the job, which resumes from step 6 by itself."""
    run = tmp_path / "run"
    proc = _torchrun(
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "-m",
        "fsdp2kit",
        "train",
        DEMO,
        *base(run),
        log=tmp_path / "torchrun.log",
        env={"FSDP2KIT_FAULT": "step:8:1"},
    )
    code, out = proc.wait(timeout=600), (tmp_path / "torchrun.log").read_text()
    assert code == 0, out[-3000:]
    assert "resumed from" in out
    got = losses(run)
    assert sorted(got) == list(range(1, 13))
    assert got[12] == pytest.approx(straight[12], abs=1e-6)


def test_two_nodes_on_localhost_train_checkpoint_and_resume(tmp_path, straight):
    """Two launchers (`torchrun --nnodes 2`, c10d rendezvous on localhost) are two "nodes" of one rank each."""
    run = tmp_path / "run"

    def both_nodes(fault=None):
        endpoint, run_id = f"localhost:{free_port()}", uuid.uuid4().hex[:8]
        args = [
            "--nnodes=2",
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            "--max-restarts=0",
            "-m",
            "fsdp2kit",
            "train",
            DEMO,
            *base(run),
        ]
        logs = [tmp_path / f"node{i}.log" for i in range(2)]
        nodes = [_torchrun(*args, log=log, env={"FSDP2KIT_FAULT": fault} if fault else None) for log in logs]
        codes = [node.wait(timeout=600) for node in nodes]
        return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]

    crashed = both_nodes(fault="after_commit:6")
    assert all(code != 0 for code, _ in crashed)
    finished = both_nodes()
    assert all(code == 0 for code, _ in finished), [out[-3000:] for _, out in finished]
    got = losses(run)
    assert all(abs(got[s] - straight[s]) <= 1e-6 for s in range(1, 13))


def test_corrupt_truncated_or_mismatched_checkpoints_exit_2(tmp_path, run_main):
    """A 2-rank checkpoint, damaged, then resumed in this process at 1 rank (every rank reads every file it needs)."""
    run = tmp_path / "run"
    train(*base(run, steps=2, save=2))
    checkpoint = run / "checkpoints" / "step_2"

    def resume(*extra):
        other = base(tmp_path / "other", steps=4, save=2)
        return run_main("train", DEMO, *other, "--set", f"training.resume={checkpoint}", *extra)

    result = resume("--set", "model.config.num_hidden_layers=3")  # another model
    assert result.returncode == 2
    assert f"training.resume: checkpoint '{checkpoint}' cannot be loaded into this model" in result.stderr

    shard = checkpoint / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # truncated: refused as the resume is resolved, naming the file
    result = resume()
    damaged = f"training.resume: checkpoint '{checkpoint}' is damaged: '{shard}'"
    assert result.returncode == 2 and f"{damaged} is truncated (100 of " in result.stderr

    shard.unlink()  # a rank's file missing
    result = resume()
    assert result.returncode == 2 and f"{damaged} is missing" in result.stderr

    (checkpoint / ".metadata").unlink()
    result = resume()
    assert result.returncode == 2
    assert (
        f"training.resume: '{checkpoint}' is not a complete checkpoint (it needs trainer_state.json and .metadata)"
        in result.stderr
    )


def test_keep_last_k_keeps_the_newest_complete_ones(tmp_path):
    run = tmp_path / "run"
    train(
        *base(run, steps=6, save=2),
        "--set",
        "training.save_total_limit=2",
        "--set",
        "strategy_args.strategy_config.async_save_ckpt=true",
    )
    assert [p.name for p in committed_checkpoints(run / "checkpoints")] == ["step_4", "step_6"]
    assert not list((run / "checkpoints").glob(".tmp-*"))


PRUNE_KILLED_MIDWAY = """
import os, shutil, signal, sys, types
from pathlib import Path
from fsdp2kit.checkpoint import manager

def rmtree_then_die(path, ignore_errors=False):
    if not Path(path).exists():
        return
    victim = sorted(p for p in Path(path).iterdir() if p.name != manager.STATE_FILE)[0]
    victim.unlink()  # the deletion has begun ...
    os.kill(os.getpid(), signal.SIGKILL)  # ... and the process is killed

manager.shutil.rmtree = rmtree_then_die
manager.CheckpointManager._prune(types.SimpleNamespace(keep=1, root=Path(sys.argv[1])))
"""


def test_a_kill_while_deleting_an_old_checkpoint_leaves_no_step_folder_with_files_missing(tmp_path):
    """keep-last-K renames a checkpoint out of resume's sight before deleting it: a real SIGKILL in the middle of
    the deletion (the fault soak met one) leaves every `step_N` that resume can see whole."""
    root = tmp_path / "checkpoints"
    files = ("__0_0.distcp", ".metadata", "trainer_state.json")
    for step in (2, 4):
        (root / f"step_{step}").mkdir(parents=True)
        for name in files:
            (root / f"step_{step}" / name).write_text("{}")
    killed = subprocess.run([sys.executable, "-c", PRUNE_KILLED_MIDWAY, str(root)], cwd=REPO)
    assert killed.returncode == -9
    for checkpoint in committed_checkpoints(root):
        assert sorted(p.name for p in checkpoint.iterdir()) == sorted(files), checkpoint
    assert [p.name for p in committed_checkpoints(root)] == ["step_4"]


@pytest.mark.parametrize("make, said", [(None, "does not exist"), ("file", "is a file, not a checkpoint folder")])
def test_resume_from_a_path_that_is_no_folder_says_what_it_is(tmp_path, make, said):
    """`training.resume` naming a path that does not exist (a typo) or a file says so, not "not a complete
    checkpoint", which sends the user looking for missing files in a folder that is not there."""
    from fsdp2kit.checkpoint.manager import resume_checkpoint
    from fsdp2kit.errors import UserError

    path = tmp_path / "checkpoints" / "step_20"
    if make == "file":
        path.parent.mkdir()
        path.write_text("")
    with pytest.raises(UserError) as refused:
        resume_checkpoint(tmp_path / "checkpoints", str(path))
    assert str(refused.value) == f"training.resume: '{path}' {said}; give a checkpoint folder, auto or never"
