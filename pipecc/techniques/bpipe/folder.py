"""BPipe's facts in a compiled folder's pipecc.json, for the folder's one reader
(`pipecc.runtime.folder.CompiledFolder.activation_balancing` asks `pipecc.techniques.parts("folder")`):
torch-free, so `pipecc run`'s launcher checks a folder without importing torch."""

from __future__ import annotations

from typing import Any

from pipecc.errors import PipeccError

__all__ = ["folder_balancing"]


def folder_balancing(meta: dict[str, Any] | None) -> list[dict] | None:
    """A compiled folder's BPipe pairs (``pipecc.json``'s ``activation_balancing``; None when
    absent or empty: `pipecc.techniques`' ``folder.folder_balancing``). Where they can run (1f1b,
    ...) is BPipe's rule, asked of the folder's plan (``pipecc.runtime.admit``)."""
    pairs = (meta or {}).get("activation_balancing")
    if not pairs:
        return None
    if not isinstance(pairs, list) or not all(isinstance(p, dict) for p in pairs):
        raise PipeccError(f"pipecc.json says activation_balancing {pairs!r}; compile again")
    return pairs
