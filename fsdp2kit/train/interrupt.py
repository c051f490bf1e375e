"""Ctrl-C and SIGTERM as a request to stop, not a crash: the signal is noted, every rank agrees at the next step
boundary, the checkpoint being written in the background is finished and published, and the run exits with one line
and code 130/143. A second signal abandons the write at once; the last complete checkpoint is still intact (a
partly written one is only ever a `.tmp-step_N` folder, removed by the next run)."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from fsdp2kit.errors import report_error

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Installed for the run (main thread only); `requested()` is a collective: every rank must call it."""

    def __init__(self) -> None:
        self.signum = 0
        self.previous: dict[int, Any] = {}
        # What a second signal abandons and what is intact, in words (the checkpoint manager knows, once it exists).
        self.abandon_message: Callable[[str], str] = lambda name: (
            f"{name} again: stopped at once; no checkpoint was being written"
        )

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum:  # the second one: do not wait for anything
            os._exit(report_error(self.abandon_message(signal.Signals(signum).name), 128 + signum))
        self.signum = signum

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
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
