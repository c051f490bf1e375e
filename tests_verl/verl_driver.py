"""One rank of verl's own TrainingWorker (`verl.workers.engine_workers`), called as verl's PPO trainer
(`verl/trainer/ppo/ray_trainer.py`) calls its actor, reference and critic workers, with the engine that verl's
config names: fsdp2kit's, or verl's own FSDP2 engine. Launched as `python verl_driver.py SETTINGS_JSON` (one rank) or
under torchrun (two); rank 0 writes what tests/test_verl_worker.py compares. Ray is not involved: the calls go to
the worker object, each rank given its share of the batch as verl's dispatch (`chunk` by data-parallel rank) gives.
Around the actor's and the critic's first update, and a critic's at an RL learning rate (the `delta` role), verl's
delta weight sync runs from the worker's engine (DeltaSync)."""

from __future__ import annotations

import json
import os
import sys
from functools import partial
from pathlib import Path

import cpu_platform  # noqa: F401  (verl's platform: before verl resolves it)
import torch
import torch.distributed as dist
from tensordict import NonTensorData
from verl import DataProto
from verl.trainer.config import CheckpointConfig
from verl.utils import tensordict_utils as tu
from verl.utils.metric import reduce_metrics
from verl.utils.model import compute_position_id_with_mask
from verl.workers.config import (
    FSDPActorConfig,
    FSDPCriticConfig,
    FSDPEngineConfig,
    FSDPOptimizerConfig,
    HFModelConfig,
    TrainingWorkerConfig,
)
from verl.workers.engine_workers import TrainingWorker
from verl.workers.utils.losses import ppo_loss, sft_loss, value_loss
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding

ROWS, PROMPT, RESPONSE = 8, 6, 6  # the global batch: 8 rollouts, two mini-batches of 4
TEMPERATURE = 0.8
# glibc's malloc heaps of this rank (fsdp2kit.distributed.malloc_heaps): fsdp2kit's adapter, imported before the
# process group starts, keeps threads that allocate later from making heaps of their own (integrations/__init__.py).
HEAPS: dict[str, int | None] = {}


def engine_config(settings: dict, forward_only: bool = False):
    """The engine config verl's trainer hands its worker: fsdp2kit's, or verl's FSDP2's with the same settings."""
    common = {
        "ulysses_sequence_parallel_size": settings["ulysses"],
        "mixed_precision": settings["mixed_precision"],
        "forward_only": forward_only,
        "use_dynamic_bsz": True,
        "max_token_len_per_gpu": settings["max_tokens"],
        "infer_max_token_len_per_gpu": settings["max_tokens"],
    }
    if settings["backend"] == "fsdp2kit":
        from fsdp2kit.integrations.verl import Fsdp2kitEngineConfig

        return Fsdp2kitEngineConfig(**common, overrides=[f"training.output_dir={settings['out']}.runs"])
    return FSDPEngineConfig(strategy="fsdp2", use_torch_compile=False, **common)


def worker(settings: dict, model_type: str, path: str, forward_only: bool = False) -> TrainingWorker:
    optimizer = FSDPOptimizerConfig(
        lr=settings["lr"],
        weight_decay=settings["weight_decay"],
        clip_grad=1.0,
        total_training_steps=4,
        lr_scheduler_type="constant",
    )
    config = TrainingWorkerConfig(
        model_type=model_type,
        model_config=HFModelConfig(
            path=path, use_remove_padding=settings["remove_padding"], override_config={"attn_implementation": "sdpa"}
        ),
        engine_config=engine_config(settings, forward_only),
        optimizer_config=optimizer,
        checkpoint_config=CheckpointConfig(),
    )
    training_worker = TrainingWorker(config)
    training_worker.reset()
    return training_worker


