"""One rank of tests/test_real_configs.py's trainings of real expert-parallel config files, launched as `python
tests/real_configs_worker.py RUNS.json` under torchrun: each run (a config file, its `--set` items and whether the
model folder's code may run) is loaded as `fsdp2kit train` loads it and trained by the `train` command's Trainer, one
after the other in this process, so the files share one launch. Rank 0 writes, per run, the experts that trained split
over an `ep` mesh dimension, with that mesh, to OUTPUT_DIR/experts.json, and the run's mesh layout (its data, context
and Ulysses sizes) to OUTPUT_DIR/layout.json. A run may name a strategy file (`--fsdp-config`) beside its config."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from torch.distributed.tensor import DTensor

from fsdp2kit.config.load import load_config
from fsdp2kit.distributed import init_distributed, shutdown
from fsdp2kit.train.interrupt import StopSignals
from fsdp2kit.train.run_dir import OutputDirLock
from fsdp2kit.trainer import Trainer


def split_experts(model) -> dict[str, dict[str, list]]:
    """The parameters held as DTensors over a mesh with an `ep` dimension: their mesh's names and shape."""
    return {
        name: {"mesh": list(p.device_mesh.mesh_dim_names), "shape": list(p.device_mesh.shape)}
        for name, p in model.named_parameters()
        if isinstance(p, DTensor) and "ep" in (p.device_mesh.mesh_dim_names or ())
    }


def main(runs_file: str) -> None:
    runtime = None
    for run in json.loads(Path(runs_file).read_text()):
        cfg = load_config(
            run["config"],
            run["set"],
            strategy_file=run.get("strategy_file"),
            trust_remote_code=run["trust_remote_code"],
        )
        runtime = runtime or init_distributed(cfg.device_mapping)
        output_dir = Path(cfg.training.output_dir)
        with OutputDirLock(output_dir, runtime.is_main), StopSignals() as stop:
            trainer = Trainer(cfg, runtime, stop)
            trainer.run()
        if runtime.is_main:
            (output_dir / "experts.json").write_text(json.dumps(split_experts(trainer.strategy.model)))
            layout = dataclasses.asdict(trainer.strategy.sharded.layout)
            (output_dir / "layout.json").write_text(json.dumps(layout))
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
