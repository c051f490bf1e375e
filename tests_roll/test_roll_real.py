"""ROLL's own RLVR workers (the ROLL snapshot in ../shared/third_party/ROLL, commit 8eb27cc) driving fsdp2kit and
driving ROLL's own FSDP2TrainStrategy, from the same RLVRConfig and on the same batches, at 1 and 2 ranks on the
CPU (gloo), on ROLL's pins (transformers 5.2.0, peft 0.12.0): `make test-roll` builds that environment. Each run
is one process per rank (tests_roll/roll_worker.py); the figures compared are those docs/api.md reports."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
ROLL_SOURCE = Path(os.environ.get("ROLL_SOURCE", HERE.parent.parent / "shared" / "third_party" / "ROLL"))
ROLES = {
    "actor": "actor_train",
    "actor_ep": "actor_train",
    "actor_moe": "actor_train",
    "reference": "reference",
    "critic": "critic",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_ranks(engine: str, role: str, model_dir: Path, out: Path, ranks: int) -> list[dict]:
    """ROLL's worker of `role` on `ranks` processes, each with the environment ROLL's cluster gives it."""
    port, processes = free_port(), []
    path = os.pathsep.join([str(HERE.parent), str(HERE), str(ROLL_SOURCE)])
    for rank in range(ranks):
        env = {
            **os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORKER_NAME": f"{ROLES[role]}-{rank}",
            "CLUSTER_NAME": ROLES[role], "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
        }  # fmt: skip
        command = [sys.executable, str(HERE / "roll_worker.py"), engine, role, str(model_dir), str(out), str(ranks)]
        processes.append(  # in out's folder: ROLL's logger writes ./output/logs
            subprocess.Popen(command, env=env, cwd=out.parent, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        )
    logs = [process.communicate(timeout=600)[0].decode(errors="replace") for process in processes]
    for process, log in zip(processes, logs, strict=True):
        assert process.returncode == 0, log[-4000:]
    return [torch.load(f"{out}.rank{rank}", weights_only=False) for rank in range(ranks)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from roll_scaffold import tiny_qwen2

    return tiny_qwen2(tmp_path_factory.mktemp("roll") / "model")


def numbers(value: object) -> torch.Tensor:
    """A metric as ROLL returns it (a float, or a list of them per micro-batch or step) as one flat tensor."""
    return torch.tensor(value, dtype=torch.float64).flatten()


def assert_same_metrics(ours: dict, roll: dict, figures: dict[str, float]) -> None:
    """Every metric ROLL's own strategy reports (timings and memory aside) with the same value: losses and ratios
    to 1e-5 relative (fp32 sums in another order), grad norms to 1e-5 relative."""
    compared = [key for key in roll if not key.startswith(("time/", "system/"))]
    assert compared and set(compared) <= set(ours), set(compared) - set(ours)
    for key in compared:
        want, got = numbers(roll[key]), numbers(ours[key])
        assert got.shape == want.shape, key
        relative = ((got - want).abs() / want.abs().clamp(min=1e-6)).max().item()
        figures[key] = max(figures.get(key, 0.0), relative)
        assert relative <= 1e-5 or (got - want).abs().max().item() <= 1e-6, (key, got, want)


def assert_same_actor(ours: list[dict], roll: list[dict], reference: str = "FSDP2TrainStrategy") -> dict[str, float]:
    """The actor's figures, rank by rank: log-probs and entropy (1e-5), ROLL's train metrics, the log-probs after
    the step (1e-3), the checkpoint round trip (exact), and the model update's tensors (rank 0 only, ROLL's names,
    1e-3); the measured maxima."""
    figures: dict[str, float] = {}
    for mine, theirs in zip(ours, roll, strict=True):
        assert (mine["strategy"], theirs["strategy"]) == ("RollStrategy", reference)
        for key in ("log_probs", "entropy"):
            figures[key] = max(figures.get(key, 0.0), (mine[key] - theirs[key]).abs().max().item())
            assert figures[key] <= 1e-5, key
        assert_same_metrics(mine["train"], theirs["train"], figures)
        after = (mine["saved"]["log_probs"] - theirs["saved"]["log_probs"]).abs().max().item()
        figures["log_probs after the step"] = max(figures.get("log_probs after the step", 0.0), after)
        assert after <= 1e-3
        for key in ("log_probs", "entropy"):  # the checkpoint round trip, per rank from ROLL's folders
            assert torch.equal(mine["loaded"][key], mine["saved"][key]), key
    update, weights = ours[0]["update"], roll[0]["update"]
    assert set(update) == set(weights)
    figures["weights after the step"] = max((update[name] - weights[name]).abs().max().item() for name in update)
    assert figures["weights after the step"] <= 1e-3
    assert all(not rank["update"] for rank in ours[1:])  # sent once, from rank 0 (ROLL's separated mode)
    return figures


def report(name: str, figures: dict[str, float]) -> None:
    """The measured maxima, printed (pytest -s) for docs/api.md."""
    print(f"\n{name}: " + ", ".join(f"{key} {value:.2e}" for key, value in sorted(figures.items())))


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_rolls_actor_worker_on_fsdp2kit_equals_rolls_fsdp2_strategy(model_dir, tmp_path, ranks):
    """ROLL's RLVR ActorWorker: compute_log_probs (log-probs, entropy), train_step (two optimizer steps: ROLL's
    loss metrics, grad norms, lr), the model update's tensors (the weights after the step), do_checkpoint into
    ROLL's per-rank folders, a second train_step, and the checkpoint loaded back: the log-probs of the saved
    weights again, exactly (ROLL's own strategy cannot load its per-rank folders at 2 ranks: rank 1's lacks DCP's
    .metadata, which rank 0 writes in its own; ROLL's uploader gathers them)."""
    ours = run_ranks("fsdp2kit", "actor", model_dir, tmp_path / "ours", ranks)
    roll = run_ranks("roll", "actor", model_dir, tmp_path / "roll", ranks)
    figures = assert_same_actor(ours, roll)
    assert list(ours[0]["update"]) == list(roll[0]["update"]) and len(ours[0]["update"]) == 27  # in ROLL's order
    # One heap per rank held through ROLL's own worker: no thread that allocated after fsdp2kit's adapter was imported
    # made one (here `init_distributed`'s setting at the Strategy's build is in time as well, before gloo's threads
    # allocate; verl's flow needs the import's: tests_verl/test_verl_worker.py).
    if ranks == 2:
        for rank in ours:
            assert rank["heaps"]["after the run"] == rank["heaps"]["at the adapter's import"], rank["heaps"]
    report(f"actor at {ranks} rank(s)", figures)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_rolls_critic_worker_on_fsdp2kit_equals_rolls_fsdp2_strategy(model_dir, tmp_path, ranks):
    """ROLL's CriticWorker: compute_values, train_step (ROLL's value loss metrics, grad norms), do_checkpoint (the
    critic's folder inside its local_state_path) and the checkpoint loaded back."""
    ours = run_ranks("fsdp2kit", "critic", model_dir, tmp_path / "ours", ranks)
    roll = run_ranks("roll", "critic", model_dir, tmp_path / "roll", ranks)
    figures: dict[str, float] = {}
    for mine, theirs in zip(ours, roll, strict=True):
        assert (mine["strategy"], theirs["strategy"]) == ("RollStrategy", "FSDP2TrainStrategy")
        figures["values"] = max(figures.get("values", 0.0), (mine["values"] - theirs["values"]).abs().max().item())
        assert figures["values"] <= 1e-5
        assert_same_metrics(mine["train"], theirs["train"], figures)
        after = (mine["saved"]["values"] - theirs["saved"]["values"]).abs().max().item()
        figures["values after the step"] = max(figures.get("values after the step", 0.0), after)
        assert after <= 1e-3
        assert torch.equal(mine["loaded"]["values"], mine["saved"]["values"])
    report(f"critic at {ranks} rank(s)", figures)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_rolls_reference_worker_on_fsdp2kit_equals_rolls_fsdp2_infer_strategy(model_dir, tmp_path, ranks):
    """ROLL's reference (an ActorWorker on fsdp2_infer): compute_log_probs, against ROLL's FSDP2InferStrategy."""
    ours = run_ranks("fsdp2kit", "reference", model_dir, tmp_path / "ours", ranks)
    roll = run_ranks("roll", "reference", model_dir, tmp_path / "roll", ranks)
    figures: dict[str, float] = {}
    for mine, theirs in zip(ours, roll, strict=True):
        assert (mine["strategy"], theirs["strategy"]) == ("RollStrategy", "FSDP2InferStrategy")
        for key in ("log_probs", "entropy"):
            figures[key] = max(figures.get(key, 0.0), (mine[key] - theirs[key]).abs().max().item())
            assert figures[key] <= 1e-5, key
    report(f"reference at {ranks} rank(s)", figures)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from roll_scaffold import tiny_qwen3_moe

    return tiny_qwen3_moe(tmp_path_factory.mktemp("roll-moe") / "model")


@pytest.mark.slow
def test_rolls_actor_worker_with_expert_parallelism_on_fsdp2kit_equals_rolls_fsdp2_strategy(moe_dir, tmp_path):
    """ROLL's ActorWorker on a Qwen3-MoE (4 fused experts, 2 per token) with ROLL's EP example's keys (ep_size 2,
    wrap_policy.moe_experts) at 2 ranks, on transformers 5.2: fsdp2kit splits the experts over the ranks and gives
    the actor test's figures of ROLL's own FSDP2 strategy without EP, and of fsdp2kit without EP. (ROLL's own EP
    cannot run on the CPU: its ExpertParallel._token_dispatch counts tokens per expert with torch.histc on the
    routing's int64 indices, which raises "histogram_cpu" not implemented for 'Long'.) The model update sends
    ROLL's names (each expert unfused) in another order within a layer (by projection, then expert; ROLL's: each
    expert's gate and up, then the downs): its receiver loads by name."""
    ours = run_ranks("fsdp2kit", "actor_ep", moe_dir, tmp_path / "ours", 2)
    plain = run_ranks("fsdp2kit", "actor_moe", moe_dir, tmp_path / "plain", 2)
    roll = run_ranks("roll", "actor_moe", moe_dir, tmp_path / "roll", 2)
    for rank, (mine, theirs) in enumerate(zip(ours, roll, strict=True)):  # rank r holds experts 2r, 2r + 1 whole
        assert mine["experts"] and set(mine["experts"]) == set(theirs["experts"])
        for name, (dims, shape) in mine["experts"].items():
            assert "ep" in dims and shape[0] == 2, (rank, name, dims, shape)
            assert theirs["experts"][name][1][0] == 2 and "ep" not in theirs["experts"][name][0]
    report("actor with ep_size 2 against ROLL's FSDP2 without EP", assert_same_actor(ours, roll))
    report("actor with ep_size 2 against fsdp2kit without EP", assert_same_actor(ours, plain, "RollStrategy"))
