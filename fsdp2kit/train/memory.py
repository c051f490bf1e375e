"""Measured memory of training steps: the CUDA allocator's peak, and with `training.track_memory` the live tensor
bytes by category (torch's FSDPMemTracker, a dispatch mode that sees every allocation), which is what `fsdp2kit plan`
predicts and the only honest figure on CPU, where the process's RSS also counts the Python runtime and libraries."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker


def category_name(tracker_key: object) -> str:
    """FSDPMemTracker's categories ('Sharded Param', 'OptState', ...) as metric keys ('sharded_param', ...)."""
    return str(getattr(tracker_key, "value", tracker_key)).lower().replace(" ", "_")


def tracker_peak(tracker: FSDPMemTracker, device: torch.device) -> dict[str, int]:
    """The tracker's peak snapshot on `device`: bytes per category at the moment of the peak, and 'total'."""
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    return {category_name(key): int(value) for key, value in snapshot.items() if value}


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepMemory:
    """Wraps each optimizer step. Peaks are over the whole run so far, like CUDA's max_memory_allocated."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, track: bool):
        self.device = device
        self.tracker = FSDPMemTracker(model, optimizer) if track else None
        self.peak: dict[str, int] = {}

    @contextmanager
    def step(self, micro_batches: list[dict[str, torch.Tensor]]) -> Iterator[None]:
        if self.tracker is None:
            yield
            return
        self.tracker.track_inputs(tuple(micro_batches))
        with self.tracker:
            yield
        step_peak = tracker_peak(self.tracker, self.device)
        if step_peak.get("total", 0) > self.peak.get("total", 0):
            self.peak = step_peak

    def micro_batch_done(self) -> None:
        """The tracker keeps per-module stats of one forward/backward; clear them before the next micro-batch."""
        if self.tracker is not None:
            self.tracker.reset_mod_stats()

    def fields(self) -> dict[str, object]:
        """peak_mem_bytes (the allocator's peak on CUDA, the tracked live tensors on CPU, else the peak RSS), its
        kind, the tracked categories at the peak, and on CPU the peak RSS as its own field."""
        out: dict[str, object] = {}
        if self.device.type == "cuda":
            out["peak_mem_bytes"] = torch.cuda.max_memory_allocated(self.device)
            out["peak_mem_kind"] = "cuda_max_allocated"
        elif self.tracker is not None:
            out["peak_mem_bytes"] = self.peak.get("total", 0)
            out["peak_mem_kind"] = "cpu_live_tensors"
        else:
            out["peak_mem_bytes"] = peak_rss_bytes()
            out["peak_mem_kind"] = "cpu_max_rss"
        if self.tracker is not None:
            out["peak_mem_categories"] = {k: v for k, v in self.peak.items() if k != "total"}
        if self.device.type == "cpu":
            out["peak_rss_bytes"] = peak_rss_bytes()
        return out
