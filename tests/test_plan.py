"""SPEC §4.2: every `strategy_config` key changes what `fully_shard` does, read back from the live modules.

Plans are built inside this process, as `fsdp2kit check` builds them: with a real one-rank gloo world where
forward and backward must run, and with torch's fake process group (collectives do nothing) to build plans for
larger worlds on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from conftest import REPO, process_group, sharded_model, token_batch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from fsdp2kit.check import describe
from fsdp2kit.config.schema import JobConfig, ModelConfig, StrategyConfig, TrainingConfig
from fsdp2kit.distributed import Runtime
from fsdp2kit.parallel.fsdp import apply_fsdp
from fsdp2kit.parallel.plan import build_plan
from fsdp2kit.train.grads import LossScaler, NonFiniteGuard
from fsdp2kit.train.optim import build_optimizer, build_scheduler
from fsdp2kit.train.step import token_loss_sum, train_step

LAYERS = ["model.layers.0", "model.layers.1"]


def job(strategy: dict | None = None, layers: int = 2, **model) -> JobConfig:
    model = {"name_or_path": "builtin:tiny-llama", "config": {"num_hidden_layers": layers}} | model
    return JobConfig.model_validate({"model": model, "strategy_args": {"strategy_config": strategy or {}}})


def plan_of(runtime: Runtime, strategy: dict | None = None, **model) -> dict:
    """What `fsdp2kit check --json` prints."""
    return describe(job(strategy, **model), runtime)


def check(strategy: dict | None = None, world_size: int = 1, **model) -> dict:
    """`plan_of` in a world of its own, of `world_size` ranks."""
    with process_group(world_size) as runtime:
        return plan_of(runtime, strategy, **model)


@pytest.fixture
def gloo():
    with process_group(1) as runtime:
        yield runtime


def sharded(runtime: Runtime, strategy: dict | None = None, **model) -> nn.Module:
    """The model of `fsdp2kit train`: sharded, with its (single-rank) weights materialised."""
    return sharded_model(job(strategy, **model), runtime, training=True).model


def train_steps(model: nn.Module, steps: int = 2) -> torch.optim.Optimizer:
    """A few training steps (`train_step`: clipping, AdamW, the schedule) on random tokens; every one applied."""
    cfg = TrainingConfig(learning_rate=1e-2)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_scheduler(optimizer, cfg, steps)
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, LossScaler(False, cfg.fp16_initial_scale))
    batch = token_batch()
    for _ in range(steps):
        assert train_step(model, [batch], optimizer, scheduler, guard, cfg.max_grad_norm).applied
    return optimizer


def full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def group_of(plan: dict, module: str) -> dict:
    return next(group for group in plan["groups"] if module in group["modules"])


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "plan.yaml"
    path.write_text("model:\n  name_or_path: builtin:tiny-llama\n  config: {num_hidden_layers: 2}\n")
    return path


# Mesh: fsdp_size / sharding_size.


@pytest.mark.parametrize(
    "strategy, shape, names, placements",
    [
        ({}, (4,), ("fsdp",), (Shard(0),)),
        ({"fsdp_size": 4}, (4,), ("fsdp",), (Shard(0),)),
        ({"fsdp_size": 1}, (4,), ("fsdp",), (Shard(0),)),
        ({"fsdp_size": 2}, (2, 2), ("ddp", "fsdp"), (Replicate(), Shard(0))),
        ({"sharding_size": 2}, (2, 2), ("ddp", "fsdp"), (Replicate(), Shard(0))),
    ],
    ids=["auto", "world", "one", "fsdp_size", "sharding_size"],
)
def test_fsdp_size_shapes_the_mesh(strategy, shape, names, placements):
    with process_group(4) as runtime:
        cfg = job(strategy)
        model = sharded_model(cfg, runtime, training=True, materialize=False).model
        weight = model.model.layers[0].mlp.up_proj.weight
        mesh = weight.device_mesh
        assert (mesh.shape, mesh.mesh_dim_names, weight.placements) == (shape, names, placements)
        assert describe(cfg, runtime)["mesh"] == {"shape": list(shape), "dim_names": list(names)}


def test_fsdp_size_must_divide_the_world(run_main, config_file):
    code, _, err = run_main("check", config_file, "--nproc", 3, "--set", "strategy_args.strategy_config.fsdp_size=2")
    assert code == 2
    assert err == (
        "error: strategy_config.fsdp_size = 2 does not divide the world size 3; valid: 'auto' or one of [1, 3]\n"
    )


# Mixed precision.


def policies(plan: dict) -> list[tuple]:
    return [(g["param_dtype"], g["reduce_dtype"], g["output_dtype"], g["cast_forward_inputs"]) for g in plan["groups"]]


def test_mixed_precision_policy_of_every_group():
    plan = check({"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "fp32", "cast_forward_inputs": False})
    # Only the root casts its outputs: the model's outputs.
    assert policies(plan) == [("bfloat16", "float32", "float32", False)] + [("bfloat16", "float32", None, False)] * 2
    assert policies(check()) == [("float32", "float32", None, True)] * 3


@pytest.mark.parametrize(
    "strategy, compute, logits",
    [
        ({}, torch.float32, torch.float32),
        ({"param_dtype": "bf16"}, torch.bfloat16, torch.bfloat16),
        ({"param_dtype": "bf16", "output_dtype": "fp32"}, torch.bfloat16, torch.float32),
    ],
)
def test_param_and_output_dtype_in_the_forward(gloo, strategy, compute, logits):
    model = sharded(gloo, strategy)
    seen = []
    model.model.layers[0].mlp.register_forward_hook(lambda module, args, out: seen.append(module.up_proj.weight.dtype))
    output = model(input_ids=token_batch()["input_ids"], use_cache=False)
    assert seen == [compute]
    assert output.logits.dtype == logits
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # the sharded master weights


class Probe(nn.Module):
    """A module with a weight that records the dtype of the input it is given."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4))
        self.seen: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return x.float() * self.weight.float()


class ToyVisionLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = Probe()
        self.layers = nn.ModuleList([Probe()])

    def forward(self, pixel_values: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values) + self.layers[0](text)


@pytest.mark.parametrize("cast, text_dtype", [(True, torch.bfloat16), (False, torch.float32)])
def test_cast_forward_inputs_except_into_a_vision_encoder(gloo, cast, text_dtype):
    """Floating inputs are cast to param_dtype, but a vision encoder sees its pixel values in full precision:
    neither its own group nor the root casts them."""
    model = ToyVisionLanguageModel()
    strategy = StrategyConfig(
        sub_modules_to_wrap=["visual", "layers.{*}"], param_dtype="bf16", cast_forward_inputs=cast
    )
    plan = build_plan(model, strategy, ModelConfig())
    assert plan.no_cast_modules == ["visual"]
    apply_fsdp(model, init_device_mesh("cpu", (1,)), plan)
    model(torch.ones(2, 4), torch.ones(2, 4))
    assert (model.visual.seen, model.layers[0].seen) == (torch.float32, text_dtype)


# Reshard after forward, and the FSDP1 / Accelerate strategy names.


SCATTER, REPLICAS = "reduce-scatter over 4 ranks", "all-reduce across the replicas, overlapped with backward"
HYBRID = "reduce-scatter over 2 ranks, then all-reduce over 2 replicas"


