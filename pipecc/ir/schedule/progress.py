"""Advancing every rank's row until it blocks: the one loop the validator's deadlock check, the
BPipe transform's unit clock and the planner's simulator all run over a schedule.

Ranks execute their rows in order; an action may have to wait (a receive whose send has not run,
a compute whose inputs are not ready). ``advance`` sweeps the ranks in rank order, running each
row as far as it can, and repeats until no row moves: what is left unrun is blocked for good.
"""

from __future__ import annotations

from collections.abc import Callable

from pipecc.ir.schedule.actions import Action, Schedule

__all__ = ["advance"]


def advance(schedule: Schedule, blocked: Callable[[Action], bool], run: Callable[[Action, int], None]) -> list[int]:
    """Run every row of ``schedule`` (``run(action, rank)``) as far as ``blocked`` lets it, until
    no row moves; returns, per rank, the index of its first action not run (its row's length
    when it finished). O(R * A) sweeps in the worst case, O(A) in practice."""
    pc = [0] * schedule.num_ranks
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(schedule.actions):
            while pc[r] < len(row):
                a = row[pc[r]]
                if blocked(a):
                    break
                run(a, r)
                pc[r] += 1
                progress = True
    return pc
