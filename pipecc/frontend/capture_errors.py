"""One line for a model neither torch.fx nor torch.export can capture: the construct and the way out.

Both capture routes build one graph that must hold for every input, so Python control flow
that depends on a tensor's *values* stops them: `if x.sum() > 0:`, `while loss > eps:`,
`for box in boxes:` over a tensor of data-dependent length, `len(detections)`. torch.fx says so
from inside its `Proxy` (`symbolically traced variables cannot be used as inputs to control
flow`, or a paragraph on iteration), torch.export with a page about guards and symbols. Neither
says where. The traceback of fx's error does: the last frame outside torch and pipecc is the
model's line, and the `Proxy` method it entered names the construct (`__bool__`: a branch,
`__iter__`: a loop, `__len__`: `len()`). `explain` turns that into

    forward branches on a tensor's value at model.py:12 (`if h.sum() > 0:`) ...; compute both
    branches and select with torch.where(cond, a, b), or ...

(one line), or None when the traceback names no such construct (the caller then reports both
routes' first lines).
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch

_TORCH = str(Path(torch.__file__).resolve().parent)
_PIPECC = str(Path(__file__).resolve().parents[1])

# Proxy method entered -> (what the model does, the way out)
_CONSTRUCTS = {
    "__bool__": ("branches on a tensor's value",
                 "compute both branches and select with torch.where(cond, a, b), or decide outside "
                 "forward (a build_model argument)"),
    "__iter__": ("iterates over a tensor",
                 "give the loop a length fixed when the model is built, and keep sizes independent "
                 "of tensor values (torch.where or x * mask instead of x[mask] or nonzero())"),
    "__len__": ("takes len() of a tensor",
                "keep sizes independent of tensor values (torch.where or x * mask instead of "
                "x[mask] or nonzero()), or use a length fixed when the model is built"),
    "keys": ("unpacks a tensor with **", "pass the tensor as one argument"),
}


def _ours(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_TORCH + os.sep) or path.startswith(_PIPECC + os.sep)


def explain(fx_exc: BaseException, export_why: str) -> str | None:
    """The one-line message (module docstring) for fx's error, or None."""
    frames = traceback.extract_tb(fx_exc.__traceback__)
    user = [i for i, f in enumerate(frames) if not _ours(f.filename)]
    if not user or user[-1] + 1 >= len(frames):
        return None
    at, entered = frames[user[-1]], frames[user[-1] + 1].name
    if entered not in _CONSTRUCTS:
        return None
    what, fix = _CONSTRUCTS[entered]
    code = f" (`{at.line.strip()}`)" if at.line else ""
    return (f"could not capture the model: {at.name} {what} at {Path(at.filename).name}:{at.lineno}{code}, "
            f"which torch.fx cannot trace and torch.export cannot capture either ({export_why}): a "
            f"pipeline needs one graph for every input; {fix}")