@pytest.mark.parametrize(
    "strategy, mesh, reshard, reduce",
    [
        ({"reshard_after_forward": True}, [4], True, SCATTER),
        ({"reshard_after_forward": False}, [4], False, SCATTER),
        ({"reshard_after_forward": 2}, [4], 2, SCATTER),
        ({"sharding_strategy": "FULL_SHARD"}, [4], True, SCATTER),
        ({"sharding_strategy": "SHARD_GRAD_OP"}, [4], False, SCATTER),
        ({"sharding_strategy": "NO_SHARD"}, [4, 1], False, REPLICAS),
        ({"sharding_strategy": "HYBRID_SHARD"}, [2, 2], True, HYBRID),
        ({"sharding_strategy": "_HYBRID_SHARD_ZERO2"}, [2, 2], False, HYBRID),
    ],
    ids=lambda value: json.dumps(value) if isinstance(value, dict) else None,
)
def test_reshard_and_sharding_strategy(monkeypatch, strategy, mesh, reshard, reduce):
    """4 ranks on 2 nodes of 2: HYBRID_SHARD shards within a node. The root is never resharded after forward. On the
    CPU, NO_SHARD's replicas all-reduce without waiting (as DDP does); the others reduce as FSDP2 does."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    plan = check(strategy, world_size=4)
    assert plan["mesh"]["shape"] == mesh
    assert [g["reshard_after_forward"] for g in plan["groups"]] == [False, reshard, reshard]
    assert [g["gradient_reduce"] for g in plan["groups"]] == [reduce] * 3


@pytest.mark.parametrize("reshard", [True, False])
def test_reshard_after_forward_frees_the_gathered_weights(gloo, reshard):
    model = sharded(gloo, {"reshard_after_forward": reshard})
    model(input_ids=token_batch()["input_ids"], use_cache=False)
    layer_weight = model.model.layers[0].mlp.up_proj.weight
    assert isinstance(layer_weight, DTensor) == reshard  # resharded: back to this rank's shard
    assert not isinstance(model.model.embed_tokens.weight, DTensor)  # the root stays gathered for backward


@pytest.mark.parametrize("reshard", [True, False])
def test_gathered_groups_are_released_after_the_last_micro_batch_only(gloo, reshard):
    """reshard_after_forward false (ZeRO-2, NO_SHARD): the next micro-batch's forward would gather every group again
    and hold it, so the groups stay gathered until the step's last backward (one gather per step, not one per
    micro-batch). Groups resharded after forward are released after every backward."""
    model = sharded(gloo, {"reshard_after_forward": reshard})
    cfg = TrainingConfig(learning_rate=1e-2)
    guard = NonFiniteGuard(cfg.max_nonfinite_steps, LossScaler(False, cfg.fp16_initial_scale))
    weight = model.model.layers[0].mlp.up_proj
    released: list[bool] = []
    done = lambda: released.append(isinstance(weight.weight, DTensor))  # noqa: E731
    result = train_step(
        model, [token_batch()] * 3, build_optimizer(model, cfg), None, guard, 1.0, on_micro_batch_done=done
    )
    assert result.applied
    assert released == ([True] * 3 if reshard else [False, False, True])


# Which modules get their own fully_shard.


@pytest.mark.parametrize(
    "patterns, expected",
    [
        (["model.layers.{*}"], ["model.layers.0", "model.layers.1", "model.layers.2", "model.layers.3"]),
        (["model.layers.{1-2}"], ["model.layers.1", "model.layers.2"]),
        (["model.layers.{0,3}"], ["model.layers.0", "model.layers.3"]),
        (
            ["model.layers.{0-1}.mlp", "model.layers.{*}"],
            [
                "model.layers.0",
                "model.layers.0.mlp",
                "model.layers.1",
                "model.layers.1.mlp",
                "model.layers.2",
                "model.layers.3",
            ],
        ),
    ],
    ids=["all", "range", "list", "nested"],
)
def test_sub_modules_to_wrap(patterns, expected):
    assert check({"sub_modules_to_wrap": patterns}, layers=4)["sharded_modules"] == ["", *expected]


@pytest.mark.parametrize(
    "strategy, expected",
    [
        ({}, LAYERS),  # the model's own _no_split_modules: LlamaDecoderLayer
        (
            {"wrap_policy": {"transformer_layer_cls_to_wrap": ["LlamaMLP"]}},
            ["model.layers.0.mlp", "model.layers.1.mlp"],
        ),
        # Size-based: a module is wrapped once its not-yet-wrapped parameters reach the limit. An MLP holds 528k,
        # a layer's attention and norms 197k, the embeddings and the head 1M each.
        (
            {"wrap_policy": {"min_num_params": 500_000}},
            ["model.embed_tokens", "model.layers.0.mlp", "model.layers.1.mlp", "lm_head"],
        ),
        ({"wrap_policy": {"wrap_embeddings": True}}, ["model.embed_tokens", *LAYERS]),
        ({"wrap_policy": {"wrap_lm_output": True}}, [*LAYERS, "lm_head"]),
    ],
    ids=["default", "class", "size", "embeddings", "lm_output"],
)
def test_wrap_policy(strategy, expected):
    assert check(strategy)["sharded_modules"] == ["", *expected]


def test_tied_embeddings_and_head_share_one_group_and_stay_tied(gloo):
    strategy = {"wrap_policy": {"wrap_embeddings": True, "wrap_lm_output": True}}
    plan = plan_of(gloo, strategy, name_or_path="builtin:tiny-qwen3")
    assert group_of(plan, "lm_head")["modules"] == ["model.embed_tokens", "lm_head"]
    model = sharded(gloo, strategy, name_or_path="builtin:tiny-qwen3")
    before = full(model.lm_head.weight)
    train_steps(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(full(model.lm_head.weight), before)


def test_ignored_modules_stay_plain_replicated_tensors(gloo):
    """Their gradients are averaged over the ranks by the training loop: tests/test_numerics.py shows the
    2-rank losses with ignored embeddings match a single process."""
    assert plan_of(gloo, {"ignored_modules": ["model.embed_tokens"]})["ignored_modules"] == ["model.embed_tokens"]
    model = sharded(gloo, {"ignored_modules": ["model.embed_tokens"]})
    assert not isinstance(model.model.embed_tokens.weight, DTensor)
    others = [p for name, p in model.named_parameters() if not name.startswith("model.embed_tokens")]
    assert all(isinstance(p, DTensor) for p in others)
    before = {name: full(p) for name, p in model.named_parameters()}
    train_steps(model)  # plain and sharded parameters train side by side (gradient clipping and AdamW included)
    changed = {name for name, p in model.named_parameters() if not torch.equal(full(p), before[name])}
    assert changed == set(before)
    assert not isinstance(model.model.embed_tokens.weight, DTensor)


def test_frozen_parameters_do_not_change_and_are_not_optimised(gloo):
    plan = plan_of(gloo, freeze_module_prefix=["model.layers.0"])
    model = sharded(gloo, freeze_module_prefix=["model.layers.0"])
    parameters = dict(model.named_parameters())
    frozen = [name for name in parameters if name.startswith("model.layers.0.")]
    assert plan["frozen_parameters"] == sum(parameters[name].numel() for name in frozen) > 0
    before = {name: full(p) for name, p in parameters.items()}
    optimizer = train_steps(model)
    optimised = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for name, param in parameters.items():
        assert (id(param) in optimised) == (name not in frozen), name
        assert torch.equal(full(param), before[name]) == (name in frozen), name


# Recompute.


def autograd_node_names(tensor: torch.Tensor) -> set[str]:
    names, stack, seen = set(), [tensor.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            names.add(type(node).__name__)
            stack.extend(next_node for next_node, _ in node.next_functions)
    return names


def gradients_and_mlp_calls(model: nn.Module) -> tuple[dict[str, torch.Tensor], int, set[str]]:
    """Gradients of one backward, how often layer 0's MLP ran, and the autograd node types of the loss."""
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    loss = token_loss_sum(model, token_batch())
    nodes = autograd_node_names(loss)
    loss.backward()
    return {name: full(p.grad) for name, p in model.named_parameters()}, len(calls), nodes


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_runs_the_forward_again_in_backward(gloo, reentrant):
    strategy = {"recompute_modules": ["model.layers.{*}"], "use_reentrant": reentrant}
    assert plan_of(gloo, strategy)["recompute_modules"] == LAYERS
    plain_grads, plain_calls, _ = gradients_and_mlp_calls(sharded(gloo))
    grads, calls, nodes = gradients_and_mlp_calls(sharded(gloo, strategy))
    assert (plain_calls, calls) == (1, 2)
    assert ("CheckpointFunctionBackward" in nodes) == reentrant  # the reentrant implementation is an autograd.Function
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_gradient_checkpointing_recomputes_every_layer():
    assert check(gradient_checkpointing=True)["recompute_modules"] == LAYERS


