"""One rank of a `training.optimizer: muon` run through `fsdp2kit.Strategy` for tests/test_muon.py, launched as
`python tests/muon_worker.py MODEL_DIR OUT FSDP_SIZE STEPS SAVE_AFTER RESUME` under torchrun's environment (or alone, a
world of one): it trains steps on its data-parallel share of `strategy_case`'s global micro-batches (every world
size trains the same global batches), counting its calls of torch's Newton-Schulz iteration; after SAVE_AFTER steps
(0: never) it saves a checkpoint to OUT.ckpt, and with RESUME (a checkpoint, '-' for none) it starts from there. Rank 0
saves the losses, the final weights and every rank's orthogonalised matrices and call counts to OUT."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from strategy_case import global_micro_batches, policy_loss, strategy_config
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.optim import _muon

import fsdp2kit
from fsdp2kit.config.schema import TrainingConfig
from fsdp2kit.train.optim import build_optimizer

GLOBAL_MICRO_BATCHES = 4
MUON_LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.1


def muon_config(model_dir: str, output_dir: str, steps: int, fsdp_size: int) -> dict:
    config = strategy_config(model_dir, output_dir, steps)
    config["training"].update({"optimizer": "muon", "learning_rate": MUON_LEARNING_RATE, "weight_decay": WEIGHT_DECAY})
    config["strategy_args"] = {"strategy_config": {"fsdp_size": fsdp_size}}
    return config


def counting_newton_schulz() -> list[int]:
    """torch's Newton-Schulz iteration, its calls on this rank counted (the one-element list)."""
    calls = [0]
    original = _muon._zeropower_via_newtonschulz

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    _muon._zeropower_via_newtonschulz = counted
    return calls


class StackedExperts(nn.Module):
    """A fused experts module as transformers 5 holds one: 5 experts' 7 x 4 matrices stacked (5 split unevenly over 2
    ranks, whole experts each), and per-expert biases (2-D, to AdamW)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(5, 7, 4))
        self.gate_up_proj_bias = nn.Parameter(torch.randn(5, 7))


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts()


class Matrices(nn.Module):
    """Odd shapes: 13 rows shard unevenly over 2 and 4 ranks, 3 rows leave a rank of 4 without any, a tall matrix is
    transposed inside Newton-Schulz; stacked experts are one matrix per expert; an embedding, biases, a norm and the
    experts' biases go to AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.square = nn.Linear(13, 13)
        self.tall = nn.Linear(3, 40, bias=False)
        self.wide = nn.Linear(40, 3, bias=False)
        self.norm = nn.LayerNorm(6)
        self.mlp = MoE()


EXPERTS = [f"mlp.experts.gate_up_proj[{expert}]" for expert in range(5)]
MATRICES = sorted(["square.weight", "tall.weight", "wide.weight", *EXPERTS])


class PerExpertMuon:
    """The reference for stacked experts: torch.optim.Muon over one 2-D parameter per expert (copies of the stacked
    tensor's slices), each given its slice of the gradient, the results copied back."""

    def __init__(self, stacked: nn.Parameter, **muon: float | str) -> None:
        self.stacked = stacked
        self.experts = [nn.Parameter(matrix.detach().clone()) for matrix in stacked]
        self.muon = torch.optim.Muon(self.experts, **muon)

    @torch.no_grad()
    def step(self) -> None:
        for expert, (matrix, grad) in enumerate(zip(self.stacked, self.stacked.grad, strict=True)):
            self.experts[expert].copy_(matrix)
            self.experts[expert].grad = grad.clone()
        self.muon.step()
        for expert, matrix in enumerate(self.experts):
            self.stacked[expert].copy_(matrix)


def step_on_given_gradients(fsdp_size: int, steps: int = 2) -> dict:
    """fsdp2kit's Muon on a fully_shard-ed module (HSDP where fsdp_size < world) and torch.optim.Muon + AdamW on a
    plain copy, stepped with the same seeded gradients: the largest difference of the weights, and the matrices this
    rank orthogonalised."""
    world = dist.get_world_size()
    torch.manual_seed(0)
    plain = Matrices()
    sharded = Matrices()
    sharded.load_state_dict(plain.state_dict())
    shape, names = ((world // fsdp_size, fsdp_size), ("ddp", "fsdp")) if fsdp_size < world else ((world,), ("fsdp",))
    fully_shard(sharded, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    tc = TrainingConfig(optimizer="muon", learning_rate=1e-2, weight_decay=0.1)
    optimizer = build_optimizer(sharded, tc)
    params = dict(plain.named_parameters())
    settings = {"lr": 1e-2, "weight_decay": 0.1, "adjust_lr_fn": "match_rms_adamw"}
    whole = [n for n in MATRICES if n not in EXPERTS]
    muon = torch.optim.Muon([params[n] for n in whole], **settings)  # type: ignore[arg-type]
    experts_muon = PerExpertMuon(params["mlp.experts.gate_up_proj"], **settings)
    rest = [n for n in params if n not in whole and n != "mlp.experts.gate_up_proj"]
    adamw = torch.optim.AdamW(
        [
            {"params": [params[n] for n in rest if params[n].ndim >= 2], "weight_decay": 0.1},
            {"params": [params[n] for n in rest if params[n].ndim < 2], "weight_decay": 0.0},
        ],
        lr=1e-2,
        foreach=True,
    )
    generator = torch.Generator().manual_seed(1)
    orthogonalised = []
    for _ in range(steps):
        for name, param in sharded.named_parameters():
            grad = torch.randn(param.shape, generator=generator)
            params[name].grad = grad
            param.grad = distribute_tensor(grad, param.device_mesh, param.placements)
        optimizer.step()
        muon.step()
        experts_muon.step()
        adamw.step()
        orthogonalised.append(sorted(optimizer.orthogonalised))
    differences = {
        name: (param.full_tensor() - params[name]).abs().max().item() for name, param in sharded.named_parameters()
    }
    return {"largest_difference": max(differences.values()), "orthogonalised": orthogonalised}


def run(model_dir: str, out: str, fsdp_size: int, steps: int, save_after: int, resume: str) -> dict:
    calls = counting_newton_schulz()
    strategy = fsdp2kit.Strategy.from_config(muon_config(model_dir, out + ".run", steps, fsdp_size))
    given = step_on_given_gradients(fsdp_size)
    first = strategy.load_checkpoint(resume)["step"] if resume != "-" else 0
    world, rank = dist.get_world_size(), dist.get_rank()
    losses, orthogonalised, counted = [], [], []
    for step in range(first, steps):
        mine = global_micro_batches(step, GLOBAL_MICRO_BATCHES)[rank::world]
        before = calls[0]
        losses.append(strategy.train_step(mine, policy_loss)["loss"])
        counted.append(calls[0] - before)
        orthogonalised.append(list(strategy.optimizer.orthogonalised))
        if step + 1 == save_after:
            strategy.save_checkpoint(out + ".ckpt")
    weights = {name: tensor.clone() for name, tensor in strategy.full_weights(bucket_bytes=1 << 16)}
    ranks: list = [None] * world
    dist.all_gather_object(ranks, {"orthogonalised": orthogonalised, "calls": counted, "given_gradients": given})
    result = {"losses": losses, "weights": weights, "ranks": ranks}
    if rank == 0:
        torch.save(result, out)
    return result


if __name__ == "__main__":
    model_dir, out, fsdp_size, steps, save_after, resume = sys.argv[1:7]
    run(model_dir, out, int(fsdp_size), int(steps), int(save_after), resume)
