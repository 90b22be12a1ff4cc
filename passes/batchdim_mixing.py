"""The batch walk's finding (``Mixing``: the first node that would compute something else over
micro-batches), without torch or sympy: ``pipecc run``'s launcher refuses a folder's recorded
``batch_mixing`` with it (and ``pipecc.runtime.loss_kinds.split_words``, how the run splits the
batch in words) before any process starts. The walk itself is ``pipecc.passes.batchdim`` (which
re-exports it)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mixing"]


@dataclass(frozen=True)
class Mixing:
    """The first node that would compute something else over micro-batches, and why."""

    node: str          # its human name (META_NAME)
    why: str           # what it does to the batch, in a phrase
    fix: str = ""      # a way out besides microbatches=1, or ""

    def message(self, pieces: str) -> str:
        """One line: the node, what it does, and the fix (`pieces`: "2 micro-batches")."""
        extra = f", or {self.fix}" if self.fix else ""
        return (f"node {self.node} {self.why}, so splitting the batch into {pieces} would change "
                f"the model's results; use microbatches=1 (-m 1) with no replicas{extra}")

