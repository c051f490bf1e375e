"""SPEC §4.9 MoE on the built-in tiny Qwen3-MoE: experts sharded per layer or one by one, the expert patch that keeps
the ranks' collectives paired when they route to different experts, the router's auxiliary loss in the training
loss, and weights in and out in both expert layouts (transformers loads the export)."""

from __future__ import annotations

import shutil
import time

import pytest
import torch
import yaml
from conftest import (
    HANG_TIMEOUT_S,
    cli_without_patch,
    process_group,
    read_metrics,
    run_cli,
    sharded_model,
    token_batch,
    two_ranks_hang,
)

from fsdp2kit.check import describe
from fsdp2kit.config.schema import JobConfig
from fsdp2kit.errors import UserError
from fsdp2kit.models.export import export_hf
from fsdp2kit.train.step import token_loss_sum

PER_EXPERT = {"apply_expert_patch": True, "wrap_policy": {"moe_experts": ["Qwen3MoeMLP"]}}
FUSED = {"wrap_policy": {"moe_experts": ["Qwen3MoeExperts"]}}


def job(strategy: dict, name: str = "builtin:tiny-qwen3-moe", **model) -> JobConfig:
    return JobConfig.model_validate(
        {
            "model": {"name_or_path": name, "config": {"num_hidden_layers": 2}, **model},
            "strategy_args": {"strategy_config": strategy},
        }
    )


def test_experts_become_shard_groups_per_layer_or_one_by_one():
    with process_group() as runtime:
        fused = describe(job(FUSED), runtime)
        single = describe(job(PER_EXPERT), runtime)
    assert fused["sharded_modules"] == [
        "",
        "model.layers.0",
        "model.layers.0.mlp.experts",
        "model.layers.1",
        "model.layers.1.mlp.experts",
    ]
    assert single["sharded_modules"] == [
        "",
        "model.layers.0",
        *(f"model.layers.0.mlp.experts.{i}" for i in range(4)),
        "model.layers.1",
        *(f"model.layers.1.mlp.experts.{i}" for i in range(4)),
    ]
    assert (fused["expert_patch"], single["expert_patch"]) == (False, True)


@pytest.mark.parametrize(
    "strategy, message",
    [
        (
            {"wrap_policy": {"moe_experts": ["Qwen3MoeExpert"]}},
            "strategy_config.wrap_policy.moe_experts: class 'Qwen3MoeExpert' matches no module of the model; "
            "for its experts name 'Qwen3MoeExperts' (each layer's experts as one shard group) or 'Qwen3MoeMLP' "
            "(each expert alone, with apply_expert_patch: true)",
        ),
        (
            {"wrap_policy": {"moe_experts": ["Qwen3MoeMLP"]}},
            "strategy_config.apply_expert_patch: wrap_policy.moe_experts shards every expert on its own "
            "('model.layers.0.mlp.experts.0', ...), and ranks whose tokens go to different experts would wait for "
            "each other's all-gathers forever; set apply_expert_patch: true",
        ),
    ],
    ids=["unknown class", "per-expert without the patch"],
)
def test_expert_settings_that_cannot_work_are_refused(strategy, message):
    with process_group() as runtime, pytest.raises(UserError) as error:
        describe(job(strategy), runtime)
    assert str(error.value).startswith(message)


def test_router_aux_loss_is_part_of_the_training_loss():
    with process_group() as runtime:
        model = sharded_model(job({}), runtime, training=True).model
        batch = token_batch(2, 16)
        aux_loss = model(input_ids=batch["input_ids"], use_cache=False).aux_loss
        plain = token_loss_sum(model, batch)
        weighted = token_loss_sum(model, batch, aux_loss_weight=10.0)
        weighted.backward()
        router_grad = model.model.layers[0].mlp.gate.weight.grad
    assert aux_loss > 0
    assert (weighted - plain).item() == pytest.approx(10.0 * aux_loss.item(), rel=1e-5)
    assert router_grad.abs().sum() > 0


