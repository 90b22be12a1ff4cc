"""Activation recomputation's rule (`--recompute`, its planner pass `search`): which stages may re-run
their forward inside their backward. One `requires`, asked by the planner (`--recompute
full`, on a sketch where every stage recomputes), the plan verifier, compile and `pipecc run`.
BatchNorm in training mode (its running statistics would update twice) needs the graph:
`search.graph_requires`. The drop-in module's checkpointed stage: `codegen.Recomputed`.
"""

from __future__ import annotations

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.techniques import capabilities as cap
from pipecc.techniques.options import Option
from pipecc.techniques.facts import recomputing, training

NAME = "recompute"
TAG = "activation recomputation"
OFF = "--recompute auto or none"
LOWERS = "unchanged"  # `lower` is the identity: recomputation changes what a B runs
OPTIONS = (Option("--recompute", "recompute", "none", "auto|on|off",
                  "activation recomputation (torch.utils.checkpoint per stage): off (default), "
                  "on (every stage) or auto (only the stages that need it to fit memory); "
                  "old spellings none|full still work",
                  words={"auto": "auto", "on": "full", "off": "none"}, old={"none": "none", "full": "full"},
                  choices=("none", "full", "auto")),)


def uses(plan: Plan) -> bool:
    return bool(recomputing(plan))


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why `plan`'s recomputing stages cannot run on `caps` (one line with the fix), or None."""
    marked = recomputing(plan)
    if not marked:
        return None
    if not training(plan):
        return (f"{TAG} in a forward-only plan: stage {marked[0]} recomputes, but there is no backward pass; "
                "plan without --recompute")
    where = caps.first_lacking(plan, cap.RECOMPUTE, only=set(marked))
    if where is not None:
        return (f"{TAG}: {where} cannot recompute activations (its stage is dataflow hardware, not a "
                f"torch forward); use {OFF}")
    if not caps.runtime_can(cap.RECOMPUTE):
        return f"{TAG}: {caps.where} cannot re-run a stage's forward; use {OFF}"
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """`schedule` unchanged: recomputation changes what a stage's B runs (its forward again,
    inside the generated stage), not which actions the ranks run or in what order."""
    return schedule
