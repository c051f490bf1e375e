"""One rank of ROLL's own RLVR workers for tests_roll/test_roll_real.py: `python roll_worker.py ENGINE ROLE MODEL_DIR
OUT RANKS` with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set as ROLL's cluster sets them. ENGINE `roll`: ROLL's
factory as published (its FSDP2 strategies); `fsdp2kit`: the lines docs/api.md gives a ROLL user. The worker
(roll/pipeline/rlvr/actor_worker.py:ActorWorker for the actor and the reference, base_worker.py:CriticWorker) is
built from ROLL's RLVRConfig and runs an RLVR step as ROLL's pipeline calls it (the reference: compute_log_probs):
initialize, compute_log_probs (compute_values), train_step, the model update, do_checkpoint, a second train_step,
and the checkpoint loaded back as ROLL's initialize loads it; what each call returned is saved to OUT.rankN."""

from __future__ import annotations

import os
import sys

import roll_scaffold
import torch

ROWS, PROMPT, RESPONSE = 4, 6, 6
# The actor's strategy_config keys for ROLE `actor_ep` (Qwen3-MoE, expert parallelism over 2 ranks, as ROLL's
# examples/qwen3-30BA3B-rlvr_fsdp2/rlvr_config_ep.yaml writes it) and `actor_moe` (the same model without it).
MOE_LAYERS = {"transformer_layer_cls_to_wrap": ["Qwen3MoeAttention", "Qwen3MoeSparseMoeBlock"]}
ACTOR_STRATEGY = {
    "actor_ep": {
        "ep_size": 2,
        "moe_use_grouped_mm": False,
        "wrap_policy": {**MOE_LAYERS, "moe_experts": ["Qwen3MoeExperts"]},
    },
    "actor_moe": {"wrap_policy": MOE_LAYERS},
}


# glibc's malloc heaps of this rank (fsdp2kit.distributed.malloc_heaps): fsdp2kit's adapter, imported before ROLL's
# worker starts the process group, keeps threads that allocate later from making heaps of their own.
HEAPS: dict[str, int | None] = {}


def use_fsdp2kit() -> None:
    """What a ROLL user writes (docs/api.md) in the module its worker_cls names."""
    import roll.pipeline.base_worker as base_worker

    from fsdp2kit.integrations.roll import fsdp2kit_for_fsdp2

    base_worker.create_strategy = fsdp2kit_for_fsdp2(base_worker.create_strategy)


def rollout(step: int, rows: int = ROWS, prompts: int = PROMPT, responses: int = RESPONSE) -> dict[str, torch.Tensor]:
    """A batch as ROLL's RLVR pipeline hands the actor and the critic: left-padded prompts, right-padded responses,
    position_ids from the mask, response_mask, advantages and reference log-probs, old values and returns (`rows`
    rollouts of up to `prompts` + `responses` tokens; benchmarks/peers.py asks for more and longer ones)."""
    generator = torch.Generator().manual_seed(100 + step)
    width = prompts + responses
    prompt_lens = torch.randint(2, prompts + 1, (rows,), generator=generator)
    response_lens = torch.randint(2, responses + 1, (rows,), generator=generator)
    columns = torch.arange(width)[None]
    prompt = (columns >= prompts - prompt_lens[:, None]) & (columns < prompts)
    response = (columns >= prompts) & (columns < prompts + response_lens[:, None])
    mask = (prompt | response).long()
    return {
        "input_ids": torch.randint(3, 500, (rows, width), generator=generator) * mask,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0) * mask,
        "response_mask": response.long(),
        "prompt_mask": prompt.long(),
        "advantages": torch.randn(rows, width - 1, generator=generator) * response[:, 1:],
        "ref_log_probs": -torch.rand(rows, width - 1, generator=generator) * 6,
        "values": torch.randn(rows, width - 1, generator=generator) * response[:, 1:],
        "returns": torch.randn(rows, width - 1, generator=generator) * response[:, 1:],
        "train_infer_is_weight": torch.ones(rows, width - 1),  # the pipeline's, with its correction off
    }


def share(tensors: dict[str, torch.Tensor], step: int) -> object:
    """This rank's part of the global batch, as ROLL's DP dispatch splits it (chunk by data-parallel rank)."""
    from roll.distributed.scheduler.protocol import DataProto

    data = DataProto.from_dict(tensors=tensors)
    data.meta_info = {"global_step": step, "is_offload_states": True, "loss_mask_keys": ["response_mask"]}
    return data.chunk(int(os.environ["WORLD_SIZE"]))[int(os.environ["RANK"])]


