"""`training.optimizer: muon`: torch.optim.Muon's update on the hidden matrices of an FSDP2 model, each computed on
the whole matrix by one owner rank (the work divided among the ranks), AdamW on the rest; equal to one process
running torch.optim.Muon and torch.optim.AdamW on the same split, at 1, 2 and 4 ranks (HSDP), through a checkpoint
and across world sizes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, launch_two_ranks, plain_model, process_group
from muon_worker import (
    GLOBAL_MICRO_BATCHES,
    MATRICES,
    MUON_LEARNING_RATE,
    WEIGHT_DECAY,
    muon_config,
    step_on_given_gradients,
)
from muon_worker import run as run_worker
from strategy_case import clip_grad_norm_exact, global_micro_batches, policy_loss
from test_strategy import next_token_logprobs, strategy, tiny_llama
from torch.distributed.checkpoint import FileSystemReader

from fsdp2kit.config.load import load_config
from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError

STEPS = 3
# On gradients given to it, the optimizer is exact (test_muon_step_on_given_gradients_is_torch_muon_and_adamw). In
# training, FSDP's gradients differ from one process's in their last fp32 bits (sums in another order); Newton-Schulz
# starts from the update rounded to bf16, where such a difference flips a rounding now and then, and its first
# iterations multiply the matrix's small singular directions by up to 3.4445 each (torch's coefficient a): after 3
# steps at learning rate 1e-4 the weights differ by up to 1.1e-5 (measured: AdamW's embeddings, which follow the
# matrices' trajectory; Muon's matrices 5e-6), about 4% of what the 3 steps moved them, while the losses agree to 1e-9.
WEIGHTS_ATOL = 2e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("muon") / "model")


def torch_muon_split(model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """What Muon takes, written out for this Llama: its 2-D matrices but the embeddings and the LM head."""
    matrices = [n for n, p in model.named_parameters() if p.ndim == 2 and not n.startswith(("model.embed", "lm_head"))]
    return matrices, [n for n, _ in model.named_parameters() if n not in matrices]


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> dict:
    """The same training as one process: transformers' model, torch.optim.Muon on the matrices (Moonlight's learning
    rate matching, fsdp2kit's default) and torch.optim.AdamW on the rest (no decay on 1-D tensors)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    params = dict(model.named_parameters())
    matrices, rest = torch_muon_split(model)
    muon = torch.optim.Muon(
        [params[n] for n in matrices], lr=MUON_LEARNING_RATE, weight_decay=WEIGHT_DECAY, adjust_lr_fn="match_rms_adamw"
    )
    decayed = [params[n] for n in rest if params[n].ndim >= 2]
    adamw = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": WEIGHT_DECAY},
            {"params": [params[n] for n in rest if params[n].ndim < 2]},
        ],
        lr=MUON_LEARNING_RATE,
        weight_decay=0.0,
    )
    losses = []
    for step in range(STEPS):
        terms = []
        for batch in global_micro_batches(step, GLOBAL_MICRO_BATCHES):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            terms.append(policy_loss(next_token_logprobs(logits, batch["input_ids"]), batch))
        loss = torch.stack([t[0] for t in terms]).sum() / torch.stack([t[1] for t in terms]).sum()
        loss.backward()
        clip_grad_norm_exact(model.parameters(), 1.0)
        muon.step()
        adamw.step()
        model.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "weights": model.state_dict(), "matrices": matrices}


def assert_same_training(result: dict, expected: dict, first_step: int = 0) -> None:
    assert result["losses"] == pytest.approx(expected["losses"][first_step:], abs=1e-6)
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(result["weights"][name], tensor, rtol=0, atol=WEIGHTS_ATOL, msg=name)


def test_muon_at_one_rank_equals_torch_muon_and_adamw(model_dir, expected, tmp_path):
    try:
        result = run_worker(str(model_dir), str(tmp_path / "out.pt"), 1, STEPS, 0, "-")
    finally:
        shutdown()
    assert_same_training(result, expected)
    assert result["losses"][0] != result["losses"][-1]  # it trained
    (only,) = result["ranks"]
    assert only["orthogonalised"] == [sorted(expected["matrices"])] * STEPS or all(
        sorted(names) == sorted(expected["matrices"]) for names in only["orthogonalised"]
    )
    assert only["calls"] == [len(expected["matrices"])] * STEPS


