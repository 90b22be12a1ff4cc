"""Safe text for generated code: identifiers, string literals and comments from untrusted names.

Names reach the torch backend from module paths (`nn.Module.add_module` accepts any string
without a dot), ONNX files and hand-built graphs, so they may hold quotes, newlines or whole
statements. The rule for generated code: an untrusted name becomes

  * an identifier only through `Identifiers.fresh`, which keeps `[A-Za-z0-9_]` and nothing else;
  * a string literal only through `literal` (Python's own `ascii()` of the string);
  * comment or docstring text only through `text`, which escapes every non-printable or
    non-ASCII character, backslash and double quote, so it can end neither a comment line
    nor a docstring.

Nothing else of a name is ever interpolated into code.
"""

from __future__ import annotations

import builtins
import keyword
import re

_NOT_IDENT = re.compile(r"[^0-9A-Za-z_]+")
_UNDERSCORES = re.compile(r"__+")

# Names the generated module itself uses; a local or attribute must never shadow them.
RESERVED = frozenset({"torch", "F", "self", "math", "operator", "onnx_ops", "super", "PARAM_NAMES",
                      "PARAM_ALIASES", "SHARDS"})


def identifier(raw: str, default: str = "v") -> str:
    """A valid, non-keyword Python identifier derived from `raw` (not yet unique)."""
    name = _UNDERSCORES.sub("_", _NOT_IDENT.sub("_", str(raw))).strip("_") or default
    if name[0].isdigit():
        name = f"_{name}"
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in RESERVED:
        name = f"{name}_"
    if hasattr(builtins, name):
        name = f"{name}_"
    return name


def is_plain_identifier(name: object) -> bool:
    """True when `name` can appear verbatim as an attribute or keyword name."""
    return (isinstance(name, str) and name.isidentifier() and name.isascii()
            and not keyword.iskeyword(name))


class Identifiers:
    """Hands out unique identifiers within one scope (a function body or a class's attributes)."""

    def __init__(self, taken: set[str] | None = None) -> None:
        self.taken: set[str] = set(taken or ())

    def fresh(self, raw: str, default: str = "v") -> str:
        base = identifier(raw, default)
        name, k = base, 1
        while name in self.taken:
            name = f"{base}_{k}"
            k += 1
        self.taken.add(name)
        return name


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
