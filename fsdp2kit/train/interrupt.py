"""Ctrl-C, SIGTERM and SIGUSR1 (a scheduler's warning ahead of a time limit: Slurm's `--signal`) as a request to
stop, not a crash: the signal is noted, every rank agrees at the next step boundary, the trainer saves that step
(training.save_on_stop; else only the checkpoint being written in the background is finished and published), and the
run exits with one line and code 128 + the signal's number. A second signal abandons the write at once; the last
complete checkpoint is still intact (a partly written one is only ever a `.tmp-step_N` folder, removed by the next
run)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from fsdp2kit.errors import PENDING_INTERRUPTS, PROCESS_STOP, Interrupted, report_error

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """Installed for the run (main thread only); `requested()` is a collective: every rank must call it."""

    def __init__(self) -> None:
        self.signum = 0
        self.previous: dict[signal.Signals, Any] = {}
        # What a second signal abandons and what is intact, in words (the checkpoint manager knows, once it exists).
        self.abandon_message: Callable[[str], str] = lambda name: (
            f"{name} again: stopped at once; no checkpoint was being written"
        )

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # the second one: do not wait for anything
            os._exit(report_error(self.abandon_message(signal.Signals(signum).name), 128 + signum))
        self.signum = PROCESS_STOP.signum = signum

    def requested(self) -> int:
        """The signal any rank received (0 for none), the same on every rank."""
        flag = torch.tensor([self.signum])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def __enter__(self) -> StopSignals:
        if signal.getsignal(signal.SIGINT) is not None:  # None: not the main thread of the interpreter
            for signum in STOP_SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        PROCESS_STOP.restore(self.previous)


@contextmanager
def stopping_at_once(outcome: str) -> Iterator[None]:
    """For work with no step boundary to stop at (`prepare`, `convert`): the first stop signal raises
    `Interrupted` ("interrupted by SIGINT: `outcome`") where the main thread is, so the work unwinds (its partial
    files removed as on any error) and the command ends with one line; a second one during the unwinding exits at
    once. Raised inside a finaliser, the interrupt is not printed there but raised again at the work's next boundary
    (`raise_pending_interrupt`)."""
    if signal.getsignal(signal.SIGINT) is None:  # not the main thread of the interpreter
        yield
        return

    def again(signum: int, frame: object) -> None:
        os._exit(report_error(f"{signal.Signals(signum).name} again: stopped at once", 128 + signum))

    def first(signum: int, frame: object) -> None:
        for stop in STOP_SIGNALS:
            signal.signal(stop, again)
        PROCESS_STOP.signum = signum
        PENDING_INTERRUPTS.append(Interrupted(f"interrupted by {signal.Signals(signum).name}: {outcome}", signum))
        raise PENDING_INTERRUPTS[-1]

    def unraisable(info: Any) -> None:  # raised in a finaliser: still pending, raised again at the next boundary
        if not isinstance(info.exc_value, Interrupted):
            previous_hook(info)

    previous = {signum: signal.signal(signum, first) for signum in STOP_SIGNALS}
    previous_hook, sys.unraisablehook = sys.unraisablehook, unraisable
    try:
        yield
    finally:
        PENDING_INTERRUPTS.clear()
        sys.unraisablehook = previous_hook
        PROCESS_STOP.restore(previous)
