"""The exceptions the command line reports as one message, never a traceback: a user's mistake (exit code 2) and a
diverged run (exit code 1), and the wording of an unknown key that both the native loader and the dialects use."""

from __future__ import annotations

import difflib
import json
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ERROR_DIR_ENV = "FSDP2KIT_ERROR_DIR"  # set by the --nproc launcher: ranks write their report there, it prints one


class UserError(Exception):
    """A mistake in the config, the command line or the user's files (exit code 2)."""


class TrainingDiverged(Exception):
    """The loss or gradients stayed non-finite: the run stops with exit code 1 and one message, not a traceback."""


class RunFault(Exception):
    """A fault the user did not cause (a full disk, out of memory): one sentence saying what happened and what is
    intact, exit code 1."""


class Interrupted(Exception):
    """SIGINT or SIGTERM stopped the run between steps: one message, exit code 128 + the signal's number."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


# An interrupt raised by a signal handler where it cannot propagate (inside a finaliser or weakref callback, whose
# exceptions Python prints and drops), kept so that the work raises it again at its next boundary.
PENDING_INTERRUPTS: list[Interrupted] = []


def raise_pending_interrupt() -> None:
    """Raise the interrupt a signal handler raised, if any: called at the boundaries of long work (a range of rows)."""
    if PENDING_INTERRUPTS:
        raise PENDING_INTERRUPTS[0]


def unknown_key_message(
    file: str, key: str, leaf: str, valid: list[str], spell: Callable[[str], str], listed: list[str] | None = None
) -> str:
    """ "{file}: unknown key '{key}'" with the valid key closest to `leaf` (its last part), spelled as the user would
    write it by `spell`, or where none is close the keys valid there (`listed`, default `valid`)."""
    close = difflib.get_close_matches(leaf, valid, n=1, cutoff=0.6)
    if close:
        return f"{file}: unknown key '{key}' (did you mean '{spell(close[0])}'?)"
    return f"{file}: unknown key '{key}'; valid keys here: {', '.join(sorted(listed or valid))}"


def why_not_a_file(path: str | Path) -> str:
    """Why a path a user gave as a file cannot be read as one, in words: "does not exist" would be wrong for a
    folder or a device such as /dev/zero."""
    path = Path(path)
    if path.is_dir():
        return "is a folder, not a file"
    if path.exists():
        return "is not a regular file (a device, pipe or socket)"
    return "does not exist"


class QuietAfterStop:
    """The command line's own process's stop signals where the work's handlers are not installed. Before the work
    (and between its parts) a signal ends the process at once (`stop_at_once`). After the one that stopped the work,
    once the work has unwound, the signals are ignored until the process exits (`restore`); an in-process caller
    (pytest, an RL framework driving `Strategy`) gets its own handlers back instead. There a second Ctrl-C (or the
    process group's) would otherwise raise KeyboardInterrupt into the one-line error report, a finaliser or the
    interpreter's exit: a traceback after the line."""

    def __init__(self) -> None:
        self.for_this_process = False  # set once by the command line's entry point, never by an in-process caller
        self.signum = 0  # the signal that stopped the work, 0 for none yet
        self.left_by_stop: Callable[[], str] = lambda: "nothing was written"  # what a stop at once leaves, in words

    def stop_at_once(self, signum: int, frame: object) -> None:
        """The command line's SIGINT (and SIGTERM) handler outside the work's own (torch importing, a model
        loading, the process group ending): nothing is being written there, so the process ends at once with one
        line. Raised as KeyboardInterrupt it would land anywhere: a traceback, a library's error in its place, or a
        half-imported torch that crashes the interpreter's exit; SIGTERM's default ended it without a word."""
        self.signum = signum
        message = f"interrupted by {signal.Signals(signum).name}; {self.left_by_stop()}"
        os._exit(report_error(message, 128 + signum))

    def restore(self, previous: dict[signal.Signals, Any]) -> None:
        """Put back the handlers the work replaced, or ignore the signals if this process's work was stopped."""
        quiet = self.for_this_process and self.signum
        for signum, handler in previous.items():
            signal.signal(signum, signal.SIG_IGN if quiet else handler)


PROCESS_STOP = QuietAfterStop()


def report_error(message: str, exit_code: int) -> int:
    """Tell the user one `error:` line: a rank under the --nproc launcher leaves it in the launcher's error folder
    (the launcher prints the first one written); otherwise rank 0 prints it. Returns `exit_code`."""
    error_dir = os.environ.get(ERROR_DIR_ENV)
    rank = os.environ.get("RANK", "0")
    if error_dir and Path(error_dir).is_dir():
        (Path(error_dir) / f"rank{rank}.json").write_text(json.dumps({"message": message, "exit_code": exit_code}))
    elif rank == "0" or "WORLD_SIZE" not in os.environ:
        print(f"error: {message}", file=sys.stderr, flush=True)
    return exit_code