def rollout_batch(path: str, prompt: int = PROMPT, response: int = RESPONSE) -> DataProto:
    """What verl's rollout hands the trainer: left-padded prompts, right-padded responses, of different lengths (up
    to `prompt` and `response` tokens; benchmarks/peers.py asks for longer ones)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    generator = torch.Generator().manual_seed(7)
    prompt_lens = torch.randint(2, prompt + 1, (ROWS,), generator=generator)
    response_lens = torch.randint(1, response + 1, (ROWS,), generator=generator)
    prompts = torch.randint(3, vocab, (ROWS, prompt), generator=generator)
    responses = torch.randint(3, vocab, (ROWS, response), generator=generator)
    prompt_mask = torch.arange(prompt)[None, :] >= (prompt - prompt_lens)[:, None]
    response_mask = torch.arange(response)[None, :] < response_lens[:, None]
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1).long()
    input_ids = torch.cat([prompts, responses], dim=1) * attention_mask
    batch = {
        "prompts": prompts * prompt_mask,
        "responses": responses * response_mask,
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": compute_position_id_with_mask(attention_mask),
        "response_mask": response_mask.long(),
        "advantages": torch.randn(ROWS, response, generator=generator) * response_mask,
        "returns": torch.randn(ROWS, response, generator=generator) * response_mask,
    }
    return DataProto.from_single_dict(batch, meta_info={"temperature": TEMPERATURE})


def share(batch: DataProto) -> DataProto:
    """This rank's share, as verl's dispatch splits a batch over the data-parallel ranks (its Ulysses peers get
    the same)."""
    ulysses = int(os.environ.get("VERL_TEST_ULYSSES", "1"))
    dp_size = dist.get_world_size() // ulysses
    return batch.chunk(dp_size)[dist.get_rank() // ulysses]


def no_padding(batch: DataProto, **settings) -> object:
    data = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(data, **settings)
    return data


def infer(training_worker: TrainingWorker, batch: DataProto, key: str, entropy: bool) -> dict:
    """verl's _compute_old_log_prob / _compute_ref_log_prob / _compute_values: outputs back in the padded layout."""
    data = no_padding(batch, calculate_entropy=entropy, compute_loss=False)
    output = training_worker.infer_batch(data)
    if output is None:  # a rank verl does not collect from (not its Ulysses group's first)
        return {}
    result = {key: no_padding_2_padding(tu.get(output, key), data).float()}
    if entropy:
        result["entropy"] = no_padding_2_padding(tu.get(output, "entropy"), data).float()
    result["metrics"] = {k: v for k, v in tu.get(output, "metrics").items() if not k.startswith("perf/")}
    return result


def update(training_worker: TrainingWorker, batch: DataProto, entropy: bool) -> dict:
    """verl's _update_actor / _update_critic: two mini-batches of the global batch, then the schedule's step."""
    extra = {"calculate_entropy": entropy} if entropy else {}
    mini = ROWS // 2
    data = no_padding(
        batch,
        **extra,
        global_batch_size=mini,
        mini_batch_size=mini,
        epochs=1,
        seed=1,
        dataloader_kwargs={"shuffle": False},
        compute_loss=True,
    )
    output = training_worker.train_mini_batch(data)
    if output is None:
        return {}
    metrics = tu.get(output, "metrics")
    reduced = reduce_metrics({k: v for k, v in metrics.items() if not k.startswith("perf/")})
    return {"metrics": metrics, "reduced": reduced}


def weights(training_worker: TrainingWorker) -> dict:
    params, peft = training_worker.engine.get_per_tensor_param()
    assert peft is None
    return {name: tensor.detach().float().clone() for name, tensor in params}


def from_collecting_rank(tensor: torch.Tensor) -> None:
    """Under Ulysses (here one group: every rank) verl's trainer gets the outputs of the group's first rank and
    hands the whole group the next batch built from them."""
    if int(os.environ["VERL_TEST_ULYSSES"]) > 1:
        assert dist.get_world_size() == int(os.environ["VERL_TEST_ULYSSES"])
        dist.broadcast(tensor, src=0)


DELTA_LR = 1e-5  # an RL learning rate: one step changes a part of the bf16 values (the delta is sparse)
GATHER_BATCH = 32  # parameters per gather round: verl's delta engine's default (`batch_gather`)


def seed_sync(engine) -> dict[str, torch.Tensor]:
    """verl's delta engine's seed (`DeltaShardedCheckpointEngine._send_full_seed`): every rank reads
    `get_per_tensor_param`, rank 0 keeps each tensor cast to the rollout's bf16 as the receiver's weights."""
    full, peft = engine.get_per_tensor_param()
    assert peft is None
    received = {}
    for name, tensor in full:
        tensor = tensor.detach()
        if tensor.is_floating_point():
            tensor = tensor.to(torch.bfloat16)
        if dist.get_rank() == 0:
            received[name] = tensor.clone().contiguous()
    return received


