"""The one exception type for a user's mistake: it exits with code 2 and prints one message, never a traceback."""


class UserError(Exception):
    """A mistake in the config, the command line or the user's files (exit code 2)."""