class Receiver:
    """The rollout side of ROLL's model update: what arrives, bucket by bucket."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}

    def update_parameter_in_bucket(self, named_weights: list, is_lora: bool = False) -> None:
        self.tensors.update({name: tensor.detach().clone() for name, tensor in named_weights})


def model_update(worker: object, engine: str) -> dict[str, torch.Tensor]:
    """fsdp2kit: the worker's setup_model_update / start_model_update. ROLL's own: its FSDP2WeightUpdater sends what
    roll/third_party/fsdp2/model_update.py:gather_fsdp2_weights yields (its sending needs Ray's rollout workers)."""
    if engine == "fsdp2kit":
        receiver = Receiver()
        worker.setup_model_update(receiver, "actor_infer")
        worker.start_model_update("actor_infer")
        return receiver.tensors
    from roll.third_party.fsdp2.model_update import gather_fsdp2_weights

    worker.strategy.load_states()
    tensors = {n: t.detach().clone() for b in gather_fsdp2_weights(worker.strategy.model, 1 << 20) for n, t in b}
    worker.strategy.offload_states()
    return tensors


def build(
    engine: str, role: str, model_dir: str, out: str, ranks: int, actor_model_args: dict | None = None
) -> tuple[object, object]:
    """ROLL's worker of `role` on `engine`, initialised as ROLL's pipeline initialises it, and its RLVRConfig
    (`actor_model_args`: keys added to the actor's model_args)."""
    roll_scaffold.install()
    if engine == "fsdp2kit":
        from fsdp2kit.distributed import malloc_heaps

        HEAPS["at the adapter's import"] = malloc_heaps()
        use_fsdp2kit()
    from roll.pipeline.base_worker import CriticWorker
    from roll.pipeline.rlvr.actor_worker import ActorWorker

    config = roll_scaffold.pipeline_config(
        model_dir, out + ".run", ranks, actor_strategy=ACTOR_STRATEGY.get(role), actor_model_args=actor_model_args
    )
    role = "actor" if role in ACTOR_STRATEGY else role
    worker_config = {"actor": config.actor_train, "reference": config.reference, "critic": config.critic}[role]
    worker = (CriticWorker if role == "critic" else ActorWorker)(worker_config=worker_config)
    worker.initialize(config)
    return worker, config


def run(engine: str, role: str, model_dir: str, out: str, ranks: int) -> None:
    worker, config = build(engine, role, model_dir, out, ranks)
    role, moe = ("actor", True) if role in ACTOR_STRATEGY else (role, False)
    first, second = rollout(0), rollout(1)
    result: dict[str, object] = {"strategy": type(worker.strategy).__name__}
    if moe:
        result["experts"] = experts_layout(worker.strategy.model)
    if role == "reference":  # ROLL's reference: an ActorWorker on fsdp2_infer, asked for log-probs only
        result.update(worker.compute_log_probs(share(first, 0)).batch.items())
        torch.save(result, f"{out}.rank{os.environ['RANK']}")
        return
    if role == "actor":
        before = worker.compute_log_probs(share(first, 0)).batch
        result["log_probs"], result["entropy"] = before["log_probs"], before["entropy"]
    else:
        result["values"] = worker.compute_values(share(first, 0)).batch["values"]
    result["train"] = worker.train_step(share(train_batch(first, result, role), 0)).meta_info["metrics"]
    if role == "actor":
        result["update"] = model_update(worker, engine)
    worker.do_checkpoint(global_step=1)
    saved = after(worker, role, second)
    worker.train_step(share(train_batch(second, {**result, **saved}, role), 1))
    result["saved"] = saved
    if engine == "fsdp2kit" or ranks == 1:  # ROLL's own cannot: rank 1's folder has no DCP .metadata (rank 0's has)
        folder = os.path.join(config.output_dir, worker.worker_name, "checkpoint-1")
        pending = getattr(worker.strategy, "checkpoint_future", None)  # ROLL's own saves DCP asynchronously (default)
        if pending is not None:
            pending.result()  # as ROLL waits before its next save; loading before it ends finds no .metadata
        worker.strategy.load_checkpoint(load_dir=folder if role == "actor" else os.path.join(folder, "critic"))
        result["loaded"] = after(worker, role, second)
    from fsdp2kit.distributed import malloc_heaps

    result["heaps"] = {**HEAPS, "after the run": malloc_heaps()}
    torch.save(result, f"{out}.rank{os.environ['RANK']}")


def experts_layout(model: torch.nn.Module) -> dict[str, tuple]:
    """Each experts weight's mesh dimensions and this rank's local shape: how the strategy split the experts."""
    return {
        name: (param.device_mesh.mesh_dim_names, tuple(param.to_local().shape))
        for name, param in model.named_parameters()
        if ".experts." in name
    }


def train_batch(tensors: dict[str, torch.Tensor], result: dict, role: str) -> dict[str, torch.Tensor]:
    """The actor's batch holds the old policy's log-probs (here the reference's, moved by the advantages: the ratio
    then differs from 1 and the clipping acts)."""
    tensors = dict(tensors)
    if role == "actor":
        tensors["old_log_probs"] = tensors["ref_log_probs"] + 0.05 * tensors["advantages"]
    return tensors


def after(worker: object, role: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model gives on a batch: the actor's log-probs, the critic's values."""
    if role == "actor":
        return dict(worker.compute_log_probs(share(tensors, 1)).batch.items())
    return dict(worker.compute_values(share(tensors, 1)).batch.items())


if __name__ == "__main__":
    engine, role, model_dir, out, ranks = sys.argv[1:6]
    run(engine, role, model_dir, out, int(ranks))