def gathered_deltas(entries) -> list[tuple[str, str, tuple, torch.Tensor, torch.Tensor]]:
    """`get_per_tensor_param_delta_shard`'s entries gathered to rank 0 as verl's delta engine gathers them
    (`delta_checkpoint_engine._GatherQueue`, whose module needs zmq and cupy: its steps here): one queue per gather
    group, a group of None read from rank 0's own entries, the others gathered in rounds of GATHER_BATCH entries
    with verl's own `sparse_gather.gather_slot_entries_to_rank0` (gloo). (name, dtype, shape, positions, values) per
    HF tensor on rank 0."""
    from verl.checkpoint_engine.delta_sync.sparse_gather import gather_slot_entries_to_rank0

    queues: dict[int, tuple] = {}
    out = []

    def flush(pg, batch: list) -> None:
        if pg is None:
            for slots, dtype, counts, idx, val in batch:
                ends = torch.cumsum(counts, 0).tolist()
                for (name, shape), start, end in zip(slots, [0, *ends[:-1]], ends, strict=True):
                    out.append((name, dtype, tuple(shape), idx[start:end], val[start:end]))
            return
        counts = torch.cat([entry[2] for entry in batch])
        got = gather_slot_entries_to_rank0(
            torch.cat([entry[3] for entry in batch]), torch.cat([entry[4] for entry in batch]), counts, group=pg
        )
        slots = [(name, dtype, tuple(shape)) for s, dtype, *_ in batch for name, shape in s]
        if got is not None:
            out.extend((*slot, idx, val) for slot, (idx, val) in zip(slots, got, strict=True))

    for slots, dtype, counts, idx, val, pg in entries:
        _, batch = queues.setdefault(id(pg), (pg, []))
        batch.append((slots, dtype, counts, idx, val))
        if len(batch) >= GATHER_BATCH:
            flush(pg, batch)
            batch.clear()
    for pg, batch in queues.values():
        flush(pg, batch)
    return out if dist.get_rank() == 0 else []


def apply_deltas(received: dict[str, torch.Tensor], deltas: list) -> None:
    """One flush in verl's wire format (`DeltaShardedCheckpointEngine._assemble_flush`: the `indices` encoding of
    verl's `DeltaParam`, int32 positions, verl's checksum) applied onto the receiver's weights by verl's own receiver,
    SGLang's `delta_loader.apply_delta` (checksum, decode, masked copy into `load_weights`)."""
    import json

    from verl.checkpoint_engine.delta_sync.encode import DeltaParam, checksum
    from verl.workers.rollout.sglang_rollout.delta_loader import apply_delta

    params, positions, values, pos, val = [], [], [], 0, 0
    for name, dtype, shape, idx, vals in deltas:
        params.append(DeltaParam(name, dtype, list(shape), pos, pos + 4 * len(idx), 4, val, val + len(vals)))
        positions.append(idx.to(torch.int32))
        values.append(vals)
        pos, val = pos + 4 * len(idx), val + len(vals)
    blob = torch.cat(positions).contiguous().view(torch.uint8)
    flat = torch.cat(values)
    spec = {"encoding": "indices", "params": [vars(p) for p in params], "checksum": int(checksum(blob, flat))}
    wire = json.dumps(spec).encode()

    class Model:  # what SGLang's model gives the loader: load_weights(named tensors)
        def load_weights(self, chunk: list) -> None:
            for name, tensor in chunk:
                received[name].copy_(tensor)

    spec_tensor = torch.frombuffer(bytearray(wire), dtype=torch.uint8)
    apply_delta(Model(), [("__delta_spec__", spec_tensor), ("__positions__", blob), ("__values__", flat)])


