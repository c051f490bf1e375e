"""verl's own TrainingWorker (verl 0.9.1, transformers 5.10.4, tensordict 0.10.0: verl's pins) drives fsdp2kit's
engine as verl's PPO trainer drives its actor, reference and critic (dense loss masks, after left_right_2_no_padding)
and as its SFT trainer drives it (jagged loss masks), and equals verl's own FSDP2 engine
(`FSDPEngineWithLMHead` / `FSDPEngineWithValueHead`, strategy fsdp2) on the same inputs: log-probs, entropy, values,
losses and every metric verl reports (reduced with verl's reduce_metrics), grad norms, the weights after two
optimizer steps at lr 1e-2 with weight decay on every parameter, offload and checkpoint round trips; at 1 and 2
ranks, Ulysses, and verl's default mixed precision (bf16 parameters); and verl's delta weight sync fed by either
engine (issue 60). verl_driver.py runs one backend per launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_models import tiny_qwen2

from fsdp2kit.distributed import free_port

HERE = Path(__file__).resolve().parent
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
LOG_PROBS, GRAD_NORM, WEIGHTS = 1e-5, 1e-5, 1e-3  # issue 40's bounds (weights after a step at lr 1e-2)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("verl")
    return {
        "model": str(tiny_qwen2(folder / "actor")),
        "critic_model": str(tiny_qwen2(folder / "critic", critic=True)),
        "folder": folder,
    }


def run(models: dict, backend: str, ranks: int = 1, **settings) -> dict:
    """verl_driver.py with one backend at `ranks` ranks; rank 0's results."""
    name = "-".join([backend, str(ranks), *(f"{k}{v}" for k, v in sorted(settings.items()) if k != "roles")])
    out = models["folder"] / f"{name}.pt"
    if out.is_file():  # the same launch, already run by another test of this module
        return torch.load(out, weights_only=False)
    config = {
        "backend": backend,
        "model": models["model"],
        "critic_model": models["critic_model"],
        "out": str(out),
        "ulysses": 1,
        "mixed_precision": FP32,
        "max_tokens": 24,  # a few micro-batches per mini-batch (verl's dynamic batch size)
        "lr": 1e-2,
        "weight_decay": 0.1,  # norms decayed or not: lr x wd x 2 steps = 2e-3, over the weights' bound
        "remove_padding": True,
        "roles": ["actor", "critic", "sft", "delta"],
        "port": free_port(),
        **settings,
    }
    driver = [str(HERE / "verl_driver.py"), json.dumps(config)]
    if ranks > 1:
        driver = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port", str(free_port())]
        driver += [str(HERE / "verl_driver.py"), json.dumps(config)]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    result = subprocess.run([sys.executable, *driver], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return torch.load(out, weights_only=False)


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# The metrics that do not depend on the micro-batch split: global-batch sums (verl's SUM aggregation) and the step's.
SPLIT_FREE = {"loss", "actor/pg_loss", "actor/entropy_loss", "grad_norm", "lr"}


def same_metrics(ours: dict, verl: dict, same_split: bool = True) -> None:
    """verl's reduced metrics, every one verl reports (mfu divides by the time each took); with another micro-batch
    split, the split-free ones (verl averages the others over micro-batches)."""
    assert set(ours) == set(verl)
    for key in (set(verl) if same_split else SPLIT_FREE) - {"mfu"}:
        assert ours[key] == pytest.approx(verl[key], rel=1e-5, abs=1e-6), key


def assert_actor_equal(ours: dict, verl: dict, same_split: bool = True) -> None:
    """`same_split`: both cut the batch into as many micro-batches (not so under Ulysses, whose token budget is
    verl's max_token_len_per_gpu x the Ulysses size)."""
    for key in ("log_probs", "entropy"):
        assert largest(ours["before"][key], verl["before"][key]) <= LOG_PROBS, key
        assert largest(ours["after"][key], verl["after"][key]) <= LOG_PROBS, key
    if same_split:  # infer_batch(compute_loss=False) reports verl's loss: 1.0 per micro-batch
        assert ours["before"]["metrics"] == verl["before"]["metrics"]
    same_metrics(ours["update"]["reduced"], verl["update"]["reduced"], same_split)
    assert ours["update"]["metrics"]["grad_norm"] == pytest.approx(verl["update"]["metrics"]["grad_norm"], GRAD_NORM)
    assert len(ours["update"]["metrics"]["grad_norm"]) == 2  # two mini-batches, an optimizer step each
    assert ours["weights"].keys() == verl["weights"].keys()
    assert max(largest(ours["weights"][n], verl["weights"][n]) for n in verl["weights"]) <= WEIGHTS
    # fsdp2kit's reference (forward only) gives verl's log-probs of the weights before the update
    assert largest(ours["ref"]["log_probs"], verl["before"]["log_probs"]) <= LOG_PROBS
    # to("cpu") / to("device") and save_checkpoint / (another update) / load_checkpoint leave the model as it was
    for engine in (ours, verl):
        assert torch.equal(engine["offloaded"]["log_probs"], engine["after"]["log_probs"])
        assert torch.equal(engine["restored"]["log_probs"], engine["after"]["log_probs"])


def assert_critic_equal(ours: dict, verl: dict) -> None:
    for stage in ("before", "after"):
        assert largest(ours[stage]["values"], verl[stage]["values"]) <= LOG_PROBS, stage
    same_metrics(ours["update"]["reduced"], verl["update"]["reduced"])
    assert ours["update"]["metrics"]["grad_norm"] == pytest.approx(verl["update"]["metrics"]["grad_norm"], GRAD_NORM)
    assert max(largest(ours["weights"][n], verl["weights"][n]) for n in verl["weights"]) <= WEIGHTS


@pytest.mark.slow
def test_actor_reference_and_critic_equal_verl_fsdp2_at_one_rank(models):
    ours, verl = run(models, "fsdp2kit"), run(models, "fsdp2")
    assert_actor_equal(ours["actor"], verl["actor"])
    assert_critic_equal(ours["critic"], verl["critic"])
    assert_sft_equal(ours["sft"], verl["sft"])


def assert_sft_equal(ours: dict, verl: dict) -> None:
    """verl's SFT calls on jagged loss masks: the validation loss (infer_batch with verl's sft_loss), the step's loss,
    grad norm and lr, the log-probs after it."""
    for stage in ("validation", "step"):
        assert ours[stage].keys() == verl[stage].keys()
        for key in verl[stage]:
            assert ours[stage][key] == pytest.approx(verl[stage][key], rel=GRAD_NORM), (stage, key)
    assert largest(ours["log_probs"], verl["log_probs"]) <= LOG_PROBS


@pytest.mark.slow
def test_actor_and_critic_equal_verl_fsdp2_at_two_ranks(models):
    ours, verl = run(models, "fsdp2kit", ranks=2), run(models, "fsdp2", ranks=2)
    assert ours["dp"] == verl["dp"] == 2
    # fsdp2kit's adapter, imported before verl starts the process group, kept every thread that allocated after it
    # from making a heap of its own (gloo's among them); verl's side imports no fsdp2kit, and its threads made theirs.
    heaps = ours["heaps"]
    assert heaps["after the run"] == heaps["at the adapter's import"] < verl["heaps"]["after the run"], heaps
    assert_actor_equal(ours["actor"], verl["actor"])
    assert_critic_equal(ours["critic"], verl["critic"])
    assert_sft_equal(ours["sft"], verl["sft"])


@pytest.mark.slow
def test_ulysses_equals_verl_over_the_same_batch(models):
    """Ulysses 2 over 2 ranks (one data-parallel rank: the whole batch) equals verl's FSDP2 at one rank. verl's own
    Ulysses is not the reference: it splits attention only through its flash-attention patch, so with sdpa on the CPU
    its log-probs differ from its own 1-rank run by 0.3."""
    ours = run(models, "fsdp2kit", ranks=2, ulysses=2, roles=["actor"])
    verl = run(models, "fsdp2")
    assert ours["dp"] == 1
    assert_actor_equal(ours["actor"], verl["actor"], same_split=False)


@pytest.mark.slow
def test_verl_s_default_mixed_precision_is_applied(models):
    """verl's default `mixed_precision` (null: bf16 parameters, fp32 reduction): fsdp2kit computes with bf16
    parameters (its log-probs move from its fp32 ones: 3.1e-3 measured) and stays within bf16's precision of verl's
    (2.2e-2 measured; verl also autocasts its LM head to bf16, which alone moves its log-probs 2.1e-2 from fp32)."""
    ours = run(models, "fsdp2kit", mixed_precision=None, roles=["actor"])["actor"]
    verl = run(models, "fsdp2", mixed_precision=None, roles=["actor"])["actor"]
    fp32 = run(models, "fsdp2kit")["actor"]
    bf16_gap = largest(ours["before"]["log_probs"], verl["before"]["log_probs"])
    assert bf16_gap <= 0.05
    assert largest(ours["before"]["log_probs"], fp32["before"]["log_probs"]) > 1e-3
    # bf16 rounding apart (verl autocasts around bf16 parameters; measured 3% apart after the first step)
    assert ours["update"]["metrics"]["grad_norm"] == pytest.approx(verl["update"]["metrics"]["grad_norm"], rel=0.05)


def test_delta_sync_methods_are_verl_s():
    """The delta-sync calls verl's delta engine makes: `get_per_tensor_param` as it was, the shard and delta exports
    fsdp2kit's, `prime_delta_snapshots` verl's own BaseEngine's (over fsdp2kit's shard export); a delta before the
    seed's snapshots is refused."""
    from verl.workers.engine.base import BaseEngine

    from fsdp2kit.errors import UserError
    from fsdp2kit.integrations.verl import Fsdp2kitEngine, Fsdp2kitEngineConfig, Fsdp2kitValueEngine, VerlEngine

    for engine in (Fsdp2kitEngine, Fsdp2kitValueEngine):
        assert engine.prime_delta_snapshots is BaseEngine.prime_delta_snapshots
        for name in ("get_per_tensor_param", "get_per_tensor_param_shard", "get_per_tensor_param_delta_shard"):
            assert getattr(engine, name) is getattr(VerlEngine, name), name
    with pytest.raises(UserError, match="prime_delta_snapshots"):
        Fsdp2kitEngine(None, Fsdp2kitEngineConfig(), None, None).get_per_tensor_param_delta_shard()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int16)


