"""`fsdp2kit.integrations.roll.RollStrategy` driven by the calls ROLL's actor worker makes, in its order, equals
plain PyTorch.

Read from github.com/alibaba/ROLL at commit 8eb27cc2dc34c4d1310b169d9b86d339004d811a:
`roll/pipeline/base_worker.py:ActorWorker` (initialize -> offload_states; compute_log_probs: load_states(include=
[model_params]), offload of the rest, meta_info['micro_batch_size'], forward_step(batch, forward_func_log_probs),
offload_states; train_step: load_states(include=[model_params, other_params]), offload of the rest, make_iterator
of per_device_train_batch_size x gradient_accumulation_steps rows, train_step(batch, loss_func) each,
scheduler.get_last_lr, offload_states; do_checkpoint: save_checkpoint(save_dir, global_step, ckpt_id,
is_last_step=)), its `forward_func_log_probs` and `loss_func` (clipped ratio + k3 KL, `agg_loss` token-mean over
meta_info['batch_num_tokens']), `roll/utils/context_managers.py:state_offload_manger` / `get_load_exclude_kwargs`,
`roll/distributed/strategy/fsdp2_strategy.py:FSDP2TrainStrategy.train_step` (loss x loss_scale / accumulation,
clip and step at each boundary) and `roll/distributed/scheduler/protocol.py:DataProto`. ROLL itself needs ray and is
not installed; `DataProto` below holds what its strategies use of it (a TensorDict batch, non_tensor_batch,
meta_info shared by the chunks, `chunk`, `make_iterator` in order)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import pytest
import torch
from strategy_case import clip_grad_norm_exact
from tensordict import TensorDict
from test_strategy import tiny_llama

from fsdp2kit.distributed import shutdown
from fsdp2kit.errors import UserError
from fsdp2kit.integrations.roll import RollStrategy

ROWS, PROMPT, RESPONSE = 4, 5, 6
MICRO, ACCUMULATION, INFER_MICRO = 1, 2, 2
LEARNING_RATE, CLIP, KL_COEF, ENTROPY_COEF, STEPS = 1e-3, 1.0, 0.1, 0.01, 2
BACKWARD_ROWS = MICRO * ACCUMULATION  # the rows of one optimizer step on one rank


class OffloadStateType(str, Enum):  # noqa: UP042 (roll/utils/offload_states.py, as ROLL writes it)
    model_params = "model_params"
    optimizer_states = "optimizer_states"
    other_params = "other_params"


ALL_STATES = {OffloadStateType.model_params, OffloadStateType.other_params, OffloadStateType.optimizer_states}


@dataclass
class DataProto:
    batch: TensorDict
    non_tensor_batch: dict = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def chunk(self, chunks: int) -> list[DataProto]:
        sizes = [len(part) for part in np.array_split(np.arange(len(self)), chunks)]
        starts = np.cumsum([0, *sizes])
        return [
            DataProto(self.batch[a:b].clone(), {}, self.meta_info) for a, b in zip(starts, starts[1:], strict=False)
        ]

    def make_iterator(self, mini_batch_size: int, epochs: int, **_):
        for _ in range(epochs):
            yield from self.chunk(len(self) // mini_batch_size)


def rollout(step: int) -> DataProto:
    """A batch as ROLL's pipeline gives the actor: left-padded prompts, right-padded responses, position_ids from the
    mask, response_mask, advantages (0 outside the response) and reference log-probs."""
    generator = torch.Generator().manual_seed(200 + step)
    width = PROMPT + RESPONSE
    prompt_lens = torch.randint(2, PROMPT + 1, (ROWS,), generator=generator)
    response_lens = torch.randint(2, RESPONSE + 1, (ROWS,), generator=generator)
    columns = torch.arange(width)[None]
    prompt = (columns >= PROMPT - prompt_lens[:, None]) & (columns < PROMPT)
    response = (columns >= PROMPT) & (columns < PROMPT + response_lens[:, None])
    mask = (prompt | response).long()
    ids = torch.randint(3, 512, (ROWS, width), generator=generator) * mask
    target = response[:, 1:].float()
    tensors = {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": response.long(),
        "advantages": torch.randn(ROWS, width - 1, generator=generator) * target,
        "ref_noise": torch.randn(ROWS, width - 1, generator=generator) * 0.05 * target,
    }
    return DataProto(TensorDict(tensors, batch_size=[ROWS]), meta_info={"loss_mask_keys": ["response_mask"]})


def k3(log_probs, ref_log_probs, mask):
    ratio = ref_log_probs - log_probs
    return (torch.exp(ratio) - ratio - 1) * mask


class ActorWorker:
    """The calls of ROLL's ActorWorker on its strategy, in its order (see the module docstring)."""

    def __init__(self, strategy: RollStrategy, output_dir):
        self.strategy, self.output_dir = strategy, output_dir
        self.strategy.offload_states()  # end of initialize

    def _offloaded_around(self, include, work):
        self.strategy.load_states(include=include)
        self.strategy.offload_states(include=list(ALL_STATES - set(include)))
        try:
            return work()
        finally:
            self.strategy.offload_states()

    def compute_log_probs(self, data: DataProto) -> torch.Tensor:
        def work():
            data.meta_info["micro_batch_size"] = INFER_MICRO
            with torch.no_grad():
                return self.strategy.forward_step(batch=data, forward_func=self.forward_func_log_probs)

        return self._offloaded_around([OffloadStateType.model_params], work)["log_probs"]

    def forward_func_log_probs(self, data, output_tensor):
        log_probs = self.strategy.op_compute_log_probs(
            logits=output_tensor, input_ids=data.batch["input_ids"], attention_mask=data.batch["response_mask"]
        )
        entropy = self.strategy.op_compute_entropy(logits=output_tensor, attention_mask=data.batch["response_mask"])
        return torch.tensor(0.0, device=output_tensor.device), {"log_probs": log_probs.detach(), "entropy": entropy}

    def train_step(self, data: DataProto) -> dict:
        def work():
            metrics: dict = {}
            for backward_batch in data.make_iterator(mini_batch_size=MICRO * ACCUMULATION, epochs=1):
                for key, value in self.strategy.train_step(batch=backward_batch, loss_func=self.loss_func).items():
                    metrics.setdefault(key, []).append(value)
            metrics["actor/lr"] = self.strategy.scheduler.get_last_lr()[0]
            return metrics

        return self._offloaded_around([OffloadStateType.model_params, OffloadStateType.other_params], work)

    def loss_func(self, data, output_tensor):
        response_mask = data.batch["response_mask"][:, 1:].long()
        batch_num_tokens = data.meta_info["batch_num_tokens"]["response_mask"]
        log_probs = self.strategy.op_compute_log_probs(
            logits=output_tensor, input_ids=data.batch["input_ids"], attention_mask=data.batch["response_mask"]
        )
        ratio = (log_probs - data.batch["old_log_probs"]).exp()
        advantages = data.batch["advantages"]
        pg_loss = -torch.min(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages)
        pg_loss = pg_loss.sum() / batch_num_tokens  # agg_loss token-mean
        kl_loss = k3(log_probs, data.batch["ref_log_probs"], response_mask).sum() / batch_num_tokens
        total_loss = pg_loss + kl_loss * KL_COEF
        if ENTROPY_COEF > 0:  # ROLL's entropy_loss_coef branch
            entropy = self.strategy.op_compute_entropy(logits=output_tensor, attention_mask=data.batch["response_mask"])
            total_loss = total_loss - entropy.sum() / batch_num_tokens * ENTROPY_COEF
        return total_loss, {"actor/pg_loss": pg_loss.detach().item(), "actor/kl_loss": kl_loss.detach().item()}

    def do_checkpoint(self, global_step: int) -> dict:
        ckpt_id = f"checkpoint-{global_step}"
        return self.strategy.save_checkpoint(
            str(self.output_dir / "actor_train" / ckpt_id), global_step, ckpt_id, is_last_step=global_step == STEPS
        )


