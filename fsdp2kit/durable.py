"""Writes that survive a power cut: the token store and checkpoints commit by rename, which is only durable once the
renamed files and their directory are on disk."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    with path.open("rb") as handle:
        os.fsync(handle.fileno())


def write_durable(path: Path, payload: bytes) -> None:
    """Write `payload` to `path` and flush it to disk before returning."""
    with path.open("wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())


# A write that fails with less than this left on its filesystem ran out of space, whatever it raised.
LOW_SPACE_BYTES = 1 << 20


def free_bytes(path: Path) -> int:
    """Bytes available to this user on the filesystem that holds `path` (or its nearest existing parent)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _enospc_in(exc: BaseException | None, depth: int = 0) -> bool:
    if exc is None or depth > 20:
        return False
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return True
    failures = getattr(exc, "failures", None)  # DCP's CheckpointException: each rank's exception
    if isinstance(failures, dict) and any(_enospc_in(f[0], depth + 1) for f in failures.values()):
        return True
    return _enospc_in(exc.__cause__, depth + 1) or _enospc_in(exc.__context__, depth + 1)


def ran_out_of_space(path: Path, exc: BaseException | None) -> bool:
    """Whether a failed write under `path` ran out of space, told by what the disk says: ENOSPC anywhere in the
    exception, or a filesystem now (before the partial output is removed) under LOW_SPACE_BYTES free — torch's zip
    writer reports a full disk as 'unexpected pos', without an errno."""
    return _enospc_in(exc) or free_bytes(path) < LOW_SPACE_BYTES


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path` (0 when there is none), counted while another process may be removing it
    (a partial checkpoint after a failed save): a file gone before it is counted counts 0."""
    total = 0
    for folder, _, files in os.walk(path):  # os.walk passes over a folder that is gone
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(folder, name)).st_size
    return total


def disk_full_message(path: Path, what: str, needed_bytes: int, intact: str) -> str:
    """One sentence: what could not be written where, the space it needs and has, and what is intact."""
    needed, free = distinct_sizes(needed_bytes, free_bytes(path))
    return f"no space left on device: {what} in '{path}' needs about {needed} and its disk has {free} free; {intact}"


def distinct_sizes(first: int, second: int) -> tuple[str, str]:
    """Two byte counts in MiB with as many decimals as tell them apart (in bytes where three do not): "needs 1.4 MiB
    and has 1.4 MiB free" reads as if the write should have fit."""
    for digits in (1, 2, 3):
        shown = f"{first / 2**20:.{digits}f} MiB", f"{second / 2**20:.{digits}f} MiB"
        if shown[0] != shown[1] or first == second:
            return shown
    return f"{first:,} bytes", f"{second:,} bytes"


def as_the_umask_allows(path: Path) -> None:
    """Give a file the mode a plain `open` would (0666 less the umask): safetensors writes 0600, which leaves an
    exported model unreadable to the other users of a shared machine, a serving engine's user among them."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
