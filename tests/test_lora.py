"""LoRA through peft on FSDP2: 2 ranks match 1, adapter-only checkpoints resume exactly and reshard, the exported
adapter loads in peft (and the merged model in transformers) with the log-probs `fsdp2kit infer` gives, only the
adapters are optimised, and the real ROLL / MindSpeed-MM LoRA configs give the plan they mean."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from conftest import make_hf_folder, process_group, read_metrics, run_cli, sharded_model, token_batch
from test_infer import TEXTS, reference_logprobs

from fsdp2kit.config import load_config
from fsdp2kit.errors import UserError

FIXTURES = Path(__file__).parent / "fixtures"
ROLL_LORA = FIXTURES / "real_configs/roll/examples/qwen2.5-7B-rlvr_megatron/rlvr_lora_fsdp2.yaml"
MINDSPEED_LORA_FSDP2 = FIXTURES / "real_configs/mindspeed_mm/examples/magistral-2509/fsdp2_lora_config.yaml"
MINDSPEED_LORA_ARGS = FIXTURES / "lora_configs/mindspeed_mm_qwen3vl_lora_sft_30B.yaml"
STEPS = 6
TOLERANCE = 1e-5


def lora_args(base: Path, out: Path, nproc: int, *extra: str) -> list[str]:
    settings = {
        "model.name_or_path": base,
        "model.lora": "{rank: 4, alpha: 8, target_modules: all-linear}",
        "data.seq_len": 64,
        "training.max_steps": STEPS,
        "training.save_steps": 3,
        "training.learning_rate": 1e-2,
        "training.warmup_steps": 0,
        "training.lr_scheduler_type": "constant",
        "training.output_dir": out,
        "training.per_device_train_batch_size": 2,
        "training.gradient_accumulation_steps": 2 // nproc,  # the same global batch of 4 at 1 and 2 ranks
        "strategy_args.strategy_config.async_save_ckpt": False,
    }
    return [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")] + list(extra)


def train(base: Path, out: Path, nproc: int, *extra: str) -> list[float]:
    result = run_cli("train", "examples/demo.yaml", "--nproc", nproc, *lora_args(base, out, nproc, *extra))
    assert result.returncode == 0, result.stderr
    return [record["loss"] for record in read_metrics(out)]


def relative_differences(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b)
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A pretrained base folder, a 2-rank LoRA run (with the merged export) and a 1-rank run of the same job."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    make_hf_folder(base, "tiny-llama")
    two = train(base, root / "two", 2, "--set", "training.export_merged=true")
    one = train(base, root / "one", 1)
    return root, base, one, two


@pytest.mark.slow
def test_two_ranks_match_one_and_losses_fall(runs):
    _, _, one, two = runs
    assert len(one) == STEPS
    assert max(relative_differences(two, one)) < TOLERANCE
    assert one[-1] < one[0] - 0.3  # the adapters learn: the comparison means something


@pytest.mark.slow
def test_checkpoints_hold_adapters_only_resume_exactly_and_reshard(runs):
    """Adapter-only checkpoints; resumed with the base read again from its folder."""
    root, base, one, two = runs
    step = root / "one" / "checkpoints" / "step_3"
    metadata = (step / ".metadata").read_bytes()
    assert b"lora_A" in metadata and b"base_layer" not in metadata and b"embed_tokens" not in metadata
    assert (step / "adapter_config.json").is_file() and not (step / "config.json").exists()
    base_bytes = sum(f.stat().st_size for f in base.glob("*.safetensors"))
    checkpoint_bytes = sum(f.stat().st_size for f in step.glob("*.distcp"))
    assert checkpoint_bytes < base_bytes / 5  # adapters and their AdamW state only
    resumed = {}
    for source in ("one", "two"):  # both resumed on 1 rank: the same world, and 2 -> 1 resharded by DCP
        out = root / f"resumed_from_{source}"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(root / source / "checkpoints" / "step_3", out / "checkpoints" / "step_3")
        resumed[source] = train(base, out, 1)
    assert resumed["one"] == one[3:]  # bit for bit
    assert max(relative_differences(resumed["two"], two[3:])) < TOLERANCE


@pytest.mark.slow
def test_exported_adapter_and_merged_model_give_infer_logprobs(runs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, base, _, _ = runs
    adapter, merged = root / "two" / "adapter", root / "two" / "hf"
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    result = run_cli(
        "infer",
        "examples/demo.yaml",
        *("--set", f"model.name_or_path={base}", "--set", f"model.lora.adapter={adapter}"),
        *("--set", f"data.source={data}", "--set", f"training.output_dir={tmp_path}"),
        *("--set", "strategy_args.strategy_name=fsdp2_infer", "--set", "infer_batch_size=3"),
    )
    assert result.returncode == 0, result.stderr
    ours = [json.loads(line)["sum_logprob"] for line in (tmp_path / "infer.jsonl").read_text().splitlines()[:-1]]

    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    base_only = reference_logprobs(AutoModelForCausalLM.from_pretrained(base).eval(), base)
    expected = reference_logprobs(with_peft, base)
    assert ours == pytest.approx(expected, abs=1e-4)
    assert max(abs(a - b) for a, b in zip(expected, base_only, strict=True)) > 1e-2  # the adapter changed something
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    assert reference_logprobs(plain, merged) == pytest.approx(expected, abs=1e-4)


@pytest.mark.slow
def test_convert_a_lora_checkpoint_and_merge_an_adapter(runs, tmp_path):
    """A LoRA checkpoint converts to the same PEFT folder the run exported; peft's merge_and_unload of the adapter
    (convert --adapter) gives the weights of the run's own streamed merged export."""
    from safetensors.torch import load_file

    root, base, _, _ = runs
    result = run_cli("convert", root / "one" / "checkpoints" / f"step_{STEPS}", tmp_path / "peft", "--to", "hf")
    assert result.returncode == 0, result.stderr
    converted = load_file(tmp_path / "peft" / "adapter_model.safetensors")
    exported = load_file(root / "one" / "adapter" / "adapter_model.safetensors")
    assert converted.keys() == exported.keys() and all(torch.equal(converted[k], exported[k]) for k in exported)

    result = run_cli("convert", base, tmp_path / "merged", "--to", "hf", "--adapter", root / "two" / "adapter")
    assert result.returncode == 0, result.stderr
    by_peft = {k: v for f in (tmp_path / "merged").glob("*.safetensors") for k, v in load_file(f).items()}
    ours = {k: v for f in (root / "two" / "hf").glob("*.safetensors") for k, v in load_file(f).items()}
    assert by_peft.keys() == ours.keys()
    for key, tensor in ours.items():
        torch.testing.assert_close(by_peft[key], tensor, rtol=1e-6, atol=1e-6)