class Rollout:
    """A plain transformers rollout model fed by model_update's buckets."""

    def __init__(self, model):
        self.model, self.received, self.buckets = model, set(), 0

    def update_parameter_in_bucket(self, named_weights, is_lora=False):
        self.model.load_state_dict(dict(named_weights), strict=False)
        self.received |= {name for name, _ in named_weights}
        self.buckets += 1


def plain_outputs(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token log-probs and entropies [B, T-1] from the whole logits, with autograd."""
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, :-1]
    log_softmax = torch.log_softmax(logits.float(), -1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_softmax.gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1), entropy


def optimizer_steps(ranks: int) -> int:
    return STEPS * ROWS // (BACKWARD_ROWS * ranks)


def reference(model_dir, ranks: int = 1) -> dict:
    """ROLL's update in plain PyTorch: each global backward batch's (BACKWARD_ROWS x ranks rows) token-mean loss, one
    clipped AdamW step, the cosine schedule (fsdp2kit's formula over the run's optimizer steps) stepped after each."""
    from transformers import AutoModelForCausalLM

    from fsdp2kit.train.optim import lr_factor

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    record: dict = {"old": [], "pg": [], "grad_norm": [], "lr": []}
    for step in range(STEPS):
        data = rollout(step).batch
        mask = data["response_mask"][:, 1:]
        with torch.no_grad():
            old = plain_outputs(model, data)[0] * mask
        record["old"].append(old)
        for start in range(0, ROWS, BACKWARD_ROWS * ranks):
            rows = slice(start, start + BACKWARD_ROWS * ranks)
            batch = {key: value[rows] for key, value in data.items()}
            log_probs, entropy = plain_outputs(model, batch)
            log_probs = log_probs * mask[rows]
            ratio = (log_probs - old[rows]).exp()
            adv = batch["advantages"]
            tokens = mask[rows].sum()
            pg = (-torch.min(ratio * adv, ratio.clamp(0.8, 1.2) * adv)).sum() / tokens
            kl = k3(log_probs, old[rows] + batch["ref_noise"], mask[rows]).sum() / tokens
            (pg + KL_COEF * kl - ENTROPY_COEF * (entropy * mask[rows]).sum() / tokens).backward()
            record["grad_norm"].append(float(clip_grad_norm_exact(model.parameters(), CLIP)))
            optimizer.step()
            optimizer.zero_grad()
            record["pg"].append(float(pg.detach()))
            done = len(record["grad_norm"])
            for group in optimizer.param_groups:
                group["lr"] = LEARNING_RATE * lr_factor(done, optimizer_steps(ranks), 0, "cosine")
        record["lr"].append(optimizer.param_groups[0]["lr"])
    record["weights"] = model.state_dict()
    return record


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return tiny_llama(tmp_path_factory.mktemp("roll") / "model")


def config(model_dir, output_dir, ranks: int = 1, ulysses: int = 1) -> dict:
    return {
        "model": {"name_or_path": str(model_dir), "ulysses_size": ulysses},
        "training": {
            "learning_rate": LEARNING_RATE,
            "lr_scheduler_type": "cosine",
            "max_steps": optimizer_steps(ranks),
            "max_grad_norm": CLIP,
            "per_device_train_batch_size": MICRO,
            "gradient_accumulation_steps": ACCUMULATION,
            "output_dir": str(output_dir),
        },
    }


def replay(model_dir, output_dir, rank: int = 0, ranks: int = 1, checkpoints: bool = True, ulysses: int = 1) -> dict:
    """The ActorWorker's calls for STEPS RL steps on this rank's contiguous share of each rollout (`ranks`
    data-parallel ranks; the `ulysses` ranks of a sequence-parallel group share theirs), with do_checkpoint after
    each where `checkpoints`: what it saw, and the rollout model that model_update fed."""
    from transformers import AutoModelForCausalLM

    rollout_model = Rollout(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    got: dict = {"old": [], "pg": [], "grad_norm": [], "lr": []}
    strategy = RollStrategy.from_config(config(model_dir, output_dir, ranks, ulysses), entropy_loss=True)
    worker = ActorWorker(strategy, output_dir)
    worker.strategy.setup_model_update(rollout_model, "actor_infer")
    share = ROWS // ranks
    for step in range(STEPS):
        whole = rollout(step)
        data = DataProto(whole.batch[rank * share : (rank + 1) * share], meta_info=whole.meta_info)
        old = worker.compute_log_probs(data)
        got["old"].append(old)
        data.batch["old_log_probs"] = old
        data.batch["ref_log_probs"] = old + data.batch["ref_noise"]
        metrics = worker.train_step(data)
        got["pg"] += [value for call in metrics["actor/pg_loss"] for value in call]
        got["grad_norm"] += metrics["actor_train/grad_norm"]
        got["lr"].append(metrics["actor/lr"])
        worker.strategy.model_update("actor_infer", bucket_mb=1)
        if checkpoints:
            assert worker.do_checkpoint(step + 1) == {}
    got.update(received=rollout_model.received, buckets=rollout_model.buckets, rollout=rollout_model.model.state_dict())
    return got


def assert_same_as_plain(got: dict, expected: dict, rows: slice) -> None:
    """Old log-probs (of these rows), gradient norms, learning rates and the rollout model's weights."""
    for old, want in zip(got["old"], expected["old"], strict=True):
        torch.testing.assert_close(old, want[rows], rtol=0, atol=1e-5)
    assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=1e-5)
    assert got["lr"] == pytest.approx(expected["lr"], abs=1e-12)
    assert got["received"] == set(expected["weights"]) and got["buckets"] > 1
    for name, tensor in expected["weights"].items():
        torch.testing.assert_close(got["rollout"][name], tensor, rtol=0, atol=1e-5, msg=name)


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


