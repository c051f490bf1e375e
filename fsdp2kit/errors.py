"""The exceptions the command line reports as one message, never a traceback: a user's mistake (exit code 2) and a
diverged run (exit code 1)."""


class UserError(Exception):
    """A mistake in the config, the command line or the user's files (exit code 2)."""


class TrainingDiverged(Exception):
    """The loss or gradients stayed non-finite: the run stops with exit code 1 and one message, not a traceback."""
