"""Which checkpoints of a run are complete, read without torch: the command line says what an interrupt left even
while torch is still importing."""

from __future__ import annotations

from pathlib import Path

CHECKPOINTS = "checkpoints"  # the folder under a run's output_dir that holds its checkpoints
STATE_FILE = "trainer_state.json"  # written last into a checkpoint's temporary folder, before the rename commits it


def committed_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name[5:]))