def test_roll_s_actor_worker_calls_equal_plain_pytorch(model_dir, tmp_path):
    expected = reference(model_dir)
    try:
        got = replay(model_dir, tmp_path)
    finally:
        shutdown()
    assert_same_as_plain(got, expected, slice(None))
    # ROLL's pg_loss metric is per micro-batch (normalised by the backward batch's tokens): pairs sum to the batch's
    pairs = [sum(got["pg"][i : i + ACCUMULATION]) for i in range(0, len(got["pg"]), ACCUMULATION)]
    assert pairs == pytest.approx(expected["pg"], abs=1e-5)
    assert sorted(p.name for p in (tmp_path / "actor_train").iterdir()) == ["checkpoint-1", "checkpoint-2"]


def test_roll_batches_fsdp2kit_cannot_take_are_refused(model_dir, tmp_path):
    try:
        strategy = RollStrategy.from_config(config(model_dir, tmp_path))
        data = rollout(0)
        with pytest.raises(UserError, match="loss_mask_keys"):
            strategy.forward_step(DataProto(data.batch, meta_info={"micro_batch_size": 2}), lambda d, o: (o, {}))
        data.meta_info["forward_args"] = {"pixel_values": torch.zeros(1)}
        data.meta_info["micro_batch_size"] = 2
        with pytest.raises(UserError, match="forward_args"):
            strategy.forward_step(data, lambda d, o: (o, {}))
        with pytest.raises(UserError, match="not a multiple of per_device_train_batch_size"):
            strategy.train_step(DataProto(data.batch[:0], meta_info={"loss_mask_keys": []}), lambda d, o: (o, {}))
        data = rollout(0)
        data.batch["old_log_probs"] = data.batch["ref_log_probs"] = data.batch["ref_noise"]
        worker = ActorWorker(strategy, tmp_path)  # built without entropy_loss, its loss_func asks for the entropy
        with pytest.raises(UserError, match="entropy_loss=True"):
            worker.train_step(data)
    finally:
        shutdown()