def build(overrides: list[str], base: str = "builtin:tiny-llama"):
    cfg = load_config(
        "examples/demo.yaml", [f"model.name_or_path={base}", "model.config.num_hidden_layers=2"] + overrides
    )
    return cfg, lambda runtime: sharded_model(cfg, runtime, training=True)


def test_only_adapters_are_optimised_and_adamw_state_is_twice_their_bytes():
    from fsdp2kit.train.optim import build_optimizer
    from fsdp2kit.train.step import token_loss_sum

    cfg, make = build(["model.lora={rank: 4, target_modules: [q_proj, v_proj]}", "model.dtype=bf16"])
    with process_group() as runtime:
        sharded = make(runtime)
        model, adapters = sharded.model, sharded.variant.adapter_plan
        optimizer = build_optimizer(model, cfg.training)
        optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
        names = [n for n, p in model.named_parameters() if id(p) in optimised]
        assert names and all(".lora_A." in n or ".lora_B." in n for n in names)
        assert {p.dtype for n, p in model.named_parameters() if id(p) in optimised} == {torch.float32}
        assert {p.dtype for n, p in model.named_parameters() if id(p) not in optimised} == {torch.bfloat16}
        token_loss_sum(model, token_batch(2, 16)).backward()
        optimizer.step()
        state_bytes = sum(
            t.to_local().numel() * t.element_size()
            for state in optimizer.state.values()
            for key, t in state.items()
            if key != "step"
        )
        param_bytes = sum(
            p.to_local().numel() * p.element_size() for n, p in model.named_parameters() if id(p) in optimised
        )
    assert state_bytes == 2 * param_bytes == adapters.optimizer_state_bytes
    assert adapters.parameter_bytes == param_bytes and adapters.parameters == param_bytes // 4
    # every decoder layer's adapters are in that layer's shard group, none in the root
    assert set(adapters.groups) == {"model.layers.0", "model.layers.1"}
    assert adapters.modules == [f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "v_proj")]


