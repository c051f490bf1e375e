"""Adapters that let RL frameworks drive `fsdp2kit.Strategy` through their own back-end interfaces: verl's engine
(`integrations/verl.py`) and ROLL's strategy (`integrations/roll.py`). They only translate calls and batch layouts;
every computation is the Strategy's. Neither imports its framework: each is imported by the framework's user."""

import torch

from fsdp2kit.distributed import share_one_heap

# A framework's worker imports its adapter before it starts its process group (verl's TrainingWorker, ROLL's Worker),
# and `Strategy` comes after: one heap per CPU rank is set here, while gloo's threads have not yet allocated (verl's
# worker at 2 ranks: 2 heaps a rank, 3 without it, 8 on verl's own side; the 2-rank peak with the setting at process
# start, 4 launches each: 1127 -> 1092 MiB; docs/PERFORMANCE.md). A CUDA build is left alone: asking it for a device
# here would start CUDA before the framework forks its workers.
if not torch.backends.cuda.is_built():
    share_one_heap()