def roll_value_loss(data, output_tensor):
    """ROLL's CriticWorker.loss_func with value_clip 0.5: its forward_func_values reading of the logits
    (`output_tensor[:, :-1].squeeze(-1)`), the clipped squared error, 0.5 x agg_loss token-mean."""
    response_mask = data.batch["response_mask"][:, 1:]
    values = output_tensor[:, :-1].squeeze(dim=-1)
    old_values, returns = data.batch["values"], data.batch["returns"]
    clipped = torch.clip(values, old_values - 0.5, old_values + 0.5)
    loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2) * response_mask
    vf_loss = 0.5 * loss.sum() / data.meta_info["batch_num_tokens"]["response_mask"]
    return vf_loss, {"critic/vf_loss": vf_loss.detach().item()}


def test_roll_s_critic_worker_calls_equal_plain_pytorch(model_dir, tmp_path):
    """A critic (LlamaForTokenClassification, one label): ROLL's compute_values (forward_step with
    forward_func_values) and a train_step with its clipped value loss equal transformers' model with AdamW."""
    from transformers import LlamaForTokenClassification

    critic_dir = critic_checkpoint(model_dir, tmp_path / "critic")
    settings = config(critic_dir, tmp_path)
    settings["model"] |= {"model_class": "transformers:LlamaForTokenClassification", "config": {"num_labels": 1}}
    data = rollout(0)
    data.meta_info["micro_batch_size"] = INFER_MICRO
    forward_func_values = lambda d, output: (None, {"values": output[:, :-1].squeeze(dim=-1)})  # noqa: E731
    try:
        strategy = RollStrategy.from_config(settings, role="critic")
        with torch.no_grad():
            values = strategy.forward_step(data, forward_func_values)["values"]
        data.batch["values"], data.batch["returns"] = values, values + data.batch["advantages"]
        backward = DataProto(data.batch[:BACKWARD_ROWS], meta_info=data.meta_info)
        grad_norm = strategy.train_step(backward, roll_value_loss)["critic/grad_norm"]
        weights = {name: tensor.clone() for name, tensor in strategy.strategy.full_weights()}
    finally:
        shutdown()
    plain = LlamaForTokenClassification.from_pretrained(critic_dir, dtype=torch.float32)
    inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
    with torch.no_grad():
        torch.testing.assert_close(values, plain(**inputs).logits[:, :-1, 0], rtol=0, atol=1e-5)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    rows = {key: value[:BACKWARD_ROWS] for key, value in inputs.items()}
    loss, _ = roll_value_loss(DataProto(data.batch[:BACKWARD_ROWS], meta_info=data.meta_info), plain(**rows).logits)
    loss.backward()
    assert grad_norm == pytest.approx(float(clip_grad_norm_exact(plain.parameters(), CLIP)), abs=1e-5)
    optimizer.step()
    for name, tensor in plain.state_dict().items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=1e-5, msg=name)