def test_modules_to_save_round_trip_through_peft(tmp_path):
    """A module trained whole beside the adapters (modules_to_save) starts as the base's module, is written where
    peft reads it, and the PEFT folder reproduces the sharded model's logits, as does the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp2kit.models.export import export_hf
    from fsdp2kit.models.lora import export_adapter

    base = tmp_path / "base"
    make_hf_folder(base, "tiny-llama")
    lora = "model.lora={rank: 4, target_modules: [q_proj], modules_to_save: [lm_head], init_lora_weights: false}"
    _, make = build([lora], base=str(base))
    batch = token_batch(2, 16)
    with process_group() as runtime:
        sharded = make(runtime)
        model = sharded.model
        assert sharded.variant.adapter_plan.modules[-1] == "lm_head"
        head = model.get_submodule("lm_head")
        trained, original = head.modules_to_save["default"].weight, head.original_module.weight
        assert trained.requires_grad and not original.requires_grad
        assert torch.equal(trained.full_tensor(), original.full_tensor())  # starts as the base's head
        with torch.no_grad():
            trained.mul_(1.5)  # as if trained
            ours = model(input_ids=batch["input_ids"]).logits
        export_adapter(model, tmp_path / "adapter", str(base), is_main=True)
        export_hf(model, tmp_path / "merged", sharded.source.tokenizer_path, "fp32", is_main=True)
    with_peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(with_peft(input_ids=batch["input_ids"]).logits, ours, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(merged(input_ids=batch["input_ids"]).logits, ours, rtol=1e-4, atol=1e-4)


def test_reentrant_recompute_still_reaches_the_adapters():
    """Frozen embeddings give recomputed layers inputs without grad; reentrant checkpointing would then drop the
    adapters' gradients, unless the embeddings' output is made to require grad (as ROLL and MindSpeed-MM do)."""
    from fsdp2kit.train.step import token_loss_sum

    grads = {}
    for recompute in (False, True):
        _, make = build(["model.lora={rank: 4, init_lora_weights: false}", f"model.gradient_checkpointing={recompute}"])
        with process_group() as runtime:
            sharded = make(runtime)
            if recompute:
                assert sharded.variant.adapter_plan.input_grad_hooks == ["model.embed_tokens"]
            token_loss_sum(sharded.model, token_batch(2, 16)).backward()
            grads[recompute] = {
                n: p.grad.full_tensor().clone() for n, p in sharded.model.named_parameters() if p.requires_grad
            }
    assert grads[True].keys() == grads[False].keys()
    for name, grad in grads[False].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[True][name], grad)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["model.lora={target_modules: [qq_proj]}"],
            "model.lora.target_modules: Target modules {'qq_proj'} not found in the base model (linear layers are "
            "named like 'model.layers.0.self_attn.q_proj')",
        ),
        (["model.lora={target_modules: ['model.layers.{7}.mlp']}"], "model.lora.target_modules: pattern"),
        (["model.lora={adapter: /nonexistent}"], "model.lora.adapter: '/nonexistent' is not a PEFT adapter folder"),
    ],
)
def test_lora_mistakes_are_one_sentence(overrides, message):
    _, make = build(overrides)
    with process_group() as runtime, pytest.raises(UserError) as error:
        make(runtime)
    assert message in str(error.value)


def test_merged_export_needs_lora():
    with pytest.raises(UserError, match="training.export_merged"):
        load_config("examples/demo.yaml", ["training.export_merged=true"])


def check_json(*args: str) -> dict:
    result = run_cli("check", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_roll_lora_role_gives_its_plan():
    """ROLL's qwen2.5-7B rlvr_lora_fsdp2 example as written; the model (keeping Qwen2.5's context length, as the
    file trains on 2048 + 4096 tokens), its data (not on this machine) and the devices swapped by --set."""
    plan = check_json(
        ROLL_LORA,
        *("--set", "model.name_or_path=builtin:tiny-qwen3", "--set", "model.config.max_position_embeddings=32768"),
        *("--set", "device_mapping=[0]", "--set", "data.source=builtin:corpus"),
    )
    lora = plan["lora"]
    assert (lora["rank"], lora["alpha"], lora["dtype"]) == (32, 32, "float32")  # autocast_adapter_dtype: fp32
    layers = [f"model.layers.{i}" for i in range(4)]
    assert lora["modules"] == [f"{layer}.self_attn.{p}_proj" for layer in layers for p in "qkvo"]
    assert list(lora["groups"]) == layers
    assert plan["trainable_parameters"] == lora["parameters"]
    assert plan["mixed_precision"] == {**plan["mixed_precision"], "param_dtype": "bfloat16", "reduce_dtype": "float32"}
    assert plan["master_dtype"] == "bfloat16"  # the frozen base stays in model_args.dtype
    assert plan["recompute_modules"] == []  # the file disables gradient checkpointing for LoRA


def test_mindspeed_mm_lora_config_gives_its_plan(tmp_path):
    """MindSpeed-MM's Qwen3-VL LoRA `lora_args` block as written, over its Magistral fsdp2 LoRA config."""
    lora_args = yaml.safe_load(MINDSPEED_LORA_ARGS.read_text())["lora_args"]
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"name_or_path": "builtin:tiny-llama", "lora": lora_args}}))
    plan = check_json(
        config,
        *("--fsdp2-config", MINDSPEED_LORA_FSDP2),
        *(
            "--set",
            'strategy_args.strategy_config.sub_modules_to_wrap=["model.embed_tokens","model.layers.{*}","lm_head"]',
        ),
        *("--set", 'strategy_args.strategy_config.recompute_modules=["model.layers.{*}"]'),
    )
    lora = plan["lora"]
    assert (lora["rank"], lora["alpha"]) == (8, 16)
    layers = [f"model.layers.{i}" for i in range(4)]
    assert lora["modules"] == [f"{layer}.self_attn.{p}_proj" for layer in layers for p in "qkvo"]
    assert list(lora["groups"]) == layers
    assert lora["input_grad_hooks"] == ["model.embed_tokens"]  # lora_register_forward_hook: embed_tokens
    assert plan["recompute_modules"] == layers and plan["use_reentrant"] is False
