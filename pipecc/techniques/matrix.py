"""Which techniques compose: every pair turned on in one example plan and asked both
techniques' `requires` (`docs/techniques.md` shows the result; `tests/test_techniques.py`
checks the page against it, so it cannot drift). Run `python -m pipecc.techniques.matrix`
to print the tables.

The example: 8 nodes, batch 8 in 4 micro-batches, 4 stages of two nodes on CPUs/GPUs, 1f1b.
Each technique's `turn_on` sets what it needs (UMPIPE: unequal sizes, under 1f1b unless the
plan runs gpipe; BPipe: 1f1b and a pair; Bi-Partition: a segment between stages 0 and 1;
recomputation: the last stage; replicas: groups of 2; zero-bubble: zb-h1; interleaving: 2
stages per device; split layers: one layer in two); a pair composes when, turned on in one order or the other, both stay on and no rule
refuses. A pair that does not is refused by exactly one technique's rule (`refusers`; the
test asks it of every pair), so a scope rule is written once.
"""

from __future__ import annotations

from typing import Callable

from pipecc.ir.plan import Plan, SplitLayer, StagePlan
from pipecc.ir.schedule.registry import UNEVEN
from pipecc.techniques import TECHNIQUES, capabilities as cap, requires

STAGES, NODES_PER_STAGE = 4, 2


def base() -> Plan:
    """The example plan every pair starts from (module docstring)."""
    stages = [StagePlan(index=k, device=k, nodes=[f"n{NODES_PER_STAGE * k + i}" for i in range(NODES_PER_STAGE)])
              for k in range(STAGES)]
    plan = Plan(model="example", batch_size=8, microbatches=4, schedule="1f1b", devices=[], stages=stages,
                split_layers=[], bottleneck_s=1.0, lower_bound_s=1.0, predicted_iteration_s=1.0,
                bubble_fraction=0.0, options={"training": True})
    return place(plan)


def place(plan: Plan) -> Plan:
    """Stage k on pipeline rank k % R (R = stages / virtual stages), each rank a group of
    `replicas` devices: the placement every rule reads."""
    ranks, d = len(plan.stages) // plan.virtual_stages, plan.replicas
    plan.devices = [{"name": f"gpu{i}", "kind": "gpu"} for i in range(ranks * d)]
    for s in plan.stages:
        s.device = (s.index % ranks) * d
        s.replica_devices = list(range(s.device, s.device + d)) if d > 1 else []
    return plan


def _umpipe(p: Plan) -> None:
    if p.schedule not in UNEVEN:
        p.schedule = "1f1b"
    p.microbatch_sizes = [[1, 3, 2, 2] if k % 2 else [4, 4] for k in range(len(p.stages))]


def _bpipe(p: Plan) -> None:
    p.schedule = "1f1b"
    p.activation_balancing = [{"evictor": 0, "acceptor": len(p.stages) - 1, "threshold": 2, "policy": "jit"}]


def _bipartition(p: Plan) -> None:
    if p.schedule not in ("1f1b", "gpipe"):
        p.schedule = "1f1b"
    p.bipartition_mode = "ship"  # n1 runs forward on stage 0, backward on stage 1
    p.stages[0].backward_nodes = p.stages[0].nodes[:1]
    p.stages[1].backward_nodes = p.stages[0].nodes[1:] + p.stages[1].nodes


def _recompute(p: Plan) -> None:  # the last stage: an acceptor (BPipe's evictors never recompute)
    p.stages[-1].recompute = True


def _replicas(p: Plan) -> None:
    p.replicas = 2


def _zero_bubble(p: Plan) -> None:
    p.schedule = "zb-h1"


def _interleaved(p: Plan) -> None:
    p.schedule, p.virtual_stages = "interleaved", 2


def _split_layers(p: Plan) -> None:
    p.split_layers = [SplitLayer(node="n3", parts=2, dim=0)]


# technique (as docs/techniques.md names it) -> how it turns on in a plan
TURN_ON: dict[str, Callable[[Plan], None]] = {
    "UMPIPE": _umpipe, "BPipe": _bpipe, "Bi-Partition": _bipartition, "recompute": _recompute,
    "replicas": _replicas, "zero-bubble": _zero_bubble, "interleaved": _interleaved,
    "split layers": _split_layers,
}


def with_on(*names: str) -> Plan:
    """The example plan with `names` turned on, in that order."""
    plan = base()
    for name in names:
        TURN_ON[name](plan)
    return place(plan)


def is_on(name: str, plan: Plan) -> bool:
    """Whether technique `name` is still in use in `plan` (a later one may have set another
    schedule)."""
    modules = {t.NAME: t for t in TECHNIQUES}
    if name in modules:
        return modules[name].uses(plan)
    if name == "interleaved":
        return plan.schedule == "interleaved" and plan.virtual_stages > 1
    return bool(plan.split_layers)


def pair(a: str, b: str) -> str | None:
    """None when a and b compose (in one order or the other both stay on and no rule refuses),
    else the first rule's reason."""
    reasons = []
    for order in ((a, b), (b, a)):
        plan = with_on(*order)
        why = requires(plan)
        if why is None and all(is_on(n, plan) for n in order):
            return None
        if why is not None:
            reasons.append(why)
    return reasons[0] if reasons else f"{a} and {b} need different schedules"


def refusers(a: str, b: str) -> list[list[str]]:
    """Per order in which both stay on, the techniques whose rule refuses the plan with a and b
    on (`NAME`s; a pair that composes has an empty list in some order)."""
    out = []
    for order in ((a, b), (b, a)):
        plan = with_on(*order)
        if all(is_on(n, plan) for n in order):
            out.append([t.NAME for t in TECHNIQUES if t.uses(plan) and t.requires(plan, cap.COMPILED) is not None])
    return out


def needs(name: str) -> list[str]:
    """The capabilities the technique's plan cannot do without (each taken away in turn, from
    the runtime and every device kind alike)."""
    plan = with_on(name)
    out = []
    for c in sorted(cap.ALL):
        caps = cap.Capabilities(runtime=cap.ALL - {c}, kinds={"gpu": cap.ALL - {c}}, where="a runtime without it")
        if requires(plan, caps) is not None:
            out.append(c)
    return out


def markdown() -> str:
    """The composition matrix and the capability table, as docs/techniques.md holds them."""
    names = list(TURN_ON)
    reasons: list[str] = []
    rows = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for a in names:
        cells = []
        for b in names:
            if a == b:
                cells.append("-")
                continue
            why = pair(a, b)
            if why is None:
                cells.append("yes")
            else:
                if why not in reasons:
                    reasons.append(why)
                cells.append(f"no [{reasons.index(why) + 1}]")
        rows.append(f"| **{a}** | " + " | ".join(cells) + " |")
    alone = [f"{n}: {requires(with_on(n))}" for n in names if requires(with_on(n)) is not None]
    assert not alone, alone  # every technique runs on its own in the example
    notes = [f"{i + 1}. {why}" for i, why in enumerate(reasons)]
    caps_rows = ["| technique | needs (capabilities) |", "|---|---|"]
    caps_rows += [f"| {n} | {', '.join(needs(n)) or '(none)'} |" for n in names]
    return "\n".join(rows + [""] + notes + [""] + caps_rows) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