class LoraRollout:
    """The rollout side of ROLL's LoRA model update (vLLM's in ROLL): adapter tensors bucket by bucket, then
    `add_lora(peft_config)`, which puts them on a peft model over the base."""

    def __init__(self, model_dir):
        self.model_dir, self.tensors, self.flags, self.model = model_dir, {}, set(), None

    def update_parameter_in_bucket(self, named_weights, is_lora=False):
        self.tensors.update({name: tensor.clone() for name, tensor in named_weights})
        self.flags.add(is_lora)

    def add_lora(self, peft_config):
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        settings = {key: value for key, value in peft_config.items() if key in LoraConfig.__dataclass_fields__}
        self.model = get_peft_model(base, LoraConfig(**settings)).eval()
        result = set_peft_model_state_dict(self.model, self.tensors)
        assert not result.unexpected_keys, result.unexpected_keys


def test_roll_s_model_update_of_a_lora_run_sends_the_adapters_alone(model_dir, tmp_path):
    """As ROLL's FSDP2 strategy updates a LoRA rollout: the adapters in peft's file names with is_lora=True, then
    add_lora with their config; the rollout's peft model then gives the trainer's log-probs."""
    settings = config(model_dir, tmp_path)
    settings["model"]["lora"] = {"rank": 4, "target_modules": "all-linear", "init_lora_weights": "gaussian"}
    rollout_model = LoraRollout(model_dir)
    try:
        strategy = RollStrategy.from_config(settings)
        strategy.setup_model_update(rollout_model, "actor_infer")
        strategy.model_update("actor_infer", bucket_mb=1)
        ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
        want = strategy.strategy.forward_step({"input_ids": ids})["log_probs"]
    finally:
        shutdown()
    assert rollout_model.flags == {True}
    assert rollout_model.tensors and all(".lora_" in name for name in rollout_model.tensors)
    with torch.no_grad():
        logits = rollout_model.model(input_ids=ids).logits.float()
    got = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
