"""UMPIPE's facts in a compiled folder's pipecc.json, for the folder's one reader
(`pipecc.runtime.folder.CompiledFolder.sizes_for` asks `pipecc.techniques.parts("folder")`):
torch-free, so `pipecc run`'s launcher checks a folder without importing torch."""

from __future__ import annotations

from typing import Any

from pipecc.errors import PipeccError, UsageError

__all__ = ["folder_sizes"]


def folder_sizes(meta: dict[str, Any] | None, microbatches: int | None) -> list[list[int]] | None:
    """A compiled folder's per-stage micro-batch sizes (``pipecc.json``'s ``microbatch_sizes``;
    None: equal splits), refusing any ``--microbatches`` (``UsageError``; `pipecc.techniques`'
    ``folder.folder_sizes``)."""
    sizes = (meta or {}).get("microbatch_sizes")
    if sizes is None:
        return None
    if not isinstance(sizes, list) or not all(
            isinstance(row, list) and row and all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                                                  for b in row) for row in sizes):
        raise PipeccError(f"pipecc.json says microbatch_sizes {sizes!r}; compile again")
    shown = " | ".join(" ".join(map(str, row)) for row in sizes)
    # NOTE: which schedules run them is UMPIPE's rule, asked of the folder's plan (pipecc.runtime.admit)
    if microbatches is not None:
        raise UsageError(f"--microbatches {microbatches}: this folder splits the batch unequally per stage "
                         f"({shown}); drop --microbatches, or compile again with equal micro-batches")
    return sizes
