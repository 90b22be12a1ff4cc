"""Recomputation's report lines (`pipecc plan`, `pipecc inspect`): which stages recompute."""

from __future__ import annotations

from pipecc.ir.plan import Plan

__all__ = ["lines", "recompute_line"]


def recompute_line(plan: Plan) -> str:
    """Which stages recompute their activations ("" when none does)."""
    marked = [str(s.index) for s in plan.stages if s.recompute]
    if not marked:
        return ""
    which = "every stage" if len(marked) == len(plan.stages) else \
        f"stage{'s' if len(marked) > 1 else ''} {', '.join(marked)}"
    return (f"recompute       {which} (activations re-created in backward: bwd includes one "
            "more forward, memory holds the received inputs)")


def lines(plan: Plan, verbose: bool = False) -> list[str]:
    """The technique's lines in a plan's summary (`pipecc.techniques.parts("report")`)."""
    line = recompute_line(plan)
    return [line] if line else []