def assert_synced(role: dict) -> None:
    """verl's delta sync from one engine (verl_driver.DeltaSync): the receiver's weights, the seed (the full export
    in bf16) with the steady delta applied by verl's receiver, are the engine's full export after the update cast to
    bf16, bitwise; the delta carried exactly the values whose bits changed."""
    sync, full = role["sync"], {name: tensor.to(torch.bfloat16) for name, tensor in role["weights"].items()}
    assert sync["received"].keys() == full.keys() == sync["seed"].keys()
    for name, tensor in full.items():
        assert torch.equal(bits(sync["received"][name]), bits(tensor)), name
        assert sync["changed"][name] == int((bits(sync["seed"][name]) != bits(tensor)).sum()), name


def same_bits(ours: dict, verl: dict) -> bool:
    return ours.keys() == verl.keys() and all(torch.equal(bits(ours[name]), bits(verl[name])) for name in verl)


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_verl_delta_sync_from_fsdp2kit_equals_verl_fsdp2(models, ranks):
    """Issue 60's verl drop-in: verl's delta weight sync driven as `DeltaShardedCheckpointEngine.send_weights` drives
    it (the seed: `get_per_tensor_param`, `prime_delta_snapshots`; an update; the steady sync:
    `get_per_tensor_param_delta_shard`, whose entries verl's `hf_delta_export` computes from the engine's
    `get_per_tensor_param_shard`), the entries gathered to rank 0 with verl's own `gather_slot_entries_to_rank0` over
    gloo in the steps of its `_GatherQueue` (whose module needs zmq and cupy), packed as its `_assemble_flush` packs
    them (verl's `DeltaParam`, checksum) and applied onto the seed by verl's SGLang receiver (`apply_delta`).
    From fsdp2kit's engine and from verl's FSDP2 engine alike, the receiver then holds the engine's full export cast
    to bf16, bitwise: the actor after its update at lr 1e-2 (most values change), the critic's, and the critic's at
    an RL learning rate (1e-5: about a fifth change, the norms' none). For that last run both engines' updated
    weights are bitwise equal, so the two receivers hold the same bf16 weights, bitwise; the actor's updates are not
    (75 bf16 values apart at one rank: Adam turns last-bit differences of near-zero gradients into whole steps; at lr
    1e-5 one value of k_proj's bias, whose gradient is rounding alone), nor the critic's at 1e-2 at one rank (2)."""
    ours, verl = run(models, "fsdp2kit", ranks=ranks), run(models, "fsdp2", ranks=ranks)
    for result in (ours, verl):
        for role in ("actor", "critic", "delta"):
            assert_synced(result[role])
    for role in ("actor", "critic", "delta"):  # the same model: the same seed
        assert same_bits(ours[role]["sync"]["seed"], verl[role]["sync"]["seed"]), role
    assert same_bits(ours["delta"]["sync"]["received"], verl["delta"]["sync"]["received"])
    changed = sum(ours["delta"]["sync"]["changed"].values())
    assert 0 < changed < sum(t.numel() for t in ours["delta"]["sync"]["seed"].values()) / 2