class DeltaSync:
    """verl's delta weight sync (`DeltaShardedCheckpointEngine.send_weights`) from a worker's engine: the seed
    (`get_per_tensor_param`, then `prime_delta_snapshots`) when made, a steady sync (`get_per_tensor_param_delta_shard`,
    gathered to rank 0 and applied onto the seed there) at `steady`."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.received = seed_sync(engine)
        self.seed = {name: tensor.clone() for name, tensor in self.received.items()}
        engine.prime_delta_snapshots()

    def steady(self) -> dict:
        entries, peft = self.engine.get_per_tensor_param_delta_shard()
        assert peft is None
        deltas = gathered_deltas(entries)
        if dist.get_rank() == 0:
            apply_deltas(self.received, deltas)
        changed = {name: len(idx) for name, _, _, idx, _ in deltas}
        return {"seed": self.seed, "received": self.received, "changed": changed}


def actor_worker(settings: dict) -> TrainingWorker:
    """verl's actor: the worker with verl's PPO loss (an entropy bonus of 0.01 unless settings say otherwise)."""
    actor = worker(settings, "language_model", settings["model"])
    bonus = settings.get("entropy_coeff", 0.01)
    config = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=ROWS // 2, use_dynamic_bsz=True, entropy_coeff=bonus
    )
    actor.set_loss_fn(partial(ppo_loss, config=config))
    return actor


def run_actor(settings: dict, rollout: DataProto, checkpoint: Path) -> dict:
    actor = actor_worker(settings)
    before = infer(actor, rollout, "log_probs", entropy=True)
    # verl's own FSDP2 reference (forward_only) shards with CPUOffloadPolicy(pin_memory=True), which needs an
    # accelerator: the test compares fsdp2kit's reference with verl's actor before its update (the same weights).
    ref = None
    if settings["backend"] == "fsdp2kit":
        reference = worker(settings, "language_model", settings["model"], forward_only=True)
        ref = infer(reference, rollout, "log_probs", entropy=False)
    old_log_probs = before["log_probs"] if before else torch.zeros(len(rollout), RESPONSE)
    from_collecting_rank(old_log_probs)
    batch = rollout.union(DataProto.from_single_dict({"old_log_probs": old_log_probs}))
    sync = DeltaSync(actor.engine)
    first = update(actor, batch, entropy=True)
    synced = sync.steady()
    after = infer(actor, rollout, "log_probs", entropy=True)
    params = weights(actor)
    actor.to("cpu")
    actor.to("device")
    offloaded = infer(actor, rollout, "log_probs", entropy=False)
    actor.save_checkpoint(str(checkpoint), global_step=1)
    second = update(actor, batch, entropy=True)
    actor.load_checkpoint(str(checkpoint))
    restored = infer(actor, rollout, "log_probs", entropy=False)
    return {
        "before": before,
        "ref": ref,
        "update": first,
        "after": after,
        "weights": params,
        "offloaded": offloaded,
        "second": second,
        "restored": restored,
        "sync": synced,
    }


def critic_attention_on_cpu() -> None:
    """Scaffolding for verl's own critic: verl 0.9.1 loads it with attn_implementation="flash_attention_2" written
    into `verl/utils/model.py:load_valuehead_model` (no override reaches it), which needs flash-attn and a GPU; here
    it loads with the attention its config names (sdpa, from the model config's override_config), nothing else
    changed."""
    import verl.utils.model as verl_model
    from transformers import AutoModelForTokenClassification

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        return AutoModelForTokenClassification.from_pretrained(
            local_path, torch_dtype=torch_dtype, config=model_config, trust_remote_code=trust_remote_code
        )

    verl_model.load_valuehead_model = load_valuehead_model


def run_critic(settings: dict, rollout: DataProto) -> dict:
    if settings["backend"] != "fsdp2kit":
        critic_attention_on_cpu()
    critic = worker(settings, "value_model", settings["critic_model"])
    config = FSDPCriticConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=ROWS // 2, use_dynamic_bsz=True, cliprange_value=0.5
    )
    critic.set_loss_fn(partial(value_loss, config=config))
    before = infer(critic, rollout, "values", entropy=False)
    values = before["values"] if before else torch.zeros(len(rollout), RESPONSE)
    from_collecting_rank(values)
    batch = rollout.union(DataProto.from_single_dict({"values": values}))
    sync = DeltaSync(critic.engine)
    first = update(critic, batch, entropy=False)
    synced = sync.steady()
    after = infer(critic, rollout, "values", entropy=False)
    return {"before": before, "update": first, "after": after, "weights": weights(critic), "sync": synced}


def sft_batch(path: str) -> object:
    """What verl's SFT trainer (`verl/trainer/sft_trainer.py`) hands the worker: its no-padding dataset's rows as
    jagged tensors (input_ids, position_ids, loss_mask over each row's response) and its settings."""
    from tensordict import TensorDict
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    generator = torch.Generator().manual_seed(11)
    lengths = torch.randint(4, PROMPT + RESPONSE + 1, (ROWS,), generator=generator).tolist()
    ids = [torch.randint(3, vocab, (n,), generator=generator) for n in lengths]
    masks = [(torch.arange(n) >= n // 2).long() for n in lengths]
    jagged = lambda rows: torch.nested.as_nested_tensor(rows, layout=torch.jagged)  # noqa: E731
    data = TensorDict(
        {
            "input_ids": jagged(ids),
            "position_ids": jagged([torch.arange(n) for n in lengths]),
            "loss_mask": jagged(masks),
        },
        batch_size=[ROWS],
    )
    tu.assign_non_tensor(data, temperature=1.0, global_batch_size=ROWS, use_remove_padding=True, use_dynamic_bsz=True)
    return data


def run_sft(settings: dict) -> dict:
    """verl's SFT trainer's calls: train_batch per step (with update_lr_scheduler), infer_batch for validation with
    its loss (compute_loss), each on this rank's share."""
    trainer = worker(settings, "language_model", settings["model"])
    trainer.set_loss_fn(partial(sft_loss, config=None))
    dp_size, rank = dist.get_world_size(), dist.get_rank()
    data = tu.chunk_tensordict(sft_batch(settings["model"]), dp_size)[rank]
    lengths = data["input_ids"].offsets().diff().tolist()
    validation = trainer.infer_batch(data.copy())
    tu.assign_non_tensor(data, update_lr_scheduler=True, global_token_num=NonTensorData(lengths))
    step = trainer.train_batch(data.copy())
    after = trainer.infer_batch(data.copy())
    return {
        "validation": {k: v for k, v in tu.get(validation, "metrics").items() if not k.startswith("perf/")},
        "step": {k: v for k, v in tu.get(step, "metrics").items() if not k.startswith("perf/") and k != "mfu"},
        # each row's last position predicts nothing (verl's engine leaves the next row's first token there, fsdp2kit
        # 0; no loss reads it)
        "log_probs": torch.cat([row[:-1] for row in tu.get(after, "log_probs").unbind()]),
    }


def start(settings: dict) -> None:
    """This rank's process group: torchrun's variables, or one rank's defaults. fsdp2kit's side imports its adapter
    first, as verl's worker process does when it receives its engine config (which registers the engine), and verl's
    side imports no fsdp2kit: the import sets fsdp2kit's allocator (fsdp2kit/integrations/__init__.py)."""
    if settings["backend"] == "fsdp2kit":
        from fsdp2kit.distributed import malloc_heaps

        HEAPS["at the adapter's import"] = malloc_heaps()
        import fsdp2kit.integrations.verl  # noqa: F401
    os.environ["VERL_TEST_ULYSSES"] = str(settings["ulysses"])
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("MASTER_PORT", str(settings.get("port", 29533)))
    dist.init_process_group("gloo")


def main() -> None:
    settings = json.loads(sys.argv[1])
    start(settings)
    rollout = share(rollout_batch(settings["model"]))
    out = Path(settings["out"])
    result = {"dp": dist.get_world_size() // settings["ulysses"]}
    if "actor" in settings["roles"]:
        result["actor"] = run_actor(settings, rollout, out.with_suffix(f".ckpt-{settings['backend']}"))
    if "critic" in settings["roles"]:
        result["critic"] = run_critic(settings, rollout)
    if "sft" in settings["roles"]:
        result["sft"] = run_sft(settings)
    if "delta" in settings["roles"]:
        result["delta"] = run_critic({**settings, "lr": DELTA_LR}, rollout)
    from fsdp2kit.distributed import malloc_heaps  # after the run: the import sets nothing

    result["heaps"] = {**HEAPS, "after the run": malloc_heaps()}
    if dist.get_rank() == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
