"""UMPIPE in the torch backend: the compiled folder's record of the plan's per-stage micro-batch
sizes (`pipecc.json`'s "microbatch_sizes", `marker_fields`), checked as the runtime will slice
them (`pipecc.techniques.umpipe.runtime.check_sizes`)."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.runtime.ports import split_sizes
from pipecc.techniques.umpipe.runtime import check_sizes

__all__ = ["marker_fields", "marker_sizes"]


def marker_sizes(plan: Plan) -> list[list[int]] | None:
    """The plan's per-stage micro-batch sizes (UMPIPE) as `pipecc.json` records them: None when
    absent or every stage splits the batch equally (`split_sizes`, as the runtime does without
    sizes); lists the runtime cannot slice (`pipecc.techniques.umpipe.runtime.check_sizes`) refused."""
    sizes = getattr(plan, "microbatch_sizes", None)
    if sizes is None:
        return None
    sizes = [list(row) for row in sizes]
    check_sizes(sizes, len(plan.stages), plan.batch_size)
    if plan.microbatches <= plan.batch_size and all(
            row == split_sizes(plan.batch_size, plan.microbatches) for row in sizes):
        return None
    return sizes


def marker_fields(plan: Plan) -> dict[str, Any]:
    """The technique's entries of the compiled folder's marker (the torch backend's hook):
    "microbatch_sizes", one size list per stage, null for equal splits."""
    return {"microbatch_sizes": marker_sizes(plan)}
