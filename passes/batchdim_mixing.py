"""The batch walk's finding (``Mixing``: the first node that would compute something else over
micro-batches) and how a run splits the batch in words (``pieces``), without torch or sympy:
``pipecc run``'s launcher refuses a folder's recorded ``batch_mixing`` with them before any
process starts. The walk itself is ``pipecc.passes.batchdim`` (which re-exports both)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Mixing", "pieces"]


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


def pieces(microbatches: int, replicas: int = 1) -> str:
    """How a plan splits the batch, in words ("2 micro-batches and 2 replicas"); "" when it
    does not (one micro-batch, no replicas: nothing to refuse)."""
    parts = [f"{microbatches} micro-batches"] if microbatches > 1 else []
    parts += [f"{replicas} replicas"] if replicas > 1 else []
    return " and ".join(parts)
