"""One rank of tests/test_tensor_parallel.py's vocabulary-split head check, launched as `python
tests/vocab_parallel_worker.py OUT` under torchrun's environment (2 ranks): the chunked head's log-probs, entropies
and summed loss, and their gradients (the hidden states', the weight's and the bias's), from a head split by
vocabulary over the ranks against the same head whole on every rank, with a soft-cap, a scale and per-token
temperatures, over an odd vocabulary (the last rank holds fewer rows) and in chunks. Rank 0 saves the largest
differences."""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from fsdp2kit.distributed import shutdown
from fsdp2kit.labels import IGNORE_INDEX
from fsdp2kit.parallel.token_logprobs import AfterHead, TokenRequest, _chunked

TOKENS, WIDTH, VOCAB = 2 * 7, 16, 37


def head_outputs(split: bool, summed: bool) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(11)
    hidden = torch.randn(2, TOKENS // 2, WIDTH, generator=generator).requires_grad_()
    weight, bias = torch.randn(VOCAB, WIDTH, generator=generator), torch.randn(VOCAB, generator=generator)
    targets = torch.randint(0, VOCAB, (2, TOKENS // 2), generator=generator)
    targets[0, 2] = IGNORE_INDEX
    temperature = torch.rand(2, TOKENS // 2, generator=generator) + 0.5
    upstream = torch.randn(2, TOKENS // 2, generator=generator), torch.randn(2, TOKENS // 2, generator=generator)
    if split:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
        weight, bias = (distribute_tensor(t, mesh, [Shard(0)]) for t in (weight, bias))
    weight.requires_grad_()
    bias.requires_grad_()
    request = TokenRequest(targets, 4, entropy=not summed, temperature=None if summed else temperature, summed=summed)
    out = _chunked(hidden, weight, bias, request, AfterHead(scale=0.7, softcap=5.0))
    if summed:
        out.backward()
    else:
        torch.autograd.backward([out, request.entropies], [upstream[0], upstream[1]])
    whole = [t.full_tensor() if split else t for t in (weight.grad, bias.grad)]
    answer = {"out": out.detach(), "hidden_grad": hidden.grad, "weight_grad": whole[0], "bias_grad": whole[1]}
    if request.entropies is not None:
        answer["entropies"] = request.entropies.detach()
    return answer


def main() -> None:
    differences = {}
    for summed in (False, True):
        split, whole = head_outputs(True, summed), head_outputs(False, summed)
        for key in whole:
            differences[f"{key}{' summed' if summed else ''}"] = (split[key] - whole[key]).abs().max().item()
    if dist.get_rank() == 0:
        torch.save(differences, sys.argv[1])
    dist.barrier()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    try:
        main()
    finally:
        shutdown()
