"""Safe text for generated code: identifiers, string literals and comments from untrusted names.

Names reach the torch backend from module paths (`nn.Module.add_module` accepts any string
without a dot), ONNX files and hand-built graphs, so they may hold quotes, newlines or whole
statements. The rule for generated code: an untrusted name becomes

  * an identifier only through `Identifiers.fresh` (the rule of `pipecc.backends.names`: keeps
    `[A-Za-z0-9_]` and nothing else, `blocks.0.add` -> `blocks_0_add`, `0` -> `linear_0`);
  * a string literal only through `literal` (Python's own `ascii()` of the string);
  * comment or docstring text only through `text`, which escapes every non-printable or
    non-ASCII character, backslash and double quote, so it can end neither a comment line
    nor a docstring.

Nothing else of a name is ever interpolated into code.
"""

from __future__ import annotations

import builtins
import keyword

from pipecc.backends import names as _shared

# Names the generated module itself uses; a local or attribute must never shadow them.
RESERVED = frozenset({"torch", "F", "self", "math", "operator", "onnx_ops", "super", "PARAM_NAMES",
                      "model_function",
                      "PARAM_ALIASES", "SHARDS"})


def reserved(name: str) -> bool:
    """A keyword, a builtin or a name of the generated module: not for a local or attribute."""
    return (keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in RESERVED
            or hasattr(builtins, name))


class Identifiers(_shared.Identifiers):
    """`pipecc.backends.names.Identifiers` with Python's reserved names (see `reserved`)."""

    def __init__(self, taken: set[str] | None = None) -> None:
        super().__init__(taken or (), reserved)


def is_plain_identifier(name: object) -> bool:
    """True when `name` can appear verbatim as an attribute or keyword name."""
    return (isinstance(name, str) and name.isidentifier() and name.isascii()
            and not keyword.iskeyword(name))


def literal(value: str) -> str:
    """A Python string literal that evaluates to `value` (ASCII-only source)."""
    return ascii(str(value))


def text(value: object) -> str:
    """`value` as printable ASCII for a comment or a docstring: no newline, quote or raw backslash.

    `\\`, control and non-ASCII characters become escapes (`\\n`, `\\x00`, `\\u2028`); a double
    quote becomes `\\x22`, so in a (non-raw) docstring the text reads back as the original.
    """
    escaped = str(value).encode("unicode_escape").decode("ascii")
    return escaped.replace('"', "\\x22")
