"""`fsdp2kit.integrations.verl.VerlEngine` driven as verl 0.9's TrainingWorker drives its FSDP engine, on verl's own
batch layout (a TensorDict of jagged nested tensors, settings as non-tensor entries), equals plain PyTorch.

verl itself is not installed here: verl 0.9.1 (PyPI, the package registry) installs beside torch 2.13 without another
torch but pins transformers<5.11 (this project runs 5.24), so the engine's names and signatures are checked against
verl's interface as read from its source: verl-0.9.1-py3-none-any.whl from PyPI, `verl/workers/engine/base.py`
(BaseEngine, EngineRegistry), `verl/workers/engine/fsdp/transformer_impl.py` (FSDPEngine: its __init__ and
forward_step's `loss_function(model_output=, data=, dp_group=)`), `verl/workers/engine_workers.py` (TrainingWorker:
train_mode -> train_batch per mini-batch -> lr_scheduler_step on the last; infer_batch under eval_mode); the same
files at github.com/volcengine/verl commit b178a3cd56f58b2d502255daba591e92833930a7 (0.8.0.dev) have the same
signatures for these methods."""

from __future__ import annotations

import inspect
import math
import sys
import types
from types import SimpleNamespace

import pytest
import torch
from tensordict import TensorDict
from test_strategy import tiny_llama

from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.integrations.verl import VerlEngine, balanced_ranges, register, token_budget_ranges

LEARNING_RATE, CLIP, ENTROPY_COEF = 1e-3, 1.0, 0.01
ROWS, MINI_BATCH_ROWS, RL_STEPS = 4, 2, 2

# verl 0.9.1's BaseEngine / FSDPEngine methods: (parameter names after self, their defaults), from the source above.
VERL_INTERFACE = {
    "__init__": (["model_config", "engine_config", "optimizer_config", "checkpoint_config"], []),
    "initialize": ([], []),
    "train_mode": (["kwargs"], []),
    "eval_mode": (["kwargs"], []),
    "optimizer_zero_grad": ([], []),
    "optimizer_step": ([], []),
    "lr_scheduler_step": ([], []),
    "forward_backward_batch": (["data", "loss_function", "forward_only"], [False]),
    "train_batch": (["data", "loss_function"], []),
    "infer_batch": (["data", "loss_function"], [None]),
    "get_per_tensor_param": (["layered_summon", "base_sync_done", "kwargs"], [False, False]),
    "get_data_parallel_size": ([], []),
    "get_data_parallel_rank": ([], []),
    "get_data_parallel_group": ([], []),
    "to": (["device", "model", "optimizer", "grad"], [True, True, True]),
    "save_checkpoint": (["local_path", "hdfs_path", "global_step", "max_ckpt_to_keep", "kwargs"], [None, 0, None]),
    "load_checkpoint": (["local_path", "hdfs_path", "del_local_after_load", "kwargs"], [None, True]),
    "is_mp_src_rank_with_outputs": ([], []),
    "disable_adapter": ([], []),
}
VERL_PROPERTIES = ("is_param_offload_enabled", "is_optimizer_offload_enabled")


def verl_configs(model_dir, total_steps: int) -> dict:
    """verl's four engine configs with verl 0.9.1's field names (and its defaults where the test sets nothing)."""
    model = SimpleNamespace(path=str(model_dir), trust_remote_code=False, use_remove_padding=True)
    engine = SimpleNamespace(
        ulysses_sequence_parallel_size=1,
        forward_only=False,
        param_offload=False,
        optimizer_offload=False,
        mixed_precision={"param_dtype": "fp32"},
        seed=42,
    )
    optimizer = SimpleNamespace(
        optimizer="AdamW",
        lr=LEARNING_RATE,
        weight_decay=0.0,
        betas=(0.9, 0.999),
        clip_grad=CLIP,
        total_training_steps=total_steps,
        lr_warmup_steps=-1,
        lr_warmup_steps_ratio=0.0,
        lr_scheduler_type="cosine",
        warmup_style=None,
        min_lr_ratio=None,
        num_cycles=0.5,
    )
    return {"model_config": model, "engine_config": engine, "optimizer_config": optimizer, "checkpoint_config": None}