def test_muon_step_on_given_gradients_is_torch_muon_and_adamw(tmp_path):
    """The optimizer alone, on gradients given to it: fsdp2kit's Muon + AdamW steps the weights exactly as
    torch.optim.Muon + torch.optim.AdamW (here one rank; the multi-rank launches check 2 and 4 ranks)."""
    with process_group():
        result = step_on_given_gradients(1)
    assert result["largest_difference"] == 0.0
    assert result["orthogonalised"] == [MATRICES, MATRICES]


def assert_work_divided(ranks: list[dict], shard_groups: list[list[int]], matrices: list[str]) -> None:
    """Within each shard group every matrix was orthogonalised by exactly one rank, each rank calling torch's
    Newton-Schulz once per matrix it owns; no rank did them all."""
    for group in shard_groups:
        for step in range(len(ranks[group[0]]["calls"])):
            owned = [ranks[rank]["orthogonalised"][step] for rank in group]
            assert sorted(name for names in owned for name in names) == sorted(matrices)
            assert all(0 < len(names) < len(matrices) for names in owned)
            assert [ranks[rank]["calls"][step] for rank in group] == [len(names) for names in owned]
        given = [ranks[rank]["given_gradients"]["orthogonalised"] for rank in group]
        for step in range(len(given[0])):
            assert sorted(name for names in given for name in names[step]) == sorted(MATRICES)


@pytest.mark.slow
def test_muon_at_two_and_four_ranks_equals_one_process_and_resumes_across_world_sizes(model_dir, expected, tmp_path):
    """2 ranks (FSDP) train 3 steps, saving after the first; 4 ranks (HSDP: 2 replicas of 2 shards) resume from that
    checkpoint and train the other 2. Both equal the one-process torch.optim.Muon run; the resumed losses equal the
    uninterrupted ones; each shard group divides the orthogonalisations between its ranks."""
    two, four = tmp_path / "two.pt", tmp_path / "four.pt"
    launch_two_ranks("muon_worker.py", model_dir, two, 2, STEPS, 1, "-", ranks=2)
    launch_two_ranks("muon_worker.py", model_dir, four, 2, STEPS, 0, f"{two}.ckpt", ranks=4)
    at_two, at_four = torch.load(two), torch.load(four)
    assert_same_training(at_two, expected)
    assert_same_training(at_four, expected, first_step=1)
    assert at_four["losses"] == pytest.approx(at_two["losses"][1:], abs=1e-6)
    assert_work_divided(at_two["ranks"], [[0, 1]], expected["matrices"])
    assert_work_divided(at_four["ranks"], [[0, 1], [2, 3]], expected["matrices"])
    for rank in [*at_two["ranks"], *at_four["ranks"]]:
        assert rank["given_gradients"]["largest_difference"] == 0.0


def test_checkpoint_round_trip_continues_the_same_muon_run(model_dir, tmp_path):
    """save_checkpoint after one step, load_checkpoint into a fresh strategy: its second step (Muon's momentum
    buffers and AdamW's moments from the checkpoint) equals the uninterrupted run's, bit for bit; a checkpoint of a
    Muon run does not continue under AdamW (its state is another optimizer's) nor under Muon's other split: one line
    each."""
    config = muon_config(str(model_dir), str(tmp_path / "run"), 3, 1)
    with strategy(config) as s:
        for step in range(2):
            s.train_step(global_micro_batches(step, 2), policy_loss)
        s.save_checkpoint(tmp_path / "ckpt")
        buffers = [s.optimizer.state[p]["momentum_buffer"].clone() for p in s.optimizer.matrices]
        uninterrupted = s.train_step(global_micro_batches(2, 2), policy_loss)["loss"]
    with strategy(config) as s:
        state = s.load_checkpoint(tmp_path / "ckpt")
        loaded = [s.optimizer.state[p]["momentum_buffer"] for p in s.optimizer.matrices]
        assert all(torch.equal(a, b) for a, b in zip(loaded, buffers, strict=True))
        resumed = s.train_step(global_micro_batches(2, 2), policy_loss)["loss"]
    assert state["step"] == 2 and resumed == uninterrupted
    config["training"]["muon_momentum"] = 0.9  # a resumed run continues with its own settings, as AdamW's do
    with strategy(config) as s:
        s.load_checkpoint(tmp_path / "ckpt")
        (muon_group,) = [group for group in s.optimizer.param_groups if group["muon"]]
        assert (muon_group["momentum"], muon_group["ns_steps"], "betas" in muon_group) == (0.9, 5, False)
    config["training"]["muon_split"] = "mindspeed_mm"  # other tensors have momentum buffers: not this state
    with strategy(config) as s, pytest.raises(UserError) as error:
        s.load_checkpoint(tmp_path / "ckpt")
    assert str(error.value) == (
        f"training.resume: '{tmp_path / 'ckpt'}' holds Muon's state for training.muon_split hidden_matrices, this "
        "run has mindspeed_mm; set training.muon_split: hidden_matrices to continue it, or training.resume: never"
    )
    config["training"]["optimizer"] = "adamw"
    with strategy(config) as s, pytest.raises(UserError) as error:
        s.load_checkpoint(tmp_path / "ckpt")
    assert str(error.value) == (
        f"training.resume: '{tmp_path / 'ckpt'}' holds the state of training.optimizer muon, this run has adamw; set "
        "training.optimizer: muon to continue it, or training.resume: never to start afresh"
    )


