"""Python attributes that forward reads, which the captured graph keeps as constants.

`x * self.scale` with `self.scale = 2.0` is captured as `x * 2.0`: the graph has no way to
read the attribute again, so setting `model.scale = 3.0` after compiling changes the model but
not its pipeline. Nothing is wrong at compile time, but the user should know what was frozen,
so the capture watches forward (`watch`) and says which plain attributes (numbers, bools,
strings) of the model's own modules it read (`note`).

Only modules of the user's own classes are watched: torch.nn's and the model libraries'
(transformers, torchvision, timm) attributes are hyperparameters set at construction
(`in_features`, `num_heads`), which nobody changes on a built model; `training` and private
names (`_x`) are not reported either (the train flag is followed per mode:
`pipecc.frontend.modes`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from torch import nn

_LIBRARIES = ("torch", "transformers", "torchvision", "timm")
_PLAIN = (bool, int, float, str)


def _library(cls: type) -> bool:
    return str(getattr(cls, "__module__", "")).split(".")[0] in _LIBRARIES


@contextlib.contextmanager
def watch(model: nn.Module) -> Iterator[dict[str, Any]]:
    """While in the block, record `path.attr -> value` for every plain instance attribute of
    the model's own modules that is read (each module's class is swapped for a subclass that
    records reads, and swapped back after)."""
    reads: dict[str, Any] = {}
    swapped: list[tuple[nn.Module, type]] = []
    for path, module in model.named_modules():
        cls = type(module)
        if _library(cls):
            continue
        try:
            module.__class__ = _recording(cls, path, reads)
        except TypeError:  # __slots__, a C class: not watched
            continue
        swapped.append((module, cls))
    try:
        yield reads
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _recording(cls: type, path: str, reads: dict[str, Any]) -> type:
    def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807 - the hook itself
        value = cls.__getattribute__(self, name)
        if not name.startswith("_") and name != "training" and isinstance(value, _PLAIN) \
                and name in object.__getattribute__(self, "__dict__"):
            reads.setdefault(f"{path}.{name}" if path else name, value)
        return value

    return type(cls.__name__, (cls,), {"__getattribute__": __getattribute__,
                                       "__module__": cls.__module__, "__qualname__": cls.__qualname__})


NOTE_PREFIX = "note: forward reads the Python attribute"


def note(reads: dict[str, Any]) -> str | None:
    """One line naming the attributes read (the first three and how many more), or None."""
    if not reads:
        return None
    shown = [f"{name} (= {value!r})" for name, value in list(reads.items())[:3]]
    more = f" and {len(reads) - 3} more" if len(reads) > 3 else ""
    plural = "s" if len(reads) > 1 else ""
    return (f"{NOTE_PREFIX}{plural} {', '.join(shown)}{more}: the captured graph keeps "
            f"{'their values as constants' if plural else 'its value as a constant'}, so changing "
            f"{'them' if plural else 'it'} on the model later does not change the pipeline "
            f"(compile again after changing {'them' if plural else 'it'})")
