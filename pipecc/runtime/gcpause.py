"""The cyclic garbage collector paused while a rank imports torch (and torch._dynamo).

Why. ``import torch`` makes about a million objects that live as long as the process, and
``torch.optim`` imports ``torch._dynamo`` (as many again) when a rank builds its optimizer.
While they are made, CPython's collector runs full collections that walk every one of them
(5 in a rank, each longer than the last): measured on the 2-core machine, 0.15-0.2 s of CPU of
torch's import and 0.2-0.25 s of dynamo's, about 0.4 s of a training rank's 2.6 s start; a
model file's libraries add theirs (torchvision 0.2 s, timm 0.4 s). Every ``pipecc run`` starts
one process per rank (the test suite hundreds), so a rank pauses it over those imports and over
loading its share of the folder.

What. ``paused()`` turns automatic collection off for its block and back on after it (only if it
was on). Nothing else changes: reference counting frees objects as before, nothing is frozen,
and the first collection after the block walks everything as it would have. Standard library
only: it runs before torch is imported.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["paused", "pause", "resume"]


def pause() -> bool:
    """Automatic collection off; whether it was on (for ``resume``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    return was_enabled


def resume(was_enabled: bool) -> None:
    """Automatic collection back on if ``pause`` found it on."""
    if was_enabled:
        gc.enable()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside the block (``pause`` ... ``resume``)."""
    was_enabled = pause()
    try:
        yield
    finally:
        resume(was_enabled)