NATIVE = REPO / "tests/fixtures/real_configs/mindspeed_mm/examples/qwen3_5/qwen3_5_4B_config.yaml"


def native_file_with(tmp_path: Path, optimizer_lines: str) -> Path:
    """MindSpeed-MM's Qwen3.5-4B trainer file with its `optimizer: adamw` line replaced, as a user edits it."""
    text = NATIVE.read_text()
    assert text.count("  optimizer: adamw\n") == 1
    path = tmp_path / NATIVE.name
    path.write_text(text.replace("  optimizer: adamw\n", optimizer_lines))
    return path


def test_mindspeed_native_file_with_muon_maps_and_trains(tmp_path, run_main):
    """MindSpeed-MM's FSDP2 trainer keys (`optimizer: muon`, `matched_adamw_rms`, `muon_momentum`, `ns_steps`) map to
    training.optimizer and Muon's settings; the file (a tiny Qwen3.5 and image+text conversations) trains 2 steps with
    Muon, whose momentum buffers are in the final checkpoint; `adamw_swap` is one line."""
    sys.path.insert(0, str(REPO / "examples"))
    from make_vl_dataset import main as make_dataset

    lines = "  optimizer: muon\n  matched_adamw_rms: 0.3\n  muon_momentum: 0.9\n  ns_steps: 4\n"
    path = native_file_with(tmp_path, lines)
    settings = ["model.name_or_path=builtin:tiny-qwen3.5", "data.source=builtin:corpus"]
    training = load_config(str(path), settings).training
    assert (training.optimizer, training.muon_lr_adjustment, training.muon_matched_adamw_rms) == (
        "muon",
        "match_rms_adamw",
        0.3,
    )
    assert (training.muon_momentum, training.muon_ns_steps) == (0.9, 4)
    make_dataset(tmp_path, 4, 0)
    settings = [
        "model.name_or_path=builtin:tiny-qwen3.5",
        f"data.source={tmp_path / 'llamafactory.json'}",
        "data.seq_len=256",
        "training.max_steps=2",
        f"training.output_dir={tmp_path / 'run'}",
        "training.export_hf=false",
        "training.report_to=[]",
    ]
    result = run_main("train", path, *(a for s in settings for a in ("--set", s)))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["loss"] > 0 for s in steps)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_2"
    keys = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    buffers = [key for key in keys if key.endswith(".momentum_buffer")]
    assert any(".language_model.layers." in key for key in buffers)
    assert any(".embed_tokens." in key for key in buffers)  # MindSpeed-MM's split: the embeddings take Muon
    assert not [key for key in buffers if any(word in key for word in ("norm", "bias"))]
    with pytest.raises(UserError) as refused:
        load_config(str(native_file_with(tmp_path, "  optimizer: adamw_swap\n")), settings)
    assert str(refused.value).startswith(
        f"{tmp_path / NATIVE.name}: 'training.optimizer' = 'adamw_swap' is not supported"
    )


def is_muon_eligible(name: str, ndim: int) -> bool:
    """MindSpeed-MM's rule as its FSDP2 trainer writes it (`_is_muon_eligible` in Ascend/MindSpeed-MM
    mindspeed_mm/fsdp/optimizer/optimizer.py, read at commit 57069cd55a8ab16d5affe379a2e2c5f0a4d962b9)."""
    return not name.endswith(".bias") and "embedding" not in name and "output_layer" not in name and ndim == 2