def verl_batch(step: int, **settings) -> TensorDict:
    """A rollout batch as verl's trainer hands it to the worker: ROWS sequences (prompt + response) of different
    lengths as jagged tensors; loss_mask[t] = 1 where token t+1 is a response token (verl's log-prob alignment)."""
    generator = torch.Generator().manual_seed(100 + step)
    ids, loss_masks, advantages = [], [], []
    for _ in range(ROWS):
        prompt, response = (int(n) for n in torch.randint(2, 6, (2,), generator=generator))
        ids.append(torch.randint(3, 512, (prompt + response,), generator=generator))
        loss_masks.append(torch.cat([torch.zeros(prompt - 1), torch.ones(response), torch.zeros(1)]))
        advantages.append(torch.randn(prompt + response, generator=generator))
    jagged = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict(
        {
            "input_ids": jagged(ids),
            "position_ids": jagged([torch.arange(len(row)) for row in ids]),
            "loss_mask": jagged(loss_masks),
            "advantages": jagged(advantages),
        },
        batch_size=[ROWS],
    )
    for key, value in {"temperature": 1.0, "global_batch_size": MINI_BATCH_ROWS, **settings}.items():
        data.set_non_tensor(key, value)
    return data


def verl_ppo_loss(model_output, data, dp_group=None):
    """A clipped-ratio loss with an entropy bonus in verl's form (verl/workers/utils/losses.py:ppo_loss with agg_loss
    'token-mean'): masked token sums over the global batch's loss tokens, x dp_size."""
    log_prob = model_output["log_probs"].values()
    old, advantages = data["old_log_probs"].values(), data["advantages"].values()
    mask = data["loss_mask"].values()
    ratio = torch.exp(log_prob - old)
    pg = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
    loss = (pg * mask).sum() / data["batch_num_tokens"] * data["dp_size"]
    metrics = {"actor/pg_loss": float(loss.detach()), "actor/ratio_max": float(ratio.max().detach())}
    entropy = (model_output["entropy"].values() * mask).sum() / data["batch_num_tokens"] * data["dp_size"]
    return loss - ENTROPY_COEF * entropy, metrics


def padded(data: TensorDict) -> dict[str, torch.Tensor]:
    """The batch right-padded, for the plain reference."""
    lengths = data["input_ids"].offsets().diff()
    width = int(lengths.max())
    pad = lambda key: data[key].to_padded_tensor(0, output_size=(len(lengths), width))  # noqa: E731
    return {
        "input_ids": pad("input_ids").long(),
        "attention_mask": (torch.arange(width)[None] < lengths[:, None]).long(),
        **{key: pad(key) for key in ("loss_mask", "advantages")},
    }


def plain_outputs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropies [B, T-1] from the whole logits, with autograd."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float()
    log_softmax = torch.log_softmax(logits, -1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1), entropy


