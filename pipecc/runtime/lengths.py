"""Variable sequence lengths: the `--length` declarations of `pipecc compile` and `pipecc run`.

A folder compiled with a symbolic length (`--symbol S=0:1 --length S=16..64`) runs batches of
any length in the declared range without compiling again: the stage code reads the lengths off
its inputs (the captured graph's `size()` calls), and messages carry the shapes of the tensors
whose `shape_expr` names the symbol (`pipecc.runtime.messages`; `mark_dynamic` marks those dims in the ports a rank loads). This
module reads the two forms of the flag and checks a run's lengths against the folder's
declaration (pipecc.json's `lengths`):

  compile  `--length S=16..64`            every length from 16 to 64, equally likely
           `--length S=16,32,64`          these lengths, equally likely
           `--length S=16:0.5,32:0.3,64:0.2`  these lengths with these weights (normalised)
  run      `--length S=32`                every step at length 32
           `--length S=16,32,64`          step i at the (i mod 3)-th length (a mixed-length run)

A run builds its batch at length L by calling the model file's `example_inputs` and
`example_target` with `seq_len=L` (`LENGTH_ARG`; the zoo's GPT and the docs' convention), which
compile checks the file accepts. Imports `pipecc.errors` only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pipecc.errors import PipeccError, UsageError

__all__ = ["LENGTH_ARG", "Lengths", "mark_dynamic", "parse_declaration", "parse_run", "run_lengths"]

LENGTH_ARG = "seq_len"  # the keyword the input makers take the length as
RANGE_POINTS = 5  # a declared range LO..HI is tabled (and averaged) at this many evenly spaced lengths


@dataclass(frozen=True)
class Lengths:
    """A declared length distribution of the symbol `symbol`: `values` with `weights` (summing
    to 1); `span` is True for a range LO..HI (every length in it; `values` are its table points)."""

    symbol: str
    values: tuple[int, ...]
    weights: tuple[float, ...]
    span: bool = False

    @property
    def lo(self) -> int:
        return min(self.values)

    @property
    def hi(self) -> int:
        return max(self.values)

    def declared(self) -> str:
        """The declaration as `--length` spells it."""
        if self.span:
            return f"{self.symbol}={self.lo}..{self.hi}"
        if len(set(self.weights)) == 1:
            return f"{self.symbol}=" + ",".join(map(str, self.values))
        return f"{self.symbol}=" + ",".join(f"{v}:{w:g}" for v, w in zip(self.values, self.weights))

    def check(self, length: int, flag: str = "--length") -> None:
        """A PipeccError naming the bound when `length` is outside the declared range."""
        if length > self.hi:
            raise PipeccError(f"{flag} {self.symbol}={length} is above the maximum {self.hi} the folder was compiled "
                              f"for (--length {self.declared()}); run at {self.symbol} <= {self.hi} or compile again "
                              "with a larger maximum")
        if length < self.lo:
            raise PipeccError(f"{flag} {self.symbol}={length} is below the minimum {self.lo} the folder was compiled "
                              f"for (--length {self.declared()}); run at {self.symbol} >= {self.lo} or compile again "
                              "with a smaller minimum")

    def to_json(self) -> dict[str, Any]:
        return {"symbol": self.symbol, "values": list(self.values), "weights": list(self.weights),
                "range": self.span, "min": self.lo, "max": self.hi, "arg": LENGTH_ARG}

    @classmethod
    def from_json(cls, data: Any) -> Lengths | None:
        """pipecc.json's `lengths` (None when the folder has no declared length)."""
        if not data:
            return None
        try:
            values = tuple(int(v) for v in data["values"])
            weights = tuple(float(w) for w in data["weights"])
            symbol = str(data["symbol"])
            assert values and len(values) == len(weights) and symbol.isidentifier()
        except (KeyError, TypeError, ValueError, AssertionError):
            raise PipeccError("pipecc.json's lengths is not pipecc's; compile again") from None
        return cls(symbol, values, weights, bool(data.get("range")))


_COMPILE_FORMS = "S=LO..HI, S=16,32,64 or S=16:0.5,32:0.3,64:0.2"


