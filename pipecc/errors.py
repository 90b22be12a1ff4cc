"""Errors a user can act on.

Every error that reaches the CLI is a `PipeccError`: its message is one line that names the
problem and, where there is one, the fix. The CLI prints it as `pipecc: error: <message>` and
exits 1; `UsageError` exits 2. Anything else is a bug and shows a traceback.
"""


class PipeccError(Exception):
    """A problem with the user's input or environment, reported in one line."""

    exit_code = 1


class UsageError(PipeccError):
    """A malformed command line (bad flag value, conflicting options)."""

    exit_code = 2


class CaptureError(PipeccError):
    """Neither torch.fx nor torch.export could capture the model."""
