"""The exceptions the command line reports as one message, never a traceback: a user's mistake (exit code 2) and a
diverged run (exit code 1)."""


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
