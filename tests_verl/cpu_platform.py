"""Test scaffolding: a CPU platform for verl, registered through verl's own extension point
(`verl.plugin.platform.PlatformRegistry`) and chosen with VERL_PLATFORM=cpu, so that verl's workers and engines
run on this machine's CPU over gloo. verl's FSDP engines are registered for cuda and npu only: VERL_ENGINE_DEVICE=cuda
(verl's own override, `EngineRegistry.get_engine_cls`) picks them, and fsdp2kit's, by that key."""

from __future__ import annotations

import os
import types
from contextlib import contextmanager
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

os.environ.setdefault("VERL_PLATFORM", "cpu")
os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")

# torch.cpu lacks the memory statistics verl logs after every step (perf/max_memory_*): they read 0 here.
CPU_MODULE = types.SimpleNamespace(**{name: getattr(torch.cpu, name) for name in dir(torch.cpu) if name[0] != "_"})
vars(CPU_MODULE).update(
    max_memory_allocated=lambda *args, **kwargs: 0,
    max_memory_reserved=lambda *args, **kwargs: 0,
    memory_allocated=lambda *args, **kwargs: 0,
    memory_reserved=lambda *args, **kwargs: 0,
    mem_get_info=lambda *args, **kwargs: (0, 0),
    get_device_name=lambda *args, **kwargs: "CPU",
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    reset_peak_memory_stats=lambda *args, **kwargs: None,
    empty_cache=lambda: None,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU: device "cpu", gloo, no device memory of its own."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> Any:
        return CPU_MODULE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> Any:
        """ "cpu": verl moves tensors with `.to(get_device_id())`, which the index 0 would send to an accelerator."""
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):  # type: ignore[override]
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
