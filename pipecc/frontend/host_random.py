"""Random numbers drawn outside torch while the model is captured: refused, never frozen.

A capture runs forward once and keeps only torch operations; a value forward computes with
numpy or Python's `random` becomes a constant of the graph. For a random draw that is a silent
wrong answer: every step of the pipeline reuses the numbers of the capture (and their shapes,
so the example batch size is fixed too). Hugging Face's Wav2Vec2 does this in training mode:
SpecAugment (`_compute_mask_indices`, `config.mask_time_prob > 0`) draws its masks with
`np.random`. `watch()` notices such draws two ways: the global generators' states change (any
draw at all), and the module-level functions a model calls (`np.random.rand`, `random.random`,
...) are wrapped for the capture to record the first call site outside numpy, torch and pipecc,
so the refusal can name the line. Both generators are put back as they were.
"""

from __future__ import annotations

import contextlib
import os
import random
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

_TORCH = str(Path(torch.__file__).resolve().parent)
_PIPECC = str(Path(__file__).resolve().parents[1])
_NUMPY_FNS = ("rand", "randn", "randint", "random", "random_sample", "uniform", "normal", "choice",
              "permutation", "shuffle", "binomial", "poisson", "beta", "exponential")
_PY_FNS = ("random", "uniform", "randint", "randrange", "choice", "choices", "sample", "shuffle", "gauss")


class Draws:
    """What `watch` saw: the library drawn from ("numpy", "random") and the first call site."""

    def __init__(self) -> None:
        self.library: str | None = None
        self.site: traceback.FrameSummary | None = None
        self.function = ""

    def __bool__(self) -> bool:
        return self.library is not None

    def describe(self) -> str:
        """`numpy (np.random.rand) at file.py:12 (`line`) in fn`, or the library alone."""
        what = "numpy (np.random)" if self.library == "numpy" else "Python's random module"
        if self.function:
            what = f"numpy (np.random.{self.function})" if self.library == "numpy" else f"random.{self.function}"
        if self.site is None:
            return what
        code = f" (`{self.site.line.strip()}`)" if self.site.line else ""
        return f"{what} at {Path(self.site.filename).name}:{self.site.lineno}{code} in {self.site.name}"


def _foreign(filename: str, numpy_dir: str | None) -> bool:
    path = os.path.abspath(filename)
    ours = [_TORCH, _PIPECC, os.path.dirname(random.__file__)] + ([numpy_dir] if numpy_dir else [])
    return not any(path.startswith(d + os.sep) or path == d + ".py" for d in ours) and path != random.__file__


@contextlib.contextmanager
def watch() -> Iterator[Draws]:
    """Record draws from numpy's and Python's global generators in the block (and undo them)."""
    draws = Draws()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        np = None  # type: ignore[assignment]
    numpy_dir = str(Path(np.__file__).resolve().parent) if np is not None else None
    saved_np = np.random.get_state() if np is not None else None
    saved_py = random.getstate()
    patched: list[tuple[Any, str, Any]] = []

    def wrap(module: Any, name: str, library: str) -> None:
        original = getattr(module, name, None)
        if original is None:
            return

        def recording(*args: Any, **kwargs: Any) -> Any:
            if draws.site is None:
                stack = [f for f in traceback.extract_stack()[:-1] if _foreign(f.filename, numpy_dir)]
                draws.library, draws.function = library, name
                draws.site = stack[-1] if stack else None
            return original(*args, **kwargs)

        patched.append((module, name, original))
        setattr(module, name, recording)

    if np is not None:
        for name in _NUMPY_FNS:
            wrap(np.random, name, "numpy")
    for name in _PY_FNS:
        wrap(random, name, "random")
    try:
        yield draws
    finally:
        for module, name, original in reversed(patched):
            setattr(module, name, original)
        if np is not None and draws.library is None and _np_changed(np, saved_np):
            draws.library = "numpy"
        if draws.library is None and random.getstate() != saved_py:
            draws.library = "random"
        if np is not None:
            np.random.set_state(saved_np)
        random.setstate(saved_py)


def _np_changed(np: Any, saved: Any) -> bool:
    now = np.random.get_state()
    return now[0] != saved[0] or not np.array_equal(now[1], saved[1]) or now[2:] != saved[2:]


def refusal_line(draws: Draws, mode: str) -> str:
    """The one-line reason for a forward that draws outside torch in `mode` ("train"/"eval")."""
    return (f"could not capture the model: forward draws random numbers with {draws.describe()} in "
            f"{mode} mode, which a captured graph would hold as constants (every step would reuse "
            "the capture's draws); draw them with torch (torch.rand, torch.bernoulli: the graph keeps "
            "them random), or turn the random feature off (e.g. Wav2Vec2's SpecAugment: "
            "config.mask_time_prob=0.0 and config.mask_feature_prob=0.0), or compile the model in "
            "eval mode (--inference)")