def test_recomputed_moe_layers_keep_the_aux_loss_gradient():
    """Reentrant checkpointing would run the layers' first forward without autograd: the router logits the aux loss
    is computed from would carry no gradient. The plan switches those layers to non-reentrant checkpointing."""

    def router_gradient(strategy: dict) -> tuple[torch.Tensor, list[str]]:
        with process_group() as runtime:
            sharded = sharded_model(job(strategy), runtime, training=True)
            token_loss_sum(sharded.model, token_batch(2, 16), aux_loss_weight=100.0).backward()
            return sharded.model.model.layers[0].mlp.gate.weight.grad.full_tensor(), sharded.plan.notes

    plain, _ = router_gradient({})
    recomputed, notes = router_gradient({"recompute_modules": ["model.layers.{*}"], "use_reentrant": True})
    assert any(note.startswith("use_reentrant: false: reentrant checkpointing") for note in notes)
    torch.testing.assert_close(recomputed, plain, rtol=1e-5, atol=1e-6)


def logits_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=input_ids, use_cache=False).logits


def test_weights_move_between_expert_layouts_and_transformers(tmp_path):
    """A split or fused model's export holds per-expert names, as Qwen3-MoE checkpoints store them and
    save_pretrained writes them; transformers loads it, fusing the experts, with the same logits. Our loader reads
    per-expert or fused files into either kind of model, each rank only its own rows (checked as rank 1 of 2)."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    input_ids = token_batch(2, 12)["input_ids"]
    with process_group() as runtime:
        split = sharded_model(job(PER_EXPERT), runtime, training=False)
        logits = logits_of(split.model, input_ids)
        export_hf(split.model, tmp_path / "per_expert", split.source.tokenizer_path, "fp32", is_main=True)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path / "per_expert", dtype=torch.float32)
    assert type(hf_model.model.layers[0].mlp.experts).__name__ == "Qwen3MoeExperts"
    torch.testing.assert_close(logits_of(hf_model, input_ids), logits, rtol=1e-5, atol=1e-5)
    fused_weights = hf_model.state_dict()[
        "model.layers.1.mlp.experts.gate_up_proj"
    ]  # [experts, gate + up rows, hidden]

    with process_group() as runtime:  # per-expert files into a fused model, exported as save_pretrained writes it
        fused = sharded_model(job({}, str(tmp_path / "per_expert"), config={}), runtime, training=False)
        torch.testing.assert_close(logits_of(fused.model, input_ids), logits, rtol=1e-5, atol=1e-5)
        export_hf(fused.model, tmp_path / "fused_export", fused.source.tokenizer_path, "fp32", is_main=True)
    with (
        safe_open(tmp_path / "fused_export" / "model.safetensors", "pt") as exported,
        safe_open(tmp_path / "per_expert" / "model.safetensors", "pt") as per_expert,
    ):
        assert sorted(exported.keys()) == sorted(per_expert.keys())  # per-expert names, whatever the model holds
    shutil.copytree(tmp_path / "per_expert", tmp_path / "fused")  # a folder holding fused tensors
    (tmp_path / "fused" / "model.safetensors").unlink()
    save_file(hf_model.state_dict(), str(tmp_path / "fused" / "model.safetensors"))
    with process_group() as runtime:  # fused files into a split model
        model = sharded_model(job(PER_EXPERT, str(tmp_path / "fused"), config={}), runtime, training=False).model
        torch.testing.assert_close(logits_of(model, input_ids), logits, rtol=1e-5, atol=1e-5)

    for folder in ("per_expert", "fused"):
        with process_group(size=2, rank=1) as runtime:
            model = sharded_model(job(PER_EXPERT, str(tmp_path / folder), config={}), runtime, training=False).model
            up_proj = model.model.layers[1].mlp.experts[3].up_proj.weight  # rows 64-127 of 128 on rank 1
            torch.testing.assert_close(up_proj.to_local(), fused_weights[3, 128 + 64 :], rtol=0, atol=0)
        with process_group(size=2, rank=1) as runtime:
            model = sharded_model(job({}, str(tmp_path / folder), config={}), runtime, training=False).model
            gate_up_proj = model.model.layers[1].mlp.experts.gate_up_proj  # experts 2 and 3 of 4 on rank 1
            torch.testing.assert_close(gate_up_proj.to_local(), fused_weights[2:], rtol=0, atol=0)


# Routing forced to differ across ranks: tests/moe_forced_routing.py sends rank 0's tokens to experts 0-1 and rank 1's
# to experts 2-5, so rank 0 calls 2 experts per layer and rank 1 calls 4.


@pytest.fixture(scope="module")
def forced_routing(tmp_path_factory):
    config = {
        "model": {
            "name_or_path": "builtin:tiny-qwen3-moe",
            "model_class": "tests/moe_forced_routing.py:ForcedRoutingQwen3Moe",
            "dtype": "fp32",
            "config": {"num_hidden_layers": 2, "num_experts": 6, "router_aux_loss_coef": 0.1},
        },
        "data": {"source": "builtin:corpus", "seq_len": 64},
        "training": {
            "learning_rate": 3.0e-3,
            "max_steps": 3,
            "per_device_train_batch_size": 1,
            "seed": 7,
            "save_steps": 0,
            "export_hf": False,
        },
        "strategy_args": {"strategy_config": PER_EXPERT},
    }
    path = tmp_path_factory.mktemp("moe") / "forced_routing.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def settings(output_dir, ranks: int) -> list[str]:
    accumulation = 2 // ranks  # a global batch of 2 one-sample micro-batches, as the forced routing expects
    return [
        "--set",
        f"training.gradient_accumulation_steps={accumulation}",
        "--set",
        f"training.output_dir={output_dir}",
    ]


@pytest.mark.slow
def test_with_the_patch_ranks_routing_differently_train_like_one_rank(forced_routing, tmp_path):
    one = run_cli("train", forced_routing, *settings(tmp_path / "one", 1), timeout=180)
    assert one.returncode == 0, one.stderr[-3000:]
    started = time.monotonic()
    two = run_cli("train", forced_routing, "--nproc", "2", *settings(tmp_path / "two", 2), timeout=180)
    assert two.returncode == 0, two.stderr[-3000:]
    print(f"\n2 ranks with the expert patch: {time.monotonic() - started:.0f}s")
    single, double = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "two")
    assert len(single) == len(double) == 3
    for a, b in zip(single, double, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)


# The run of a config with the expert patch step skipped.
WITHOUT_PATCH = cli_without_patch("apply_expert_patch")


@pytest.mark.slow
def test_without_the_patch_ranks_routing_differently_never_finish(forced_routing, tmp_path):
    """Rank 0's next collective meets rank 1's third expert all-gather. NCCL would wait there forever; gloo checks
    message sizes and aborts ("collective mismatch"). Either way the first step never finishes (patched: ~1s)."""
    args = ["train", str(forced_routing), *settings(tmp_path, 2)]
    hung, output = two_ranks_hang(WITHOUT_PATCH, args, tmp_path)
    outcome = f"hung in step 1 (a collective timed out after {HANG_TIMEOUT_S}s)" if hung else "aborted by gloo"
    assert output.count("forced routing:") == 2, output[-3000:]
    print(f"\nwithout the patch: {outcome}")
    assert hung or "Is there a distributed collective mismatch" in output, output[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or not read_metrics(tmp_path)


def test_an_expert_tensor_of_another_shape_is_one_line_in_check_train_and_convert(tmp_path, run_main):
    """A Qwen3-MoE folder as save_pretrained writes it (one tensor per expert) with one expert's up_proj a row short:
    `check`, `train` and `convert --to dcp` refuse it in one line naming that tensor and its file, as a dense
    tensor of the wrong shape is refused (they died in torch.stack fusing the experts; check passed the folder). An
    experts tensor that cannot be combined (every gate_proj of another width) is one line too."""
    from conftest import make_hf_folder, set_args
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "hf"
    make_hf_folder(folder, "tiny-qwen3-moe")
    weights = load_file(folder / "model.safetensors")
    odd = "model.layers.1.mlp.experts.2.up_proj.weight"
    save_file({**weights, odd: weights[odd][1:]}, folder / "model.safetensors", metadata={"format": "pt"})
    run = set_args({"model.name_or_path": str(folder), "training.output_dir": str(tmp_path / "run")})
    said = (
        f"error: model weights: tensor '{odd}' in 'model.safetensors' has shape (127, 256), where 3 of the tensors "
        "stacked with it into 'model.layers.1.mlp.experts.gate_up_proj' have (128, 256); config and weights do not "
        "match\n"
    )
    for command in (["check", "examples/demo.yaml", *run], ["train", "examples/demo.yaml", *run]):
        assert run_main(*command)[::2] == (2, said), command
    result = run_main("convert", folder, tmp_path / "dcp", "--to", "dcp")
    assert (result.returncode, result.stderr, (tmp_path / "dcp").exists()) == (2, said, False)

    narrow = {k: v[:, 1:].contiguous() if k.endswith("gate_proj.weight") else v for k, v in weights.items()}
    save_file(narrow, folder / "model.safetensors", metadata={"format": "pt"})
    result = run_main("check", "examples/demo.yaml", *run)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "model weights: the tensors in 'model.safetensors' that make 'model.layers.0.mlp.experts.gate_up_proj'" in (
        result.stderr
    )


def test_resuming_in_the_other_expert_layout_names_the_layout(tmp_path, run_main):
    """A checkpoint saved with one module per expert (PER_EXPERT) resumed with each layer's experts fused (the
    default), and a fused one resumed per expert: the same model, so one line naming the expert layout and its key,
    exit 2 (it said "saved from another model; give the same model")."""
    from conftest import set_args

    small = {
        "model.name_or_path": "builtin:tiny-qwen3-moe",
        "model.config.num_hidden_layers": 2,
        "data.seq_len": 32,
        "training.max_steps": 1,
        "training.export_hf": False,
    }
    per_expert = {
        "strategy_args.strategy_config.apply_expert_patch": True,
        "strategy_args.strategy_config.wrap_policy.moe_experts": ["Qwen3MoeMLP"],
    }
    cannot = "error: training.resume: checkpoint '{}' cannot be loaded into this model: it holds "
    cannot += "'model.layers.0.mlp.experts' "
    said = {
        "split": cannot + "as one module per expert (strategy_config.wrap_policy.moe_experts: [Qwen3MoeMLP] with "
        "apply_expert_patch: true) and this run fuses each layer's experts; give the wrap_policy.moe_experts and "
        "apply_expert_patch of the run that saved it\n",
        "fused": cannot + "fused (each layer's experts as one tensor) and this run splits them into one module per "
        "expert (strategy_config.wrap_policy.moe_experts: [Qwen3MoeMLP]); give the wrap_policy.moe_experts of the "
        "run that saved it\n",
    }
    for saved, saving, resuming in (("split", per_expert, {}), ("fused", {}, per_expert)):
        run = tmp_path / saved
        assert (
            run_main("train", "examples/demo.yaml", *set_args({**small, **saving, "training.output_dir": str(run)}))[0]
            == 0
        )
        checkpoint = run / "checkpoints" / "step_1"
        again = {**small, **resuming, "training.output_dir": str(tmp_path / f"{saved}-again")}
        again |= {"training.resume": str(checkpoint), "training.max_steps": 2}
        result = run_main("train", "examples/demo.yaml", *set_args(again))
        assert (result.returncode, result.stderr) == (2, said[saved].format(checkpoint))