def reference(model_dir) -> dict:
    """verl's update as plain PyTorch: per RL step, old log-probs, then one AdamW step (clipped) per mini-batch at
    the step's learning rate; the cosine schedule (fsdp2kit's formula, over RL_STEPS) advances once per RL step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    record: dict = {"old": [], "losses": [], "grad_norms": []}
    for step in range(RL_STEPS):
        for group in optimizer.param_groups:
            group["lr"] = LEARNING_RATE * 0.5 * (1 + math.cos(math.pi * step / RL_STEPS))
        batch = padded(verl_batch(step))
        with torch.no_grad():
            old = plain_outputs(model, batch)[0]
        record["old"].append(old)
        for start in range(0, ROWS, MINI_BATCH_ROWS):
            mini = {key: value[start : start + MINI_BATCH_ROWS] for key, value in batch.items()}
            log_probs, entropy = plain_outputs(model, mini)
            ratio = torch.exp(log_probs - old[start : start + MINI_BATCH_ROWS])
            adv, mask = mini["advantages"][:, :-1], mini["loss_mask"][:, :-1]
            pg = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
            loss = (pg * mask).sum() / mask.sum() - ENTROPY_COEF * (entropy * mask).sum() / mask.sum()
            loss.backward()
            record["grad_norms"].append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
            record["losses"].append(float(loss.detach()))
    record["weights"] = model.state_dict()
    return record


def train_as_verl_does(engine: VerlEngine, rank: int = 0, ranks: int = 1) -> dict:
    """engine_workers.py's calls per RL step on this rank's rows (every ranks-th; so each global mini-batch is the
    ranks' local mini-batches): infer_batch (old log-probs) in eval_mode; in train_mode, train_batch per mini-batch
    (one micro-batch per row, by token budget), lr_scheduler_step after the last. Losses: the global mini-batch's."""
    record: dict = {"old": [], "losses": [], "grad_norms": [], "metrics": []}
    local_rows = MINI_BATCH_ROWS // ranks
    for step in range(RL_STEPS):
        data = verl_batch(step, use_dynamic_bsz=False, micro_batch_size_per_gpu=2)[rank::ranks]
        with engine.eval_mode():
            old = engine.infer_batch(data)["model_output"]["log_probs"]
        record["old"].append(old)
        data["old_log_probs"] = old
        with engine.train_mode():
            for start in range(0, len(data), local_rows):
                mini = data[start : start + local_rows]
                tokens = int(mini["input_ids"].offsets()[-1])
                mini.set_non_tensor("use_dynamic_bsz", True)
                mini.set_non_tensor("max_token_len_per_gpu", tokens - 1)  # one row per micro-batch
                mini.set_non_tensor("calculate_entropy", True)  # the entropy bonus, with autograd
                output = engine.train_batch(mini, loss_function=verl_ppo_loss)
                loss = torch.tensor(sum(output["loss"]), dtype=torch.float64)
                torch.distributed.all_reduce(loss)  # verl's worker averages the ranks' summed losses
                record["losses"].append(float(loss) / ranks)
                record["grad_norms"].append(output["metrics"]["grad_norm"])
                record["metrics"].append(output["metrics"])
        record["lr"] = engine.lr_scheduler_step()
    record["weights"] = {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()[0]}
    return record


def assert_same_as_plain(got: dict, expected: dict) -> None:
    """Losses, gradient norms, the learning rate after the run and the final weights."""
    assert got["losses"] == pytest.approx(expected["losses"], abs=1e-5)
    assert got["grad_norms"] == pytest.approx(expected["grad_norms"], abs=1e-5)
    assert got["lr"] == pytest.approx(0.0)  # the cosine over 2 RL steps, stepped twice
    assert sorted(got["weights"]) == sorted(expected["weights"])
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("verl") / "model")


def test_verl_s_training_calls_equal_plain_pytorch(model_dir, tmp_path):
    expected = reference(model_dir)
    engine = VerlEngine(**verl_configs(model_dir, RL_STEPS), overrides=(f"training.output_dir={tmp_path}",))
    try:
        engine.initialize()
        got = train_as_verl_does(engine)
    finally:
        shutdown()
    for old, want in zip(got["old"], expected["old"], strict=True):
        lengths = old.offsets().diff()
        assert torch.all(old.to_padded_tensor(1.0)[torch.arange(ROWS), lengths - 1] == 0)  # last position: 0
        predicting = torch.arange(want.shape[1])[None] < lengths[:, None] - 1
        torch.testing.assert_close(old.to_padded_tensor(0.0)[:, :-1], want * predicting, atol=1e-5, rtol=0)
    assert_same_as_plain(got, expected)
    assert all(len(m["actor/pg_loss"]) == 2 for m in got["metrics"])  # one per micro-batch, from the real call


