"""LoRA on mixtures of experts (issue 53): on transformers 5's MoE families peft (>= 0.17) takes `all-linear` to the
fused experts' 3-D parameters and the router's weight, each wrapped in a `ParamWrapper` (nested, one per parameter).
After 3 steps, every merged form of the model fsdp2kit hands out — `Strategy.export_hf` (what
`training.export_merged` writes to output_dir/hf), `full_weights` (what verl and ROLL send a rollout engine) — gives
the trained model's log-probs in transformers (1e-5), and so do the exported PEFT adapter and `convert --adapter`
(peft's merge_and_unload) on the base folder. Cases: each MoE family of the zoo (tests/zoo_case.py), the builtin
tiny-qwen3-moe, and PEFT adapters fsdp2kit does not create itself but trains and merges: fused experts stored
(in, out) (gpt-oss, `is_transposed`) named by `target_parameters`, DoRA, and `lora_bias`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from zoo_case import FAMILIES, family_folder, probe_batch, zoo_batches, zoo_config

from fsdp2kit.distributed import shutdown

STEPS = 3
TOLERANCE = 1e-5
MOE_FAMILIES = [f for f in FAMILIES if {"num_experts", "num_local_experts", "n_routed_experts"} & set(f.config)]


def _all_linear(folder: Path | None) -> dict[str, Any]:
    return {"rank": 4, "alpha": 8}  # target_modules: all-linear, the default


def peft_adapter(**settings: Any) -> Callable[[Path | None], dict[str, Any]]:
    """A PEFT adapter folder made by peft on the base model (B random: the adapter acts from step 0)."""

    def make(folder: Path | None) -> dict[str, Any]:
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        assert folder is not None
        torch.manual_seed(3)
        base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        config = LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **settings)
        adapter = folder.parent / f"{folder.name}-adapter-{'-'.join(sorted(settings))}"
        get_peft_model(base, config).save_pretrained(adapter)
        return {"adapter": str(adapter)}

    return make


GPT_OSS_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # stored (experts, in, out)
# case -> (zoo family or builtin, what model.lora says, whether peft adapts fused experts there)
CASES: dict[str, tuple[str, Callable[[Path | None], dict[str, Any]], bool]] = {
    **{f.name: (f.name, _all_linear, f.name not in ("qwen2_moe", "gpt_oss")) for f in MOE_FAMILIES},
    "builtin:tiny-qwen3-moe": ("builtin:tiny-qwen3-moe", _all_linear, True),
    "gpt_oss-target_parameters": (
        "gpt_oss",
        peft_adapter(target_modules=["q_proj"], target_parameters=GPT_OSS_EXPERTS),
        True,
    ),
    "qwen2_moe-dora": ("qwen2_moe", peft_adapter(target_modules=["q_proj", "o_proj"], use_dora=True), False),
    "qwen2_moe-lora_bias": ("qwen2_moe", peft_adapter(target_modules=["q_proj", "v_proj"], lora_bias=True), False),
}


def log_probs_of(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(**batch).logits
    return torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)


def transformers_log_probs(folder: Path, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    return log_probs_of(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), batch)


def stored(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(folder / "model.safetensors", "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def train_case(name: str, root: Path) -> dict[str, Any]:
    """The case trained STEPS steps in this process (a world of one), its log-probs, exports and weights."""
    import fsdp2kit
    from fsdp2kit.models.lora import adapted_tensors, export_adapter

    source, lora, _ = CASES[name]
    out = root / name.replace(":", "-")
    if source.startswith("builtin:"):
        folder, overrides = None, {"name_or_path": source, "config": {"num_hidden_layers": 1}}
    else:
        folder = family_folder(root, next(f for f in MOE_FAMILIES if f.name == source))
        overrides = {"name_or_path": str(folder)}
    cfg = zoo_config(folder or root, out)
    cfg["model"] = {**cfg["model"], **overrides, "dtype": "fp32", "lora": lora(folder)}
    cfg["training"]["max_steps"] = STEPS
    strategy = fsdp2kit.Strategy.from_config(cfg)
    if folder is None:  # the builtin's base: its step-0 export (B = 0: the base itself)
        folder = out / "base"
        strategy.export_hf(folder)
    for batch in zoo_batches(STEPS):
        strategy.train_step([batch])
    trained = strategy.forward_step(probe_batch())["log_probs"]
    strategy.export_hf(out / "hf")
    weights = {key: tensor.clone() for key, tensor in strategy.full_weights(bucket_bytes=1 << 14)}
    export_adapter(strategy.model, out / "adapter", str(folder), is_main=True)
    return {
        "base": folder,
        "out": out,
        "trained": trained,
        "after_exports": strategy.forward_step(probe_batch())["log_probs"],
        "weights": weights,
        "adapted_experts": sorted(key for key in adapted_tensors(strategy.model) if ".experts." in key),
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    root = tmp_path_factory.mktemp("lora_moe")
    try:
        return {name: train_case(name, root) for name in CASES}
    finally:
        shutdown()


@pytest.mark.parametrize("case", CASES)
def test_every_merged_export_gives_the_trained_models_log_probs(case, trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fsdp2kit.checkpoint.lora_convert import merge_adapter

    result = trained[case]
    probe = probe_batch()
    real = probe["attention_mask"][:, 1:].bool()
    expected = result["trained"][real]
    exported = stored(result["out"] / "hf")
    assert sorted(result["weights"]) == sorted(exported)  # full_weights: the export's names and tensors
    assert all(torch.equal(result["weights"][key], exported[key]) for key in exported)
    torch.testing.assert_close(result["after_exports"], result["trained"], atol=0, rtol=0)  # nothing merged in place
    from_folder = transformers_log_probs(result["out"] / "hf", probe)[real]
    torch.testing.assert_close(from_folder, expected, atol=TOLERANCE, rtol=0)
    # The adapter folder through peft, and convert --adapter (peft's merge_and_unload), on the base folder
    with_peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(result["base"], dtype=torch.float32), result["out"] / "adapter"
    )
    torch.testing.assert_close(log_probs_of(with_peft, probe)[real], expected, atol=TOLERANCE, rtol=0)
    merge_adapter(result["base"], result["out"] / "adapter", result["out"] / "converted", torch.float32)
    torch.testing.assert_close(
        transformers_log_probs(result["out"] / "converted", probe)[real], expected, atol=TOLERANCE, rtol=0
    )
    # Not vacuous: the adapters moved the model, and where peft adapts the fused experts their export changed
    assert (transformers_log_probs(result["base"], probe)[real] - expected).abs().max() > 1e-2
    assert bool(result["adapted_experts"]) == CASES[case][2]
    base = stored(result["base"])
    changed_experts = [key for key in exported if ".experts." in key and not torch.equal(exported[key], base[key])]
    assert bool(changed_experts) == CASES[case][2], changed_experts[:3]


def test_an_adapter_no_tensor_can_hold_is_refused_not_dropped(tmp_path):
    """`lora_bias` on a layer without a bias (Qwen2-MoE's o_proj): peft's forward adds it, no merged model can."""
    import fsdp2kit
    from fsdp2kit.errors import UserError

    folder = family_folder(tmp_path, next(f for f in MOE_FAMILIES if f.name == "qwen2_moe"))
    cfg = zoo_config(folder, tmp_path / "out")
    cfg["model"] |= {"dtype": "fp32", "lora": peft_adapter(target_modules=["o_proj"], lora_bias=True)(folder)}
    try:
        strategy = fsdp2kit.Strategy.from_config(cfg)
        with pytest.raises(UserError, match=r"adapter on 'model.layers.0.self_attn.o_proj.base_layer' .* 'bias'"):
            strategy.export_hf(tmp_path / "hf")
        assert not (tmp_path / "hf").exists()
    finally:
        shutdown()


@pytest.mark.slow
def test_two_ranks_merge_the_sharded_experts_adapters(tmp_path):
    """2 ranks, each holding half of every fused experts tensor and of its adapters (Mixtral, all-linear): the
    export and full_weights give the model the ranks trained. With wrap_policy.moe_experts naming the fused class,
    the experts are sharded with peft's wrapper around them (which reads their weights outside their forward: sharded
    alone, its forward mixed shards with whole tensors) and train as in the decoder layers' groups; both as one process
    taking their micro-batches in turn (losses, gradient norms, weights)."""
    from conftest import launch_two_ranks
    from moe_families_worker import micro_batches
    from moe_families_worker import train as train_in_process
    from test_moe_families import saved_folder

    run = {
        "folder": str(saved_folder(tmp_path / "mixtral", "mixtral")),
        "out": str(tmp_path / "two.pt"),
        "experts": None,
        "per_expert": False,
        "accumulation": 1,
        "ulysses": 1,
        "steps": STEPS,
        "export": True,
        "lora": {"rank": 4, "alpha": 8},
    }
    own_group = {**run, "out": str(tmp_path / "two_experts_apart.pt"), "experts": "MixtralExperts"}
    (tmp_path / "runs.json").write_text(json.dumps([run, own_group]))
    launch_two_ranks("moe_families_worker.py", tmp_path / "runs.json")
    probe = micro_batches(-1, 1)[0]
    real = probe["attention_mask"][:, 1:].bool()
    for case in (run, own_group):
        result, exported = torch.load(case["out"]), stored(Path(case["out"] + ".hf"))
        assert sorted(result["weights"]) == sorted(exported)
        assert all(torch.equal(result["weights"][key], exported[key]) for key in exported)
        ours = transformers_log_probs(Path(case["out"] + ".hf"), probe)[real]
        torch.testing.assert_close(ours, result["log_probs"][real], atol=TOLERANCE, rtol=0)
        assert (transformers_log_probs(Path(case["folder"]), probe)[real] - ours).abs().max() > 1e-2
    # Both equal one process taking the two ranks' micro-batches in turn: losses, gradient norms and weights.
    alone = {**run, "out": str(tmp_path / "one.pt"), "accumulation": 2, "export": False}
    try:
        train_in_process(alone)
    finally:
        shutdown()
    reference = torch.load(alone["out"])
    for case in (run, own_group):
        result = torch.load(case["out"])
        assert result["losses"] == pytest.approx(reference["losses"], abs=1e-5), case["out"]
        assert result["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), case["out"]
        assert sorted(result["weights"]) == sorted(reference["weights"])
        for key, weight in reference["weights"].items():
            torch.testing.assert_close(result["weights"][key], weight, atol=TOLERANCE, rtol=0, msg=key)