def test_a_mindspeed_mm_muon_file_splits_as_mindspeed_mm(tmp_path):
    """MindSpeed-MM's models keep the HF names, so its rule gives Muon the embeddings, the LM head and the routers
    and AdamW the 3-D stacked experts, unlike fsdp2kit's: its Qwen3.5 file with `optimizer: muon` (on a tiny
    Qwen3.5-MoE) splits as the rule does on the model's names, `check` says which split applies, and
    training.muon_split gives fsdp2kit's back."""
    from fsdp2kit.check import describe
    from fsdp2kit.models.build import build_meta_model, resolve_model

    path = native_file_with(tmp_path, "  optimizer: muon\n")
    settings = ["model.name_or_path=builtin:tiny-qwen3.5-moe", "data.source=builtin:corpus"]
    cfg = load_config(str(path), settings)
    with process_group() as runtime:
        described = describe(cfg, runtime)
    shapes = {name: p.ndim for name, p in build_meta_model(resolve_model(cfg.model), cfg.model).named_parameters()}
    assert described["optimizer"] == {
        "name": "muon",
        "split": "mindspeed_mm",
        "muon": [name for name, ndim in shapes.items() if is_muon_eligible(name, ndim)],
        "adamw": [name for name, ndim in shapes.items() if not is_muon_eligible(name, ndim)],
    }
    muon, adamw = described["optimizer"]["muon"], described["optimizer"]["adamw"]
    layer = "model.language_model.layers.0.mlp"
    assert {"model.language_model.embed_tokens.weight", "lm_head.weight", f"{layer}.gate.weight"} <= set(muon)
    assert {f"{layer}.experts.gate_up_proj", f"{layer}.experts.down_proj"} <= set(adamw)
    assert any(note.startswith("training.muon_split=mindspeed_mm: ") for note in described["config_notes"])
    own = load_config(str(path), [*settings, "training.muon_split=hidden_matrices"]).training
    assert own.muon_split == "hidden_matrices"


def test_plan_counts_one_momentum_buffer_per_matrix_and_the_gathered_matrix():
    """`plan` at 2 ranks: Muon's state is one buffer per matrix (AdamW's two moments for the rest), traced and
    computed alike; the largest matrix rank 0 orthogonalises is counted whole, with Newton-Schulz's working set."""
    from fsdp2kit.memory_plan import ConfigSource, predict

    tiny = ["data.seq_len=64", "model.config.num_hidden_layers=2", "training.gradient_accumulation_steps=1"]
    plans = {
        name: predict(ConfigSource("examples/demo.yaml", [*tiny, f"training.optimizer={name}"], None, None), 2)
        for name in ("adamw", "muon")
    }
    model, _ = plain_model(load_config("examples/demo.yaml", tiny))
    matrices, _ = torch_muon_split(model)
    parameters = dict(model.named_parameters())
    matrix_bytes = sum(parameters[name].numel() * 4 for name in matrices) // 2  # fp32, each sharded over 2 ranks
    adamw, muon = plans["adamw"]["computed"], plans["muon"]["computed"]
    assert adamw["optimizer_states"] == 2 * adamw["sharded_grads"]
    assert muon["optimizer_states"] == adamw["optimizer_states"] - matrix_bytes
    traced = {name: plan["categories"]["optstate"] for name, plan in plans.items()}
    assert traced["adamw"] - traced["muon"] == pytest.approx(matrix_bytes, rel=1e-3)
    largest = max((parameters[name].shape for name in matrices), key=lambda shape: shape.numel())
    small, large = sorted(largest)
    assert muon["muon_gathered_matrix"] <= 2 * (3 * small * large + 2 * small * small)
    assert "muon_gathered_matrix" not in adamw


