"""`training.profile_steps: [first, last]`: a torch.profiler trace of those optimizer steps (1-based, inclusive), one
Chrome trace JSON per rank in output_dir/profile/ (open it in https://ui.perfetto.dev or chrome://tracing)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity


class StepProfiler:
    def __init__(self, steps: list[int] | None, output_dir: Path, rank: int, device: torch.device):
        self.steps = steps
        self.path = output_dir / "profile" / (f"rank{rank}_steps{steps[0]}-{steps[1]}.json" if steps else "")
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler: torch.profiler.profile | None = None

    def step_started(self, step: int) -> None:
        if self.steps and step == self.steps[0]:
            self.profiler = torch.profiler.profile(activities=self.activities, record_shapes=True)
            self.profiler.start()

    def step_finished(self, step: int) -> None:
        if self.steps and step == self.steps[1]:
            self.stop()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Write the trace also when the run ends before the last profiled step."""
        self.stop()

    def stop(self) -> None:
        if self.profiler is not None:
            self.profiler.stop()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))
            self.profiler = None
