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


def _fx_construct(fx_exc: BaseException) -> tuple[traceback.FrameSummary, str] | None:
    """The model's frame of fx's error and the Proxy method it entered, when _CONSTRUCTS has it."""
    frames = traceback.extract_tb(fx_exc.__traceback__)
    user = [i for i, f in enumerate(frames) if not _ours(f.filename)]
    if not user or user[-1] + 1 >= len(frames):
        return None
    at, entered = frames[user[-1]], frames[user[-1] + 1].name
    return (at, entered) if entered in _CONSTRUCTS else None


def fx_site(fx_exc: BaseException) -> traceback.FrameSummary | None:
    """The model's line where fx's error says it branched or looped on a tensor, or None."""
    found = _fx_construct(fx_exc)
    return found[0] if found else None


def explain(fx_exc: BaseException, export_why: str) -> str | None:
    """The one-line message (module docstring) for fx's error, or None."""
    found = _fx_construct(fx_exc)
    if found is None:
        return None
    at, entered = found
    what, fix = _CONSTRUCTS[entered]
    code = f" (`{at.line.strip()}`)" if at.line else ""
    return (f"could not capture the model: {at.name} {what} at {Path(at.filename).name}:{at.lineno}{code}, "
            f"which torch.fx cannot trace and torch.export cannot capture either ({export_why}): a "
            f"pipeline needs one graph for every input; {fix}")


# ----------------------------------------------------------------------------- what forward did
# `torch_capture._check_forward` runs forward once before the capture, under fake tensors and
# `Watch`, which notes two things the capture routes' errors do not say: a returned object that
# is no tensor (transformers' DynamicCache, with use_cache=True), and torch random draws made in
# Python code (layerdrop: `if torch.rand([]) < p: skip`). When both routes then fail with a
# message that names nothing, `refine` names the construct from them.
_RANDOM = {"rand", "randn", "randint", "rand_like", "randn_like", "randint_like", "bernoulli",
           "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "randperm"}
_PLAIN = (torch.Tensor, type(None), bool, int, float, complex, str, torch.dtype, torch.device, torch.Size)


class Watch(torch.overrides.TorchFunctionMode):
    """Records where forward's Python code draws torch random numbers (file, function, line)."""

    def __init__(self) -> None:
        super().__init__()
        self.draws: list[tuple[str, traceback.FrameSummary]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        name = getattr(func, "__name__", "")
        if name in _RANDOM and len(self.draws) < 16:
            user = [f for f in traceback.extract_stack()[:-1] if not _ours(f.filename)]
            if user:
                self.draws.append((name, user[-1]))
        return func(*args, **(kwargs or {}))


def foreign_output(value: object, where: str = "its output") -> str | None:
    """`a DynamicCache (transformers.cache_utils) in its output's past_key_values` for the first
    object in a returned value that is neither a tensor, a plain constant nor a container."""
    if isinstance(value, _PLAIN):
        return None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (tuple, list)):
        items = list(enumerate(value))
    else:
        cls = type(value)
        return f"a {cls.__name__} ({cls.__module__}) in {where}"
    for key, item in items:
        found = foreign_output(item, f"{where}'s {key}" if isinstance(key, str) else f"{where}[{key}]")
        if found:
            return found
    return None


def output_refusal(found: str) -> str:
    """The line for a forward that returns a non-tensor object (`foreign_output`)."""
    fix = ("pass use_cache=False (config.use_cache=False) or return tensors only" if "Cache" in found
           else "return tensors (or tuples, lists and dicts of them) only")
    return (f"could not capture the model: forward returns {found}, which a pipeline cannot send "
            f"between stages; {fix}")


def data_dependent_site(exc: BaseException) -> traceback.FrameSummary | None:
    """The model's line where torch.export met a value-dependent branch (the last frame outside
    torch and pipecc of a GuardOnDataDependentSymNode's traceback, causes included)."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, GuardOnDataDependentSymNode):
        seen = seen.__cause__ or seen.__context__
    if seen is None:
        return None
    user = [f for f in traceback.extract_tb(seen.__traceback__) if not _ours(f.filename)]
    return user[-1] if user else None


def random_branch_refusal(site: traceback.FrameSummary,
                          draws: list[tuple[str, traceback.FrameSummary]]) -> str | None:
    """The line for a branch on a torch random draw made in the same function, or None."""
    same = [(n, f) for n, f in draws if f.filename == site.filename and f.name == site.name]
    if not same:
        return None
    name, at = same[-1]
    code = f" (`{site.line.strip()}`)" if site.line else ""
    return (f"could not capture the model: {site.name} branches in Python on a random draw "
            f"(torch.{name} at {Path(at.filename).name}:{at.lineno}, read at "
            f"{Path(site.filename).name}:{site.lineno}{code}), which no graph can hold: a pipeline "
            "needs one graph for every step; turn the random skip off (e.g. config.layerdrop=0.0 for "
            "Hugging Face models) or put the model in eval mode, or apply the draw in tensors "
            "(torch.where or x * mask)")
