"""The techniques' hooks in the torch backend: each technique's `codegen` part
(`pipecc.techniques.parts("codegen")`, in `TECHNIQUES` order) defines those it needs, each
optional and documented in `pipecc.techniques`: `marker_fields`, `check`, `write_stages`,
`notes`, `forward_wrapper`, `wrap_module`. The backend names a hook by its role, never a
technique."""

from __future__ import annotations

from typing import Any, Callable

from pipecc.techniques import parts as technique_parts

__all__ = ["first_answer", "hooks"]


def hooks(name: str) -> list[Callable[..., Any]]:
    """The hook `name` of every technique's codegen part that defines it, in `TECHNIQUES` order."""
    return [getattr(part, name) for part in technique_parts("codegen") if hasattr(part, name)]


def first_answer(name: str, *args: Any) -> Any:
    """The first answer other than None of the hooks `name` (`hooks`), or None."""
    for hook in hooks(name):
        answer = hook(*args)
        if answer is not None:
            return answer
    return None
