"""Errors a user can act on.

Every error that reaches the CLI is a `PipeccError`: its message is one line that names the
problem and, where there is one, the fix. The CLI prints it as `pipecc: error: <message>` and
exits 1; `UsageError` exits 2. Anything else is a bug and shows a traceback.
Names in messages come from users' files: `printable` escapes what a terminal would obey.
"""


class PipeccError(Exception):
    """A problem with the user's input or environment, reported in one line."""

    exit_code = 1


class UsageError(PipeccError):
    """A malformed command line (bad flag value, conflicting options)."""

    exit_code = 2


class CaptureError(PipeccError):
    """Neither torch.fx nor torch.export could capture the model."""


# Control characters in names (an ONNX node called 'relu\x1b[2J') must not reach a terminal raw:
# human-readable output escapes them (`pipecc.report.formatting.terminal_text` for text blocks).
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(ch: str) -> str:
    if ch in _NAMED:
        return _NAMED[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: object) -> str:
    """`text` on one line with every non-printable character escaped as Python writes it:
    C0 and C1 controls (`\\r`, `\\x1b`, `\\x9b`, ...), DEL, line and paragraph separators,
    format characters such as bidi overrides (`\\u202e`), unassigned code points."""
    s = str(text)
    if s.isprintable():
        return s
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in s)