def _split(item: str, forms: str) -> tuple[str, str]:
    name, sep, rest = item.partition("=")
    if not sep or not name.isidentifier() or not rest:
        raise UsageError(f"--length {item!r} is not NAME=LENGTHS (forms: {forms})")
    return name, rest


def _length(text: str, item: str, forms: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"--length {item!r}: {text!r} is not a whole number (forms: {forms})") from None
    if n < 1:
        raise UsageError(f"--length {item!r}: a length must be at least 1, got {n}")
    return n


def parse_declaration(item: str) -> Lengths:
    """`pipecc compile --length`: a range, a list, or a weighted list (module docstring)."""
    name, rest = _split(item, _COMPILE_FORMS)
    if ".." in rest:
        lo_text, _, hi_text = rest.partition("..")
        lo, hi = _length(lo_text, item, _COMPILE_FORMS), _length(hi_text, item, _COMPILE_FORMS)
        if lo > hi:
            raise UsageError(f"--length {item!r}: the range {lo}..{hi} is empty (give LO <= HI)")
        points = sorted({lo + round((hi - lo) * k / (RANGE_POINTS - 1)) for k in range(RANGE_POINTS)})
        return Lengths(name, tuple(points), tuple(1 / len(points) for _ in points), span=True)
    values, weights = [], []
    for part in rest.split(","):
        length, sep, weight = part.partition(":")
        values.append(_length(length, item, _COMPILE_FORMS))
        if sep:
            try:
                w = float(weight)
                assert w > 0 and w == w and w != float("inf")
            except (ValueError, AssertionError):
                raise UsageError(f"--length {item!r}: weight {weight!r} is not a positive number") from None
            weights.append(w)
    if weights and len(weights) != len(values):
        raise UsageError(f"--length {item!r}: give a weight to every length or to none")
    if len(set(values)) != len(values):
        raise UsageError(f"--length {item!r}: a length is listed twice")
    weights = weights or [1.0] * len(values)
    total = sum(weights)
    order = sorted(range(len(values)), key=values.__getitem__)
    return Lengths(name, tuple(values[i] for i in order), tuple(weights[i] / total for i in order))


def parse_run(item: str) -> tuple[str, list[int]]:
    """`pipecc run --length S=32` or `S=16,32,64`: the symbol and the lengths its steps cycle through."""
    forms = "S=32 or S=16,32,64"
    name, rest = _split(item, forms)
    return name, [_length(part, item, forms) for part in rest.split(",")]


def run_lengths(item: str | None, declared: Lengths | None) -> list[int]:
    """The lengths a run's steps cycle through ([] when the folder has no declared length and
    none is asked); errors name the flag or the bound."""
    if item is None:
        return []
    name, values = parse_run(item)
    if declared is None:
        raise UsageError(f"--length {item}: this folder was compiled without a declared length "
                         "(compile with --symbol S=INPUT:DIM --length S=LO..HI)")
    if name != declared.symbol:
        raise UsageError(f"--length {item}: the folder's length symbol is {declared.symbol}, not {name}")
    for v in values:
        declared.check(v)
    return values


def mark_dynamic(spec: dict[str, Any], symbol: str) -> dict[str, Any]:
    """A stage's ports.json with ``dynamic`` (the dims whose ``shape_expr`` names ``symbol``) on
    every tensor port, tuple items too: what ``pipecc.runtime.ports.Port`` reads to let those
    dims vary and to send their shapes ahead (a folder without ``lengths`` is never marked)."""
    word = re.compile(rf"\b{re.escape(symbol)}\b")

    def mark(port: dict[str, Any]) -> dict[str, Any]:
        port = dict(port)
        if port.get("kind") == "tuple":
            port["items"] = [mark(item) for item in port.get("items", ())]
        elif port.get("kind", "tensor") == "tensor":
            port["dynamic"] = [i for i, e in enumerate(port.get("shape_expr") or ()) if word.search(str(e))]
        return port

    return {**spec, **{key: [mark(p) for p in spec.get(key, ())] for key in ("receives", "sends")}}