def test_compile_wraps_each_layers_recomputed_forward_and_keeps_names(gloo):
    """training.compile: each decoder layer's forward (already wrapped by recompute) goes through torch.compile;
    parameter names are unchanged, so checkpoints are the same with and without it."""
    cfg = job(gradient_checkpointing=True)
    plain = sharded_model(cfg, gloo, training=True, materialize=False)
    cfg.training.compile = True
    assert describe(cfg, gloo)["compiled_modules"] == LAYERS
    compiled = sharded_model(cfg, gloo, training=True, materialize=False)
    for name in LAYERS:
        forward = compiled.model.get_submodule(name).forward
        assert type(forward).__name__ != "method"  # torch.compile's wrapper, not the bound method
        assert forward.__wrapped__.__code__.co_name == "recomputed"  # compile wraps recompute, not the reverse
    assert [n for n, _ in compiled.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]


# Prefetch.


@pytest.mark.parametrize(
    "forward, backward, expected_forward, expected_backward",
    [
        (0, 1, [[], [], [], []], [[], [], [], []]),  # FSDP's own implicit prefetch of the previous group in backward
        (
            2,
            2,
            [["model.layers.1", "model.layers.2"], ["model.layers.2", "model.layers.3"], ["model.layers.3"], []],
            [[], ["model.layers.0"], ["model.layers.1", "model.layers.0"], ["model.layers.2", "model.layers.1"]],
        ),
    ],
)
def test_explicit_prefetch(forward, backward, expected_forward, expected_backward):
    plan = check({"num_to_forward_prefetch": forward, "num_to_backward_prefetch": backward}, layers=4)
    layers = plan["groups"][1:]
    assert [g["modules"][0] for g in layers] == [f"model.layers.{i}" for i in range(4)]
    assert [g["forward_prefetch"] for g in layers] == expected_forward
    assert [g["backward_prefetch"] for g in layers] == expected_backward


