"""Bi-Partition in the planner: FP/BP cut pairs for a chosen plan, and the compile-time check.

    plan (its partition, devices, schedule, m) ─► PartitionProblem of its units (the evaluator's
    costs) ─► techniques.bipartition.search.bipartition (windowed exact DP around the plan's cuts, stash
    shipping costs) ─► simulate both ─► the plan with FP/BP ranges when faster, else unchanged;
    a decision line either way

Scope v1 (PAPERS-SPEC §3.8): Bi-Partition's rule, `pipecc.techniques.bipartition.requires`
(a training plan under 1f1b or gpipe, one stage per device, replicas 1, equal micro-batches, no
recomputing stage, stash-keeping devices, at least two stages; split layers compose: the
driver searches the cut pairs on a split plan's rewritten graph), and what
needs the graph, `graph_requires`: the users of a shared weight in one piece (no cut lies
between them). A misplaced segment may not hold the loss / last node (the DP
keeps it in the last worker's core), a module whose buffers training mutates (BatchNorm in
training mode: the forward and backward worker would each hold running statistics) or a node
whose value is not tensors (the runtime ships saved tensors only): `segment_blockers`.
The runtime mode is "ship" (a segment's saved tensors travel to its backward worker);
"recompute" is only costed (its best cut pair is stated in the decision line: the misplaced
forward runs twice, so it never beats the single cut by much, PAPERS-SPEC §3.2), and
the rule refuses a plan that asks for it.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Sequence

import numpy as np
import sympy
import torch.fx as fx

from pipecc import cost_saved
from pipecc import techniques
from pipecc.ir.graph import (META_COST, META_NAME, META_VALUE, AnnotatedGraph, TensorInfo, tensors_in,
                             training_batchnorm_names)
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.registry import schedule_for
from pipecc.techniques.bipartition.data import BipartitionCosts, BipartitionSearch
from pipecc.techniques.bipartition.search import BiPartition, bipartition, evaluate_bi
from pipecc.passes.bound import lower_bound
from pipecc.passes.contract import Contract, PlanContext, TechniqueStep
from pipecc.passes.partition import InfeasibleError, PartitionProblem, evaluate
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.passes.simulate import StageCosts, Timeline, simulate

__all__ = ["STEP", "graph_requires", "segment_blockers", "shared_weights", "apply", "describe", "step", "WINDOW"]

WINDOW = 8  # units each cut may move (PAPERS-SPEC §3.4's Δ)
WIDEST = 16  # ... doubled once while a cut sits at the window's edge and the result improves


def _tensor_only(value: Any) -> bool:
    if isinstance(value, TensorInfo):
        return True
    if isinstance(value, (tuple, list)):
        return all(_tensor_only(v) for v in value)
    return False


def segment_blockers(graph: AnnotatedGraph) -> dict[str, str]:
    """Node name -> why its forward and backward must run on one worker (module docstring):
    BatchNorm in training mode, and a node that produces or takes a non-tensor value (it
    could be a segment's boundary port, which carries tensors only)."""
    out = {name: "BatchNorm in training mode (its running statistics)"
           for name in training_batchnorm_names(graph)}
    for node in graph.compute_nodes():
        name = str(node.meta.get(META_NAME, node.name))
        if name in out or node.op == "get_attr":
            continue
        value = node.meta.get(META_VALUE)
        if value is not None and not _tensor_only(value):
            out[name] = "a non-tensor value"
            continue
        for arg in node.all_input_nodes:
            v = arg.meta.get(META_VALUE)
            if arg.op != "get_attr" and v is not None and not _tensor_only(v):
                out[name] = f"a non-tensor input from {arg.meta.get(META_NAME, arg.name)}"
                break
    return out


def shared_weights(graph: AnnotatedGraph) -> dict[str, list[str]]:
    """Parameter or module target -> the node names using it, for targets used by more than
    one node: the runtime refuses a Bi-Partition plan that puts such nodes in different pieces
    (tied weights, `techniques.bipartition.codegen`), so no cut may lie between them."""
    users: dict[str, list[str]] = {}
    for node in graph.gm.graph.nodes:
        if node.op == "get_attr":
            for user in node.users:
                users.setdefault(str(node.target), []).append(str(user.meta.get(META_NAME, user.name)))
        elif node.op == "call_module":
            users.setdefault(str(node.target), []).append(str(node.meta.get(META_NAME, node.name)))
    return {t: sorted(set(names)) for t, names in users.items() if len(set(names)) > 1}


def _tied_across(plan: Plan, shared: dict[str, list[str]]) -> str | None:
    """A shared weight whose users the plan puts in different pieces, or None."""
    piece = {n: i for i, (_, _, _, nodes) in enumerate(plan.bipartition_pieces()) for n in nodes}
    for target, names in shared.items():
        held = {piece[n] for n in names if n in piece}
        if len(held) > 1:
            return f"{target} shared by {names[0]} and {names[-1]}"
    return None


def _problem(ev: Evaluator, plan: Plan, units: Any, mb: int, graph: AnnotatedGraph) -> PartitionProblem:
    order = tuple(int(d.get("given_index", i)) for i, d in enumerate(plan.devices))
    prob = ev.problem(units, mb, plan.schedule, plan.microbatches, order)
    act = np.asarray(prob.act_mem, dtype=float)
    return dataclasses.replace(prob, stash_bytes=act.max(axis=0) if act.ndim > 1 else act,
                               segment_stash=segment_stash(graph, units, mb),
                               param_bytes=np.asarray(units.param_bytes, dtype=float))


def segment_stash(graph: AnnotatedGraph, units: Any, mb: int) -> Callable[[int, int], float]:
    """(lo, hi) -> the saved-tensor bytes a misplaced segment of units lo..hi-1 ships per
    micro-batch of `mb` samples: its nodes' own buffers (a dropout mask, a norm's statistics)
    and every storage their backwards keep, once each, wherever it was made (the segment's input
    a linear keeps is made before it; an output only later nodes keep is not shipped). The
    per-node `stash_bytes` charges each kept storage to the node making it
    (`pipecc.cost_saved`), which a segment's two ends cut through."""
    gnodes = list(graph.gm.graph.nodes)
    by_name = {str(n.meta.get(META_NAME, n.name)): n for n in gnodes}
    alias = cost_saved.alias_map(graph.gm)
    charged = cost_saved.kept_roots(gnodes, alias)
    point = dict(graph.point)
    if "B" in graph.symbols:
        point[graph.symbols["B"]] = mb
    value: dict[Any, float] = {}  # NOTE: repeated blocks share their expressions

    def at(expr: Any) -> float:
        if expr not in value:
            value[expr] = float(sympy.sympify(expr).subs(point))
        return value[expr]

    def held(r: fx.Node) -> float:
        rule = r.meta.get(cost_saved.META_SAVES)
        return at(rule.held) if rule is not None else at(sum(t.nbytes for t in tensors_in(r.meta.get(META_VALUE))))

    own: list[float] = []        # [unit] its nodes' own buffers
    kept: list[set] = []         # [unit] the storages its backwards keep
    for names in units.names:
        extra, roots = 0.0, set()
        for name in names:
            node = by_name.get(name)
            rule = node.meta.get(cost_saved.META_SAVES) if node is not None else None
            cost = node.meta.get(META_COST) if node is not None else None
            if rule is None:
                continue
            mine = node in charged and not alias.get(node)
            extra += max(0.0, (at(cost.stash_bytes) if cost is not None else 0.0) - (held(node) if mine else 0.0))
            roots.update(cost_saved.root(k, alias) for k in rule.keeps)
            if rule.own:
                roots.add(cost_saved.root(node, alias))
        own.append(extra)
        kept.append({r for r in roots if r.op != "get_attr"})
    sizes = {r: held(r) for roots in kept for r in roots}
    found: dict[tuple[int, int], float] = {}

    def stash(lo: int, hi: int) -> float:
        if (lo, hi) not in found:
            roots = set().union(*kept[lo:hi]) if hi > lo else set()
            found[lo, hi] = sum(own[lo:hi]) + sum(sizes[r] for r in roots)
        return found[lo, hi]
    return stash


def stage_costs(bi: BiPartition, prob: PartitionProblem, m: int,
                step: Sequence[float] | None = None) -> StageCosts:
    """The simulator's costs of a cut pair (`passes.simulate` module docstring): FP/BP range
    sums plus each worker's per-micro-batch fixed costs (`PartitionProblem.stage_fixed`), both
    messages per boundary, stashes held per `techniques.bipartition.search`'s memory model, each worker's
    per-iteration fixed cost `step[j]` (the optimizer step) then the replica refresh as its
    tail after its last action."""
    a, c, p = bi.fwd_bounds, bi.bwd_bounds, len(bi.fwd_bounds) - 1
    fwd, bwd = np.asarray(prob.fwd, dtype=float), np.asarray(prob.bwd, dtype=float)
    act = np.broadcast_to(np.asarray(prob.act_mem, dtype=float), fwd.shape)
    static = np.broadcast_to(np.asarray(prob.static_mem, dtype=float), fwd.shape)
    params = np.asarray(prob.param_bytes if prob.param_bytes is not None else static.max(axis=0))
    f, b, held, own = [], [], [], []
    for j in range(p):
        fixed_f, fixed_b = prob.stage_fixed(j)
        f.append(float(fwd[j, a[j]:a[j + 1]].sum()) + fixed_f)
        extra = 0.0
        if bi.mode == "recompute":
            extra = float(fwd[j, c[j]:a[j]].sum() + fwd[j, a[j + 1]:c[j + 1]].sum())
        b.append(float(bwd[j, c[j]:c[j + 1]].sum()) + extra + fixed_b)
        held.append(float(act[j, min(a[j], c[j]):min(a[j + 1], c[j + 1])].sum()))
        replica = float(params[c[j]:a[j]].sum() + params[a[j + 1]:c[j + 1]].sum())
        own.append(float(static[j, c[j]:c[j + 1]].sum()) + replica)
    send_f = list(bi.fwd_link_time) + [0.0]
    send_b = [0.0] + list(bi.bwd_link_time)
    tail = [float(x) for x in step] if step is not None else [0.0] * p
    for j, t in enumerate(bi.sync_time):  # boundary j: the owner is the BP worker
        owner = j + 1 if a[j + 1] > c[j + 1] else j
        tail[owner] = max(tail[owner], (step[owner] if step is not None else 0.0) + t)
    costs = StageCosts.per_stage(m, f, b, send_forward_s=send_f, send_backward_s=send_b,
                                 activation_bytes=held, static_bytes=own)
    costs.tail_s = tail if any(tail) else None
    return costs


def _steps(ev: Evaluator, plan: Plan) -> list[float]:
    """[worker] the cost model's per-iteration fixed seconds of its device (`step_s`)."""
    order = [int(d.get("given_index", i)) for i, d in enumerate(plan.devices)]
    return [ev.tables.step_s(order[s.device]) for s in plan.stages]


def _simulate(bi: BiPartition, prob: PartitionProblem, plan: Plan, step: Sequence[float]) -> Timeline:
    sched = schedule_for(plan.schedule, len(plan.stages), plan.microbatches)
    return simulate(sched, stage_costs(bi, prob, plan.microbatches, step))


def _cuts(b: Sequence[int]) -> str:
    return "[" + ", ".join(str(x) for x in b[1:-1]) + "]"


def describe(plan: Plan) -> str:
    """"FP cuts [..], BP cuts [..]" in unit counts, from the plan's search record ("" if none)."""
    info = plan.data(BipartitionSearch)
    if info is None or not info.used:
        return ""
    return f"FP cuts {_cuts(info.fwd_bounds)}, BP cuts {_cuts(info.bwd_bounds)}"


def apply(plan: Plan, ev: Evaluator, graph: AnnotatedGraph, *, window: int = WINDOW) -> Plan:
    """`plan` with separate FP/BP cuts when they simulate faster than its single cut (module
    docstring); its lower bounds are lowered to the Bi-Partition bound either way (any plan now
    includes FP/BP cut pairs). `ev` must be built on `graph`, the plan's graph. A new Plan, with
    the decision line either way: `plan` stays as it was (`pipecc.passes.contract`)."""
    plan = copy.deepcopy(plan)
    mb = plan.batch_size // plan.microbatches
    units = ev.builder.at(mb)
    bounds = units.stage_bounds(plan.stages)
    prob = _problem(ev, plan, units, mb, graph)
    blockers = segment_blockers(graph)
    no_segment = [any(n in blockers for n in group) for group in units.names]
    unit_of = {n: u for u, group in enumerate(units.names) for n in group}
    no_cut = [False] * (units.n + 1)
    for users in shared_weights(graph).values():  # keep a tied weight's users in one piece
        us = [unit_of[n] for n in users if n in unit_of]
        for s in range(min(us) + 1, max(us) + 1) if us else ():
            no_cut[s] = True
    bound_prob = ev.tables.bound_problem(prob, [int(d.get("given_index", i))
                                                for i, d in enumerate(plan.devices)], mb)
    plan.lower_bound_s = min(plan.lower_bound_s, lower_bound(bound_prob, units.splittable,
                                                             bipartition=True))
    single = evaluate(prob, bounds)
    base = evaluate_bi(prob, bounds, bounds)
    step = _steps(ev, plan)
    t_single = _simulate(base, prob, plan, step)
    tried: list[tuple[BiPartition, PartitionProblem, Timeline]] = []
    for variant in (prob, dataclasses.replace(prob, comm="charged")):
        try:
            bi = bipartition(variant, window, "ship", single=single, no_segment=no_segment,
                             no_cut=no_cut, widen_to=max(window, WIDEST))
        except InfeasibleError:
            continue
        if bi.is_split:  # cost it on the real (overlapped) model
            bi = evaluate_bi(prob, bi.fwd_bounds, bi.bwd_bounds)
            if bi.fits:
                tried.append((bi, prob, _simulate(bi, prob, plan, step)))
    try:
        rc = bipartition(prob, window, "recompute", single=single, no_segment=no_segment,
                         no_cut=no_cut)
        rc_line = (f"with recomputation instead of stash shipping the best cut pair gives "
                   f"{rc.bottleneck:.4g} s per micro-batch vs the single cut's "
                   f"{base.bottleneck:.4g} s (a misplaced segment's forward runs twice)")
    except InfeasibleError:
        rc, rc_line = None, "recomputation: no cut pair fits memory"
    search = BipartitionSearch(
        used=False, window=window, mode="ship", single_iteration_s=t_single.iteration_s,
        single_bottleneck_s=base.bottleneck, recompute_bottleneck_s=rc.bottleneck if rc else None,
        recompute_iteration_s=(_simulate(rc, prob, plan, step).iteration_s if rc is not None and rc.is_split
                               else t_single.iteration_s),
        best_ship_bottleneck_s=min([b.bottleneck for b, _, _ in tried], default=base.bottleneck))
    plan = plan.with_data(search)
    tried.sort(key=lambda r: r[2].iteration_s)
    if not tried or tried[0][2].iteration_s >= t_single.iteration_s * (1 - 1e-9):
        plan.decisions.append(f"Bi-Partition not used: no FP/BP cut pair beats the single cut "
                              f"(window ±{window} units; {rc_line})")
        return plan
    bi, prob, tl = tried[0]
    costs = _fill(plan, bi, prob, tl, units, ev)
    plan = plan.with_data(costs, dataclasses.replace(
        search, used=True, fwd_bounds=tuple(bi.fwd_bounds), bwd_bounds=tuple(bi.bwd_bounds),
        iteration_s=tl.iteration_s, bottleneck_s=bi.bottleneck,
        stash_bytes=tuple(float(x) for x in bi.misplaced_stash_bytes),
        weight_sync_bytes=tuple(float(x) for x in bi.weight_sync_bytes)))
    plan.decisions.append(
        f"Bi-Partition: {t_single.iteration_s / tl.iteration_s:.3g}× faster than the single cut "
        f"({describe(plan)}, in units of the {units.n} in graph order): predicted {tl.iteration_s:.4g} s per iteration vs "
        f"{t_single.iteration_s:.4g} s, {int(sum(bi.misplaced_stash_bytes))} bytes of segment "
        f"stash per micro-batch, {plan.weight_sync_bytes} bytes of replica refresh per "
        f"iteration; {rc_line}")
    return plan


def _fill(plan: Plan, bi: BiPartition, prob: PartitionProblem, tl: Timeline, units: Any,
          ev: Evaluator) -> BipartitionCosts:
    """Write the cut pair into the plan (contract: nodes = FP range, backward_nodes = BP); the
    timeline's seconds the stage figures cannot tell apart, for the plan's data."""
    a, c, p = bi.fwd_bounds, bi.bwd_bounds, len(plan.stages)
    fwd, bwd = np.asarray(prob.fwd, dtype=float), np.asarray(prob.bwd, dtype=float)
    order = [int(d.get("given_index", i)) for i, d in enumerate(plan.devices)]
    mb = plan.batch_size // plan.microbatches
    weights = ev.tables.weight_times(evaluate(prob, c), prob, order, mb)
    costs = stage_costs(bi, prob, plan.microbatches, _steps(ev, plan))
    for j, s in enumerate(plan.stages):
        s.nodes = [n for u in range(a[j], a[j + 1]) for n in units.names[u]]
        s.backward_nodes = [n for u in range(c[j], c[j + 1]) for n in units.names[u]]
        s.forward_s, s.backward_s = costs.forward_s[j][0], costs.backward_s[j][0]
        unit_f, unit_b = ev.tables.unit_fixed(order[s.device])
        fixed_f, fixed_b = prob.stage_fixed(j)
        s.fixed_forward_s = float(unit_f[a[j]:a[j + 1]].sum()) + fixed_f
        s.fixed_backward_s = float(unit_b[c[j]:c[j + 1]].sum()) + fixed_b
        s.host_forward_s, s.host_backward_s = ev.tables.stage_host(order[s.device])
        s.backward_weight_s = float(weights[j])
        s.send_bytes = int(bi.fwd_cut_bytes[j]) if j < p - 1 else 0
        s.recv_bytes = int(bi.fwd_cut_bytes[j - 1]) if j > 0 else 0
        extra = 0.0
        if j < p - 1 and a[j + 1] > c[j + 1]:
            extra += bi.misplaced_stash_bytes[j]
        if j > 0 and c[j] > a[j]:
            extra += bi.misplaced_stash_bytes[j - 1]
        s.extra_send_bytes = int(extra)
        s.comm_s = float(sum(bi.fwd_link_time[k] + bi.bwd_link_time[k]
                             for k in (j - 1, j) if 0 <= k < p - 1))
        s.peak_memory_bytes = int(tl.peak_memory_bytes[j])
        s.forward_flops = int(units.values["forward_flops"][a[j]:a[j + 1]].sum())
        s.param_bytes = int(units.param_bytes[c[j]:c[j + 1]].sum())
    plan.bottleneck_s = float(bi.bottleneck)
    plan.predicted_iteration_s = float(tl.iteration_s)
    plan.bubble_fraction = float(tl.bubble_fraction)
    plan.bipartition_mode = "ship"
    plan.weight_sync_bytes = int(sum(bi.weight_sync_bytes))
    # NOTE: reports rebuild the timeline from the plan (`pipecc.report.artifacts.timeline_for`);
    # comm_s cannot tell the two directions apart here, so the seconds travel with the plan
    return BipartitionCosts(
        send_forward_s=tuple(row[0] for row in costs.send_forward_s),
        send_backward_s=tuple(row[0] for row in costs.send_backward_s),
        tail_s=tuple(costs.tail_s or []))


def graph_requires(graph: AnnotatedGraph, plan: Plan) -> str | None:
    """The part of Bi-Partition's rule that needs the graph (`pipecc.techniques.bipartition`
    has the rest), or None: tied weights in different pieces, and in a segment (forward and
    backward on different workers) the model's last node (the loss) or a `segment_blockers`
    node. Before the search (no separate cuts yet) only the tied weights can refuse."""
    tied = _tied_across(plan, shared_weights(graph))
    if tied is not None:
        return f"separate forward/backward cuts (Bi-Partition) with tied weights in different stages ({tied}); re-plan"
    if not techniques.bipartition.uses(plan):
        return None
    blockers = segment_blockers(graph)
    last = plan.stages[-1].nodes[-1] if plan.stages and plan.stages[-1].nodes else None
    for kind, fp, bp, nodes in plan.bipartition_pieces():
        if kind != "segment":
            continue
        for n in nodes:
            if n == last:
                return (f"plan: the last node {n} (the loss) runs forward on stage {fp} and backward on "
                        f"stage {bp}; re-plan")
            if n in blockers:
                return (f"plan: node {n} ({blockers[n]}) runs forward on stage {fp} and backward on stage "
                        f"{bp}, which the runtime cannot do; re-plan with --bipartition auto or off")
    return None


# ----------------------------------------------------------------------------- the driver's step


def _noted(plan: Plan, *lines: str) -> Plan:
    """`plan` with `lines` added to its decisions: a copy (a step never edits a plan it read)."""
    return dataclasses.replace(plan, decisions=[*plan.decisions, *lines])


def step(state: Any, ctx: PlanContext) -> None:
    """Separate forward/backward cuts (`techniques.bipartition.plan`) on the chosen plan; when it
    splits layers, first on its split graph (`_split_step`), then on the planner's
    unsplit plan of `graph`, kept only if faster than the split one. A decision line either way."""
    from pipecc.techniques.bipartition import plan as bipartition_plan
    assert state.plan is not None and state.graph is not None
    if state.plan.split_layers and state.candidate is not None:
        _split_step(state, ctx)  # split layers compose (issue 18)
    chosen = state.plan
    if chosen.split_layers and state.candidate is not None:
        base = ctx.planner.to_plan(state.candidate)
        g, ev = ctx.graph, ctx.planner.evaluator
    else:
        base, g = chosen, state.graph
        ev = ctx.planner.evaluator if g is ctx.graph else ctx.evaluator(g)
    why = techniques.bipartition.requires(base, techniques.COMPILED) or graph_requires(g, base)
    if why is not None:
        state.plan = _noted(chosen, f"Bi-Partition not tried: {why}")
        return
    result = apply(base, ev, g, window=ctx.options.bipartition_window)
    if base is chosen:
        state.plan = result
        return
    compute = chosen.lower_bound_compute_s
    if compute and result.lower_bound_compute_s:
        compute = min(compute, result.lower_bound_compute_s)
    chosen = dataclasses.replace(chosen, lower_bound_s=min(chosen.lower_bound_s, result.lower_bound_s),
                                 lower_bound_compute_s=compute)
    line = next(d for d in reversed(result.decisions) if d.startswith("Bi-Partition"))
    if result.is_bipartition() and result.predicted_iteration_s < chosen.predicted_iteration_s:
        state.plan, state.graph = _noted(result, f"Bi-Partition on unsplit layers beats the plan with split layers: "
                                                 f"{result.predicted_iteration_s:.4g} s vs "
                                                 f"{chosen.predicted_iteration_s:.4g} s per iteration"), g
        return
    if result.is_bipartition():
        line = (f"Bi-Partition not used: on unsplit layers it predicts "
                f"{result.predicted_iteration_s:.4g} s per iteration, the plan with split layers "
                f"{chosen.predicted_iteration_s:.4g} s ({line.removeprefix('Bi-Partition: ')})")
    state.plan = _noted(chosen, line)


def _split_step(state: Any, ctx: PlanContext) -> None:
    """Separate forward/backward cuts on the chosen plan with its split layers, on its rewritten
    graph (a split layer's shards are nodes like any other), when the rule admits that plan:
    `state.plan` gets the cut pair when it is faster, else a decision line says why not."""
    from pipecc.techniques.bipartition import plan as bipartition_plan
    assert state.plan is not None and state.graph is not None
    why = techniques.bipartition.requires(state.plan, techniques.COMPILED) or graph_requires(
        state.graph, state.plan)
    if why is not None:
        state.plan = _noted(state.plan, f"Bi-Partition with split layers not tried: {why}")
        return
    state.plan = apply(state.plan, ctx.evaluator(state.graph), state.graph,
                                        window=ctx.options.bipartition_window)


STEP = TechniqueStep(
    Contract("bipartition", ("graph", "costs", "plan", "cluster", "options"), ("graph", "plan"),
             "pipecc.techniques.bipartition.plan:apply"),
    "searching separate forward/backward cuts", lambda options: options.bipartition == "auto", step)
