"""The JSON files a compile writes beside the stages, for `pipecc inspect` and report.html:

    OUT/graph.json      graph_json(graph, plan): every node with op, kind, shapes, cost, stage,
                        where its inputs come from and where its outputs go
    OUT/timeline.json   timeline_json(timeline): the simulator's events for one iteration

`timeline_for(plan)` rebuilds that timeline from a plan alone (for a folder compiled before
timeline.json existed, or a caller without the planner's own).
"""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.report.text import technique_answer
from pipecc.techniques import parts as technique_parts

GRAPH_FORMAT = "pipecc-graph"
FORMAT_VERSION = 1
MODEL_INPUT = -1  # the "stage" of model inputs, as in ports.json


def graph_json(graph: Any, plan: Plan) -> dict[str, Any]:
    """Per-node facts for OUT/graph.json, from the (possibly layer-split) graph the plan names.

    Node keys: name (human), id (fx name = tensor/port name in stage.py and ports.json), op,
    kind, stage (-1 model input, null for a parameter read), stages (for parameters: every
    stage that reads it), shapes, shapes_at (ints at the compile batch), forward_flops,
    backward_flops, param_bytes, output_bytes (compile batch), *_mb (one micro-batch),
    forward_flops_expr, inputs [{name, id, stage}], users [{name, id, stage}] (the model's
    output is {"name": "output", "id": "output", "stage": num_stages}), split_of (shards).
    """
    import sympy

    from pipecc.backends.torch.stages import normalise_stage_of
    from pipecc.ir.graph import META_COST, META_KIND, META_NAME, META_OP, META_VALUE, ScalarInfo, tensors_in

    placed = normalise_stage_of(graph, plan.stage_of())
    nodes = [n for n in graph.gm.graph.nodes if n.op != "output"]
    num_stages = len(plan.stages)
    mb = max(plan.batch_size // max(plan.microbatches, 1), 1)
    at_mb = dict(graph.point)
    if "B" in graph.symbols:
        at_mb[graph.symbols["B"]] = mb
    shard_of = {sh: sl.node for sl in plan.split_layers for sh in sl.shards}

    def stage(n: Any) -> int | None:
        if n.op == "output":
            return num_stages
        if n.op == "placeholder":
            return MODEL_INPUT
        return placed.get(n.meta[META_NAME])

    def ref(n: Any) -> dict[str, Any]:
        if n.op == "output":
            return {"name": "output", "id": "output", "stage": num_stages}
        return {"name": n.meta[META_NAME], "id": n.name, "stage": stage(n)}

    def number(expr: Any, point: dict) -> int:
        return int(sympy.sympify(expr).subs(point)) if not isinstance(expr, int) else expr

    out = []
    for n in nodes:
        cost = n.meta.get(META_COST)
        value = n.meta.get(META_VALUE)
        tensors = list(tensors_in(value))
        if isinstance(value, ScalarInfo):
            shapes = ["scalar" if value.value is None else f"scalar({value.value})"]
        else:
            shapes = [t.describe() for t in tensors]
        entry: dict[str, Any] = {
            "name": n.meta[META_NAME], "id": n.name, "op": n.meta.get(META_OP, n.op),
            "kind": n.meta.get(META_KIND, "?"), "stage": stage(n),
            "shapes": shapes,
            "shapes_at": [[number(d, graph.point) for d in t.shape] for t in tensors],
            "inputs": [ref(i) for i in n.all_input_nodes],
            "users": [ref(u) for u in n.users],
        }
        if n.op == "get_attr":
            entry["stage"] = None
            entry["stages"] = sorted({placed[u.meta[META_NAME]] for u in n.users
                                      if u.op != "output" and u.meta[META_NAME] in placed})
        for f in ("forward_flops", "backward_flops", "param_bytes", "output_bytes"):
            entry[f] = cost.value(f) if cost is not None else 0
        for f in ("forward_flops", "backward_flops", "output_bytes"):
            entry[f + "_mb"] = number(getattr(cost, f), at_mb) if cost is not None else 0
        entry["forward_flops_expr"] = str(cost.forward_flops) if cost is not None else "0"
        if entry["name"] in shard_of:
            entry["split_of"] = shard_of[entry["name"]]
        out.append(entry)
    return {"format": GRAPH_FORMAT, "version": FORMAT_VERSION, "model": graph.model_name,
            "batch_size": plan.batch_size, "microbatch_size": mb, "num_stages": num_stages,
            "symbols": {k: int(graph.point[s]) for k, s in graph.symbols.items()}, "nodes": out}


def timeline_json(timeline: Any) -> dict[str, Any]:
    """The simulator's Timeline as OUT/timeline.json: events (rank, kind, stage, microbatch,
    start, end, peer), iteration_s, bubble_fraction, busy_s and peak_memory_bytes per rank,
    allreduce_end_s per rank (replica groups' gradient all-reduce; [] without replication)."""
    return {"num_ranks": timeline.num_ranks, "iteration_s": timeline.iteration_s,
            "bubble_fraction": timeline.bubble_fraction, "busy_s": list(timeline.busy_s),
            "peak_memory_bytes": list(timeline.peak_memory_bytes),
            "allreduce_end_s": list(getattr(timeline, "allreduce_end_s", [])),
            "events": [{"rank": e.rank, "kind": e.kind.value, "stage": e.stage,
                        "microbatch": e.microbatch, "start": e.start, "end": e.end,
                        "peer": e.peer} for e in timeline.events]}


def step_tail(plan: Plan, schedule: Schedule) -> list[float] | None:
    """[rank] the per-iteration fixed seconds of its stages (`StagePlan.step_s`) after its last
    action, as the planner simulated them; None when all are 0 (older plans)."""
    tail = [0.0] * schedule.num_ranks
    for k, s in enumerate(plan.stages):
        tail[schedule.stage_to_rank[k]] += float(getattr(s, "step_s", 0.0) or 0.0)
    return tail if any(tail) else None


def timeline_for(plan: Plan, schedule: Schedule | None = None) -> Any:
    """The simulator's Timeline for `plan`, rebuilt from its per-stage figures, of `schedule`
    (a compiled folder's schedule.txt; default: the plan's own, `pipecc.techniques.schedule_of`).

    Equal to the planner's own (same stage costs, same schedule): the per-direction transfer
    times come back from `comm_s`, which the planner sums as 2*recv + 2*send.
    """
    from pipecc.techniques import schedule_of
    from pipecc.ir.schedule.registry import SPLIT_BACKWARD_COST, ZERO_BUBBLE
    from pipecc.passes.simulate import StageCosts, simulate

    from pipecc.ir.schedule.transforms import without_collectives

    # the simulator charges REDUCE and REFRESH as costs (allreduce_s, the tail), not as actions
    schedule = without_collectives(schedule_of(plan) if schedule is None else schedule)
    own = technique_answer("timeline", plan, schedule)  # a technique that prices its actions itself (UMPIPE)
    if own is not None:
        return own
    n, m = len(plan.stages), plan.microbatches
    send, prev = [], 0.0
    for k, s in enumerate(plan.stages):
        t = max(s.comm_s / 2 - prev, 0.0) if k < n - 1 else 0.0
        send.append(t)
        prev = t
    costs = StageCosts.per_stage(m, [s.forward_s for s in plan.stages],
                                 [s.backward_s for s in plan.stages], send, [0.0] + send[:-1],
                                 backward_weight_s=[s.backward_weight_s for s in plan.stages],
                                 split_cost=SPLIT_BACKWARD_COST if plan.schedule in ZERO_BUBBLE else 1.0)
    costs.tail_s = step_tail(plan, schedule)
    # each technique's own costs (Bi-Partition's two directions and tail, BPipe's stash transfers,
    # the replicas' all-reduce): a report part's `timeline_costs`, in TECHNIQUES order (they set
    # different fields, so the order cannot change the timeline)
    for part in technique_parts("report"):
        if hasattr(part, "timeline_costs"):
            costs = part.timeline_costs(plan, schedule, costs)
    return simulate(schedule, costs)