def test_engine_calls_beside_the_step(model_dir, tmp_path):
    """Data-parallel accessors, to(), verl's refusals, checkpoints named by step with max_ckpt_to_keep."""
    engine = VerlEngine(**verl_configs(model_dir, 4), overrides=(f"training.output_dir={tmp_path}",))
    try:
        engine.initialize()
        assert (engine.get_data_parallel_rank(), engine.get_data_parallel_size()) == (0, 1)
        assert engine.is_mp_src_rank_with_outputs()
        engine.to("cpu", model=True, optimizer=True, grad=True)
        engine.to("cuda", model=False, optimizer=True, grad=False)
        with pytest.raises(UserError, match=r"to\(grad=True\) needs model=True"):
            engine.to("cpu", model=False, grad=True)
        with pytest.raises(UserError, match="call train_batch"):
            engine.forward_backward_batch(verl_batch(0), verl_ppo_loss, forward_only=False)
        with pytest.raises(UserError, match="part of train_batch"):
            engine.optimizer_step()
        engine.optimizer_zero_grad()
        assert all(p.grad is None for p in engine.strategy.model.parameters())
        data = verl_batch(0, temperature=0.7, use_dynamic_bsz=False, micro_batch_size_per_gpu=4)
        cooled = engine.infer_batch(data)["model_output"]["log_probs"].to_padded_tensor(0.0)[:, :-1]
        plain = {key: value for key, value in padded(data).items() if key in ("input_ids", "attention_mask")}
        direct = engine.strategy.forward_step(plain, temperature=0.7)["log_probs"]
        lengths = data["input_ids"].offsets().diff()
        predicting = torch.arange(direct.shape[1])[None] < lengths[:, None] - 1
        torch.testing.assert_close(cooled, direct * predicting, rtol=0, atol=1e-6)
        assert not torch.allclose(cooled, engine.strategy.forward_step(plain)["log_probs"] * predicting)
        for step in (1, 2, 3):
            engine.save_checkpoint(str(tmp_path / f"global_step_{step}"), global_step=step, max_ckpt_to_keep=2)
        assert sorted(p.name for p in tmp_path.glob("global_step_*")) == ["global_step_2", "global_step_3"]
        engine.load_checkpoint(str(tmp_path / "global_step_2"))
    finally:
        shutdown()


def test_verl_settings_fsdp2kit_would_not_honour_are_refused(model_dir):
    configs = verl_configs(model_dir, 4)
    configs["optimizer_config"].min_lr_ratio = 0.1
    with pytest.raises(UserError, match="min_lr_ratio: 0.1"):
        VerlEngine(**configs).initialize()


