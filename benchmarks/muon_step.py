"""Muon's optimizer step under FSDP2 at N = 1, 2, 4 ranks: fsdp2kit's divided work (each matrix gathered to one owner
rank, orthogonalised there, its rows sent back: train/muon.py) against every rank gathering and orthogonalising every
matrix (MindSpeed-MM's FSDP2 Muon redistributes each matrix to Replicate on every rank).

The model is the matrices of a 14-layer Llama with hidden 512 and intermediate 1536 (48M parameters, 98 matrices),
fp32, each Linear its own fully_shard group, given seeded gradients; one step is timed (the barrier-to-barrier wall
time, slowest rank), with the CPU time each rank spends in torch's Newton-Schulz (its share of the work, whatever
else runs on the cores) and its transient peak: the largest live
tensor bytes during the step above those that stay after it (parameters, gradients, momentum buffers; torch's
MemTracker, a dispatch mode that sees every allocation).
Prints one JSON object. Run: .venv/bin/python benchmarks/muon_step.py [--world-sizes 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import child_env

REPO = Path(__file__).resolve().parent.parent
HIDDEN, INTERMEDIATE, LAYERS = 512, 1536, 14


def llama_matrices() -> Any:
    """The hidden matrices of the Llama shape above, as Linear modules (what Muon takes; no forward is run)."""
    import torch.nn as nn

    shapes = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, INTERMEDIATE)] * 2 + [(INTERMEDIATE, HIDDEN)]
    return nn.Sequential(*(nn.Linear(i, o, bias=False) for _ in range(LAYERS) for i, o in shapes))


def gathering_everywhere(base: type) -> type:
    """MindSpeed-MM's way as a MuonWithAdamW: every rank all-gathers every matrix's update, orthogonalises it and
    keeps its own rows."""
    import torch
    from torch.distributed.tensor import DTensor

    from fsdp2kit.train.muon import _local, orthogonalise, shard_group

    class GatherEverywhere(base):  # type: ignore[misc, valid-type]
        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            groups = {id(p): group for group in self.param_groups if group["muon"] for p in group["params"]}
            updates = self._momentum_updates(groups)
            for index, update in updates.items():
                param, group = self.matrices[index], groups[id(self.matrices[index])]
                whole = DTensor.from_local(
                    update, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                ).full_tensor()
                shards = shard_group(self.names[index], param)
                counts = shards.rows(param.shape[0])
                start = sum(counts[: shards.coordinate])
                rows = orthogonalise(whole, group)[start : start + counts[shards.coordinate]]
                self._apply(_local(param), rows.reshape(update.shape), group, param.shape)

    return GatherEverywhere


def worker(out: str, method: str) -> None:
    """One rank: shard the matrices, give seeded gradients, time one optimizer step; rank 0 writes every rank's
    figures to `out`."""
    import torch
    import torch.distributed as dist
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.optim import _muon

    from fsdp2kit.config.schema import TrainingConfig
    from fsdp2kit.train.muon import MuonWithAdamW

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = llama_matrices()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    generator = torch.Generator().manual_seed(1)
    for param in model.parameters():
        param.grad = distribute_tensor(torch.randn(param.shape, generator=generator), mesh, param.placements)
    optimizer_class = MuonWithAdamW if method == "divided" else gathering_everywhere(MuonWithAdamW)
    optimizer = optimizer_class(list(model.named_parameters()), None, TrainingConfig(optimizer="muon"))
    newton_schulz = [0.0]
    original = _muon._zeropower_via_newtonschulz

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()  # CPU time: the ranks share the machine's cores, wall time counts the waits
        result = original(*args, **kwargs)
        newton_schulz[0] += time.thread_time() - start
        return result

    _muon._zeropower_via_newtonschulz = timed
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    dist.barrier()
    start = time.perf_counter()
    with tracker:
        optimizer.step()
        after = tracker.get_tracker_snapshot("current")
    dist.barrier()
    seconds = time.perf_counter() - start
    device = torch.device("cpu")
    peak = tracker.get_tracker_snapshot("peak").get(device, {})
    held = after.get(device, {})  # parameters, gradients and the momentum buffers the step created
    total = next(key for key in peak if str(getattr(key, "value", key)).lower() == "total")
    mine = {"step_s": seconds, "newton_schulz_s": newton_schulz[0], "transient_peak_bytes": peak[total] - held[total]}
    ranks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(ranks))
    dist.destroy_process_group()


def measure(nproc: int, method: str, out: Path) -> dict[str, Any]:
    from fsdp2kit.distributed import free_port

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
    command += ["--master-port", str(free_port())]
    command += [str(Path(__file__).resolve()), "--worker", str(out), method]
    result = subprocess.run(command, cwd=REPO, env=child_env(), capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    ranks = json.loads(out.read_text())
    return {
        "step_s": round(max(r["step_s"] for r in ranks), 3),
        "newton_schulz_cpu_s_per_rank": [round(r["newton_schulz_s"], 3) for r in ranks],
        "transient_peak_mib": round(max(r["transient_peak_bytes"] for r in ranks) / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", nargs=2, metavar=("OUT", "METHOD"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    sys.path.insert(0, str(REPO))
    rows = []
    with tempfile.TemporaryDirectory(prefix="fsdp2kit-muon-") as workdir:
        for nproc in args.world_sizes:
            for method in ("divided", "gather_everywhere"):
                figures = measure(nproc, method, Path(workdir) / f"{method}_{nproc}.json")
                rows.append({"ranks": nproc, "method": method, **figures})
    params = LAYERS * (4 * HIDDEN * HIDDEN + 3 * HIDDEN * INTERMEDIATE)
    print(json.dumps({"model": {"parameters": params, "matrices": 7 * LAYERS, "dtype": "fp32"}, "rows": rows}))


if __name__ == "__main__":
    main()