@pytest.mark.slow
def test_muon_at_ep2_equals_one_process(tmp_path):
    """Expert parallelism (EP 2 on 2 ranks, builtin tiny-qwen3-moe, 4 experts a layer): each rank holds 2 experts of
    every stacked tensor whole and orthogonalises those itself (nothing gathered over ep); 3 steps give one process's
    losses and weights (fsdp2kit at one rank, which steps each expert as torch.optim.Muon steps a matrix of its own:
    test_muon_step_on_given_gradients_is_torch_muon_and_adamw)."""
    from moe_families_worker import train as train_in_process

    def run(out: str, ep: int) -> dict:
        return {
            "folder": "builtin:tiny-qwen3-moe",
            "out": str(tmp_path / out),
            "experts": "",
            "per_expert": False,
            "accumulation": 4 // (2 if ep > 1 else 1),
            "ulysses": 1,
            "steps": STEPS,
            "export": False,
            "ep": ep,
            "training": {"optimizer": "muon", "learning_rate": MUON_LEARNING_RATE, "weight_decay": WEIGHT_DECAY},
        }

    try:
        train_in_process(run("one.pt", 1))
    finally:
        shutdown()
    spec = tmp_path / "ep2.json"
    spec.write_text(json.dumps([run("ep2.pt", 2)]))
    launch_two_ranks("moe_families_worker.py", spec)
    one, ep2 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "ep2.pt")
    assert ep2["losses"] == pytest.approx(one["losses"], abs=1e-5)
    assert one["losses"][0] != one["losses"][-1]
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(ep2["weights"][name], tensor, rtol=0, atol=WEIGHTS_ATOL, msg=name)
    stacked = sorted({name.split("[")[0] for name in one["orthogonalised"][0][0] if "[" in name})
    assert sorted(name.rpartition(".")[2] for name in stacked)[:: len(stacked) // 2] == ["down_proj", "gate_up_proj"]
    for step in range(STEPS):
        (everything,) = [ranks[step] for ranks in one["orthogonalised"]]
        held = [ranks[step] for ranks in ep2["orthogonalised"]]
        assert sorted(held[0] + held[1]) == sorted(everything)  # each expert once, no rank orthogonalised twice
        for rank, experts in enumerate(([0, 1], [2, 3])):
            assert sorted(name for name in held[rank] if "[" in name) == sorted(
                f"{name}[{expert}]" for name in stacked for expert in experts
            )


def test_plan_traces_muon_on_expert_parallel_stacked_experts():
    """`plan` of a Muon run at EP 2 traces the step (it builds the optimizer over fake expert-sharded tensors): each
    rank's momentum is one buffer for its 2 experts of each stacked tensor, and an expert's matrix is counted whole."""
    from fsdp2kit.memory_plan import ConfigSource, predict

    tiny = ["model.name_or_path=builtin:tiny-qwen3-moe", "data.seq_len=64", "training.optimizer=muon"]
    tiny += ["strategy_args.strategy_config.ep_size=2", "training.gradient_accumulation_steps=1"]
    plan = predict(ConfigSource("examples/demo.yaml", tiny, None, None), 2)
    assert plan["computed"]["muon_gathered_matrix"] > 0
    assert plan["categories"]["optstate"] > 0


def test_muon_with_cpu_offload_is_one_line():
    with pytest.raises(UserError) as refused:
        load_config(
            "examples/demo.yaml", ["training.optimizer=muon", "strategy_args.strategy_config.offload_policy=true"]
        )
    assert str(refused.value) == (
        "training.optimizer: muon is not available with strategy_args.strategy_config.offload_policy: true (Muon "
        "gathers each matrix on a rank's device to orthogonalise it; the offloaded ones stay in host memory); turn "
        "offload_policy off, or use training.optimizer: adamw"
    )


def test_check_names_what_muon_and_adamw_take():
    """A mixture of experts: attention projections and the 3-D stacked experts (one matrix per expert) to Muon;
    embeddings, LM head, norms and the router to AdamW."""
    from fsdp2kit.check import describe

    cfg = load_config(
        "examples/demo.yaml",
        ["model.name_or_path=builtin:tiny-qwen3-moe", "model.config.num_hidden_layers=1", "training.optimizer=muon"],
    )
    with process_group() as runtime:
        optimizer = describe(cfg, runtime)["optimizer"]
    attention = [f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkvo"]
    assert optimizer == {
        "name": "muon",
        "split": "hidden_matrices",  # fsdp2kit's own, a native file's default
        "muon": [*attention, "model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"],
        "adamw": [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
            "model.layers.0.mlp.gate.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ],
    }


@pytest.mark.parametrize("auto_class", ["AutoModelForTokenClassification", "AutoModelForSequenceClassification"])
def test_a_critics_or_reward_models_score_layer_is_left_to_adamw(auto_class):
    """Muon is for the hidden matrices: a value or reward model's `score` [1, hidden] is its final layer, as the LM
    head is a causal LM's, and goes to AdamW (orthogonalised, a one-row matrix would be rescaled to unit norm)."""
    import transformers

    from fsdp2kit.models.builtin import BUILTIN_MODELS
    from fsdp2kit.train.muon import muon_split

    settings = {**BUILTIN_MODELS["tiny-llama"], "num_hidden_layers": 1, "num_labels": 1}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = getattr(transformers, auto_class).from_config(config)
    matrices, rest = (dict(named) for named in muon_split(model))
    assert "score.weight" in rest and "score.weight" not in matrices
    assert list(matrices) == [n for n, p in model.named_parameters() if p.ndim == 2 and "layers" in n]