def test_micro_batches_split_by_token_budget_in_as_many_parts_on_every_rank():
    assert token_budget_ranges([3, 4, 2, 6, 1], 7) == [range(0, 2), range(2, 3), range(3, 5)]
    assert token_budget_ranges([9, 1], 4) == [range(0, 1), range(1, 2)]
    # another rank needs 3: this one's 2 budget groups become 3 balanced runs
    assert balanced_ranges([3, 3, 3, 3], 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert balanced_ranges([1, 1, 10], 2) == [range(0, 2), range(2, 3)]
    with pytest.raises(UserError, match="needs 3 micro-batches, this rank has 2 rows"):
        balanced_ranges([1, 1], 3)


def test_the_engine_has_verl_s_interface():
    """Every BaseEngine method verl's workers call exists with verl's parameter names and defaults."""
    for name, (params, defaults) in VERL_INTERFACE.items():
        signature = inspect.signature(getattr(VerlEngine, name))
        names = [p for p in signature.parameters if p != "self"]
        assert names[: len(params)] == params, name
        assert all(signature.parameters[p].default is not inspect.Parameter.empty for p in names[len(params) :])
        given = [p.default for p in signature.parameters.values() if p.default is not inspect.Parameter.empty]
        assert given[: len(defaults)] == defaults, name
    for name in VERL_PROPERTIES:
        assert isinstance(inspect.getattr_static(VerlEngine, name), property), name


def test_register_puts_the_engine_in_verl_s_registry(monkeypatch, model_dir):
    """`register` makes a BaseEngine subclass and registers it with verl's decorator call; verl's
    EngineRegistry.new(model_type, backend, **configs) then builds it (verl's registry: a stand-in with verl's
    register/new signatures and its assertion that the class is a BaseEngine)."""

    class BaseEngine:
        pass

    class EngineRegistry:
        _engines: dict = {}

        @classmethod
        def register(cls, model_type, backend, device="cuda", vendor=None):
            def decorator(engine_class):
                assert issubclass(engine_class, BaseEngine)
                for current in device if isinstance(device, list) else [device]:
                    cls._engines.setdefault(model_type, {}).setdefault(backend, {})[current] = engine_class
                return engine_class

            return decorator

        @classmethod
        def new(cls, model_type, backend, *args, **kwargs):
            return cls._engines[model_type][backend]["cpu"](*args, **kwargs)

    module = types.ModuleType("verl.workers.engine.base")
    module.BaseEngine, module.EngineRegistry = BaseEngine, EngineRegistry
    for name in ("verl", "verl.workers", "verl.workers.engine"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.workers.engine.base", module)
    register()
    engine = EngineRegistry.new("language_model", "fsdp2kit", **verl_configs(model_dir, 1))
    assert isinstance(engine, VerlEngine) and isinstance(engine, BaseEngine)


def verl_value_loss(model_output, data, dp_group=None):
    """A clipped value loss in verl's form (a critic's values per token, token-mean over the global batch's loss
    tokens, x dp_size)."""
    values, old = model_output["values"].values(), data["old_values"].values()
    returns, mask = data["returns"].values(), data["loss_mask"].values()
    clipped = old + (values - old).clamp(-0.5, 0.5)
    losses = 0.5 * torch.maximum((values - returns) ** 2, (clipped - returns) ** 2)
    loss = (losses * mask).sum() / data["batch_num_tokens"] * data["dp_size"]
    return loss, {"critic/vf_loss": float(loss.detach())}


def critic_checkpoint(model_dir, folder):
    """A seeded LlamaForTokenClassification (one label, no classifier dropout) of model_dir's shape, saved with its
    tokenizer: a critic's checkpoint."""
    import shutil

    from transformers import AutoConfig, LlamaForTokenClassification

    torch.manual_seed(5)
    critic = AutoConfig.from_pretrained(model_dir, num_labels=1)
    critic.classifier_dropout = 0.0  # transformers' default is 0.1: training would not be deterministic
    LlamaForTokenClassification(critic).save_pretrained(folder)
    for file in model_dir.glob("tokenizer*"):
        shutil.copy(file, folder / file.name)
    return folder


def test_verl_s_critic_calls_equal_plain_pytorch(model_dir, tmp_path):
    """model_type value_model on a critic checkpoint: the family's ForTokenClassification with one label;
    infer_batch's values and two train_batch steps with a clipped value loss equal transformers'
    LlamaForTokenClassification with AdamW."""
    from transformers import AutoConfig, LlamaForTokenClassification

    critic_dir = critic_checkpoint(model_dir, tmp_path / "critic")
    configs = verl_configs(critic_dir, RL_STEPS)
    configs["model_config"].model_type = "value_model"
    engine = VerlEngine(**configs, overrides=(f"training.output_dir={tmp_path}",))
    data = verl_batch(0, use_dynamic_bsz=False, micro_batch_size_per_gpu=1)
    generator = torch.Generator().manual_seed(7)
    data["returns"] = torch.nested.as_nested_tensor(
        [torch.randn(len(row), generator=generator) for row in data["input_ids"].unbind()], layout=torch.jagged
    )
    try:
        engine.initialize()
        initial = {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()[0]}
        with engine.eval_mode():
            values = engine.infer_batch(data)["model_output"]["values"]
        data["old_values"] = values
        with engine.train_mode():
            norms = [engine.train_batch(data[i : i + 2], verl_value_loss)["metrics"]["grad_norm"] for i in (0, 2)]
        final = {name: tensor.clone() for name, tensor in engine.get_per_tensor_param()[0]}
    finally:
        shutdown()
    plain = LlamaForTokenClassification(AutoConfig.from_pretrained(critic_dir))
    plain.load_state_dict(initial, strict=True)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    batch = padded(data)
    pad = lambda key: data[key].to_padded_tensor(0.0, output_size=batch["input_ids"].shape)  # noqa: E731
    old, returns = pad("old_values"), pad("returns")
    with torch.no_grad():
        want = plain(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.squeeze(-1)
    torch.testing.assert_close(old, want * batch["attention_mask"], rtol=0, atol=1e-5)
    expected_norms = []
    for rows in (slice(0, 2), slice(2, 4)):
        out = plain(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]).logits[..., 0]
        clipped = old[rows] + (out - old[rows]).clamp(-0.5, 0.5)
        losses = 0.5 * torch.maximum((out - returns[rows]) ** 2, (clipped - returns[rows]) ** 2)
        mask = batch["loss_mask"][rows]
        ((losses * mask).sum() / mask.sum()).backward()
        expected_norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP)))
        optimizer.step()
        optimizer.zero_grad()
    assert norms == pytest.approx(expected_norms, abs=1e-5)
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(final[name], tensor, rtol=0, atol=1e-5, msg=name)