def test_no_backward_prefetch_is_not_possible_and_says_so():
    assert check({"num_to_backward_prefetch": 0})["notes"] == [
        "num_to_backward_prefetch 0 acts as 1: FSDP2 always prefetches the previous group in backward"
    ]


# A model's own plan (model.model_class with `_fully_shard`).


def test_a_models_own_plan_chooses_the_groups(run_main, monkeypatch):
    monkeypatch.chdir(REPO)
    code, out, err = run_main(
        "check", "examples/custom_plan/train.yaml", "--json", "--set", "model.config.num_hidden_layers=2"
    )
    assert code == 0, err
    plan = json.loads(out)
    assert (plan["model"]["class"], plan["custom_plan"]) == ("PlannedLlamaForCausalLM", True)
    assert plan["sharded_modules"] == [
        "",
        "model.embed_tokens",
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.layers.1.self_attn",
        "model.layers.1.mlp",
        "lm_head",
    ]
    # The base keys still apply to the groups the model chose.
    assert group_of(plan, "model.layers.0.self_attn")["forward_prefetch"] == ["model.layers.0.mlp"]


# Mistakes: exit code 2 and one sentence naming the key.

CUSTOM_PLAN = ["--set", "model.model_class=examples/custom_plan/planned_llama.py:PlannedLlamaForCausalLM"]


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--set", 'strategy_args.strategy_config.sub_modules_to_wrap=["model.layer.{*}"]'],
            "strategy_config.sub_modules_to_wrap: pattern 'model.layer.{*}' matches no module of the model "
            "(module paths look like 'model.layers.0')",
        ),
        (
            ["--set", "strategy_args.strategy_config.wrap_policy.transformer_layer_cls_to_wrap=[LlamaBlock]"],
            "strategy_config.wrap_policy.transformer_layer_cls_to_wrap: class 'LlamaBlock' matches no module of the "
            "model; its classes are ['Embedding', 'Linear', 'LlamaAttention', 'LlamaDecoderLayer', 'LlamaForCausalLM', "
            "'LlamaMLP', 'LlamaModel', 'LlamaRMSNorm', 'LlamaRotaryEmbedding', 'ModuleList', 'SiLUActivation']",
        ),
        (
            ["--set", "strategy_args.strategy_config.offload_to_cpu=true"],
            "strategy_config.offload_policy: CPU offload needs an accelerator (CUDA) and this machine has none; "
            "set offload_policy: false",
        ),
        (
            ["--set", "strategy_args.strategy_config.pin_memory=true"],
            "strategy_config.pin_memory: true only applies with offload_policy: true",
        ),
        (
            ["--set", "strategy_args.strategy_config.reshard_after_forward=2"],
            "strategy_config.reshard_after_forward = 2: an integer must divide the shard group size 1; "
            "valid: true, false or one of [1]",
        ),
        (
            [
                "--set",
                "strategy_args.strategy_config.sharding_strategy=SHARD_GRAD_OP",
                "--set",
                "strategy_args.strategy_config.reshard_after_forward=true",
            ],
            "strategy_config.reshard_after_forward = True contradicts sharding_strategy SHARD_GRAD_OP (which means "
            "False); give one of them",
        ),
        (
            ["--set", "strategy_args.strategy_config.ignored_modules=[model.layers.0.mlp]"],
            "strategy_config.ignored_modules: 'model.layers.0' is both ignored and sharded "
            "(or contains an ignored module)",
        ),
        (
            [*CUSTOM_PLAN, "--set", 'strategy_args.strategy_config.sub_modules_to_wrap=["model.layers.{*}"]'],
            "strategy_config.sub_modules_to_wrap: PlannedLlamaForCausalLM defines its own sharding plan "
            "(_fully_shard), which chooses the shard groups; drop this key",
        ),
        (
            ["--set", "model.model_class=transformers:Qwen3ForCausalLM"],
            "model.model_class: Qwen3ForCausalLM takes a Qwen3Config, but the model's config is a LlamaConfig",
        ),
        (
            ["--set", "model.model_class=examples/custom_plan/missing.py:Model"],
            "model.model_class: no such file 'examples/custom_plan/missing.py'",
        ),
    ],
    ids=[
        "pattern",
        "class",
        "offload",
        "pin_memory",
        "reshard_int",
        "strategy_contradiction",
        "ignored_and_sharded",
        "custom_plan_and_selection",
        "model_class_config",
        "model_class_file",
    ],
)
def test_plan_mistakes_exit_2_with_one_message(run_main, monkeypatch, config_file, args, message):
    monkeypatch.chdir(REPO)
    code, _, err = run_main("check", config_file, *args)
    assert code == 2
    assert err == f"error: {message}\n"
