"""Identifiers in generated code, made from human names: one rule for every backend.

A node's human name (`blocks.0.attn.proj`, `4`, an ONNX node name, a hostile module path) becomes
an identifier of the generated file by `identifier`:

  * each dotted part keeps `[A-Za-z0-9_]` only (any other run becomes one `_`, and no `__`
    survives), and the parts are joined with `_`: `blocks.0.add` -> `blocks_0_add`;
  * a name longer than `MAX_LENGTH` drops its leading parts (the last parts say most; an index
    stays with the part before it: `layers.11`), and a single part still too long is cut;
  * a name starting with a digit is prefixed by its op or layer kind: `linear_0`, not `_0`;
  * a name the target language or the generated file reserves gets a trailing `_`.

`Identifiers.fresh` then makes it unique in one scope (`_1`, `_2`, ... in order of requests, so
names are stable for a given graph). The result is always plain ASCII.
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

MAX_LENGTH = 56  # keeps `layers_31_self_attn_scaled_dot_product_attention` whole

_NOT_WORD = re.compile(r"[^0-9A-Za-z]+")


def _word(text: str) -> str:
    return _NOT_WORD.sub("_", text).strip("_")


def _nothing_reserved(name: str) -> bool:
    return False


def identifier(raw: object, prefix: str = "v",
               reserved: Callable[[str], bool] = _nothing_reserved) -> str:
    """A valid identifier for `raw` (not yet unique); `prefix` (an op such as `linear` or
    `aten.add`: its last part counts) leads a name that would start with a digit and names an
    empty one."""
    parts: list[str] = []  # `layers.11` stays one part
    for word in (_word(p) for p in str(raw).split(".")):
        if word and parts and word[0].isdigit():
            parts[-1] = f"{parts[-1]}_{word}"
        elif word:
            parts.append(word)
    while len(parts) > 1 and len("_".join(parts)) > MAX_LENGTH:
        parts.pop(0)
    name = "_".join(parts)[:MAX_LENGTH].rstrip("_")
    lead = _word(re.split(r"[.:]", str(prefix))[-1])
    lead = lead if lead and not lead[0].isdigit() else "v"
    if not name or name[0].isdigit():
        name = f"{lead}_{name}" if name else lead
    return f"{name}_" if reserved(name) else name


class Identifiers:
    """Hands out unique identifiers within one scope (a function body, a class's attributes,
    the processes of an HLS stage)."""

    def __init__(self, taken: Iterable[str] = (),
                 reserved: Callable[[str], bool] = _nothing_reserved) -> None:
        self.taken: set[str] = set(taken)
        self.reserved = reserved

    def fresh(self, raw: object, prefix: str = "v", also: Iterable[str] = ()) -> str:
        """A new identifier for `raw`; `also` lists suffixes whose names (`<name><suffix>`) the
        caller derives from it, which must be free too and are taken with it."""
        suffixes = tuple(also)
        base = identifier(raw, prefix, self.reserved)
        name, k = base, 1
        while (name in self.taken or any(name + s in self.taken for s in suffixes)
               or self.reserved(name)):
            name = f"{base.rstrip('_')}_{k}"  # `input_` (input is a builtin) -> input_1
            k += 1
        self.taken.update([name, *(name + s for s in suffixes)])
        return name
