"""The emitter: a chosen `Candidate` written as the `Plan`, with its bounds and baselines.

    to_plan(ev, cand, lost, search)  stages (nodes, times, bytes, memory, devices), the proven
                                     lower bound, the decision lines, the baselines (--compare)
    lower_bound(ev, cand)            no plan of cand's shape (m, replicas, stages per rank) beats it
    baselines(ev, cand)              the partitions other tools would produce, same cost model

With replicas d > 1, stage k runs on pipeline rank j = k % P (P = n/d): devices j*d ..
j*d+d-1 (`StagePlan.replica_devices`, `device` = j*d), its forward_s/backward_s a replica's
(slice of mb/d, slowest member), `allreduce_s` its group's gradient all-reduce per iteration.
Stage times are the one cost model's (`passes.plan_costs.CostTables`): `forward_s`/`backward_s`
hold the stage's fixed costs, `fixed_forward_s`/`fixed_backward_s` say how much of them is
fixed (constant in the micro-batch size; `--calibrate` scales only the rest), `step_s` is its
per-iteration fixed cost. `bottleneck_s` stays the steady-state seconds per micro-batch of B/m samples (the P-rank
pipeline of groups; the all-reduce, once per iteration, is in `predicted_iteration_s`), so it
and `lower_bound_s` compare across d.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipecc.ir.plan import Plan, StagePlan
from pipecc.ir.schedule.registry import VIRTUAL
from pipecc.passes import baselines as base_rules
from pipecc import techniques
from pipecc.techniques.replicas import search as rep
from pipecc.passes.bound import lower_bound as partition_lower_bound
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.report.formatting import count
from pipecc.targets.calibrated import calibration_decisions
from pipecc.targets.profiled import profile_decisions, time_source

__all__ = ["SearchRecord", "baselines", "lower_bound", "piece_fixed", "shape_bound", "split_floor",
           "to_plan"]


@dataclass
class SearchRecord:
    """What the search found besides the candidate it writes: every feasible candidate (best
    first), the techniques' estimate (`Plan.estimate`: BPipe's) and each technique's decision
    lines, by its search part's module name (their `after_search` hooks, `passes.plan_search`)."""

    results: list[Candidate] = field(default_factory=list)
    estimate: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, list[str]] = field(default_factory=dict)


def lower_bound(ev: Evaluator, cand: Candidate, comm: bool = True) -> float:
    """A bottleneck no plan of the candidate's shape beats: its micro-batch count, replication
    degree d (P = n/d groups at a slice of mb/d, `techniques.replicas.search.group_problem`) and stages
    per rank, whatever its cuts or layer splits: `bound.lower_bound` on the candidate's
    problem (d = 1: with `bound_problem`'s costs), every cost the planner charges counted
    (per-call fixed costs in the unit times, each stage's per-micro-batch fixed costs, the
    messages with both hosts' costs, where the cuts can lie: that function's (5)).
    NOTE: the bound is per shape, not the least over every degree: a replicated plan's
    bottleneck leaves its all-reduce out (it is per iteration), so the least over degrees
    would measure a pipeline against a data-parallel shape's cheaper steady state; a
    data-parallel plan (one stage) is measured against its own shape's bound (the report
    and `inspect` say so: `pipecc.report.text.ratio_note`). comm=False: the comm-blind bound (plan.json's
    `lower_bound_compute_s`, reported next to it)."""
    assert isinstance(ev.options.batch_size, int)
    mb = ev.options.batch_size // cand.microbatches
    units, prob = cand.units, cand.problem
    if cand.replicas == 1:
        prob = ev.tables.bound_problem(prob, cand.order, mb)
    return partition_lower_bound(prob, units.splittable, comm=comm,
                                 split_bytes=split_floor(ev, units),
                                 split_fixed=piece_fixed(ev, cand.order, cand.replicas, len(prob.mem_cap)))


def shape_bound(ev: Evaluator, schedule: str, m: int, d: int, split: set[str]) -> float:
    """A bottleneck no plan of (schedule, m micro-batches, d replicas) on the evaluator's graph
    beats when only the layers named in `split` may be split, any way: `bound.lower_bound`
    on that shape's problem (no recomputation: it only adds work) with only their units
    splittable. The layer-split search prunes a trial with it (`passes.split_search`). 0.0
    when the shape has no problem (an interleaved m the ranks do not divide) or the device
    order is the planner's to choose (each order has its own bound)."""
    opt = ev.options
    assert isinstance(opt.batch_size, int)
    if opt.choose_order:
        return 0.0
    v = opt.virtual_stages if schedule in VIRTUAL else 1
    mb = rep.slice_size(opt.batch_size // m, d)
    units = ev.builder.at(mb)
    order = tuple(range(ev.p))
    try:
        prob = ev.problem(units, mb, schedule, m, order, v, None, d)
    except ValueError:
        return 0.0
    if d == 1:
        prob = ev.tables.bound_problem(prob, order, opt.batch_size // m)
    flags = [bool(sp) and any(name in split for name in names)
             for sp, names in zip(units.splittable, units.names)]
    return partition_lower_bound(prob, flags, split_bytes=split_floor(ev, units),
                                 split_fixed=piece_fixed(ev, order, d, len(prob.mem_cap)))


def piece_fixed(ev: Evaluator, order: Any, d: int, stages: int) -> np.ndarray:
    """[stage][unit] what every piece of a split unit pays again on the stage's devices
    (`bound.lower_bound`'s split_fixed, `CostTables.piece_fixed`): stage k on replica group
    k % P (P = len(order)/d, d = 1: the device order[k % P]); a group's least member (each
    member pays its own, the group the slowest)."""
    P = len(order) // d
    rows = [np.min([ev.tables.piece_fixed(x) for x in order[(k % P) * d:(k % P) * d + d]], axis=0)
            for k in range(P)]
    return np.stack([rows[k % P] for k in range(stages)])


def split_floor(ev: Evaluator, units: Any) -> list[float]:
    """[unit] the fewest bytes a cut inside a split of the unit sends (`bound.lower_bound`
    (5)): for a unit of one layer node (its parameters folded in), min(X[i], X[i+1]), the
    bytes crossing the boundaries before and after it. A cut between two of its shards
    (`passes.split_layers`, dim 0: every shard reads the layer's whole input) carries
    everything that crossed boundary i (what only the layer read is its input, which the
    later shards read), and the outputs of the shards before it (something, when the layer's
    output has bytes); one between the last shard and the combine carries X[i+1] (every shard's
    output, and what else crossed: at least the layer's output bytes after the last unit,
    where X[n] = 0 by convention). Any other unit: 0 (the rule without it)."""
    from pipecc.passes.partition import cut_bytes
    n = units.n
    X = np.zeros(n + 1)
    X[1:n] = cut_bytes(units.values["output_bytes"], units.last_use)
    groups = ev.builder.groups
    single = [len(groups) == n and sum(1 for node in groups[i] if node.op != "get_attr") == 1
              for i in range(n)]
    out = units.values["output_bytes"]
    end = list(X[1:n]) + [float(out[n - 1])] if n else []  # between the last shard and the combine
    return [float(min(max(X[i], 5e-324 if out[i] > 0 else 0.0), end[i])) if single[i] else 0.0
            for i in range(n)]


def baselines(ev: Evaluator, cand: Candidate) -> list[dict[str, Any]]:
    """The partitions other tools would produce, on the same cost model."""
    assert isinstance(ev.options.batch_size, int)
    units, prob = cand.units, cand.raw or cand.problem
    p, mb = len(prob.mem_cap), rep.slice_size(ev.options.batch_size // cand.microbatches, cand.replicas)
    fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
    ref_times = fwd[0] + bwd[0]
    out = []
    for name, bounds in [
        ("equal-count (torch.distributed.pipelining)", base_rules.equal_count(units.n, p)),
        ("equal-params (DeepSpeed parameters)", base_rules.equal_params(units.param_bytes, p)),
        ("block-partition by time (torchgpipe)", base_rules.block_partition(ref_times, p)),
    ]:
        _, part = ev.tables.recost(prob, bounds, cand.order, mb, cand.replicas)
        out.append({"name": name, "bounds": list(part.bounds), "bottleneck_s": part.bottleneck,
                    "fits_memory": bool(getattr(part, "fits", True))})
    return out


def _stage_shares(cand: Candidate) -> list[float]:
    """Interleaved (v stages per rank): each stage's peak memory as its share of the rank's: the
    partitioner's figure for the stage (`Partition.stage_memory`, planned against the device's
    memory / v) plus an even share of what the rank's simulated peak adds to their sum (the
    optimizer step's temporaries, `passes.step_memory`; the schedule's own in-flight counts), so
    that a rank's stages add up to its simulated peak (what `pipecc run --json --memory` compares)."""
    P, mem = cand.ranks, [float(x) for x in cand.part.stage_memory]
    out = list(mem)
    for r in range(P):
        ks = [k for k in range(len(mem)) if k % P == r]
        extra = (float(cand.timeline.peak_memory_bytes[r]) - sum(mem[k] for k in ks)) / len(ks)
        for k in ks:
            out[k] = mem[k] + extra
    return out


def to_plan(ev: Evaluator, cand: Candidate, lost: list[dict[str, Any]],
            search: SearchRecord, bounds: bool = True) -> Plan:
    """The Plan of `cand` (module docstring); `lost`: why every other candidate lost;
    `bounds` False: its lower bounds left 0 (a trial plan whose caller keeps its own)."""
    opt, tables, cluster = ev.options, ev.tables, ev.cluster
    assert isinstance(opt.batch_size, int)
    part, units, prob = cand.part, cand.units, cand.problem
    fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
    lb, lb_compute = (lower_bound(ev, cand), lower_bound(ev, cand, comm=False)) if bounds else (0.0, 0.0)
    d, P = cand.replicas, cand.ranks
    mb = rep.slice_size(opt.batch_size // cand.microbatches, d)
    weights = tables.weight_times(part, prob, cand.order, mb, d)
    shares = _stage_shares(cand) if cand.virtual > 1 else []
    stages = []
    for k in range(len(part.bounds) - 1):
        a, e = part.bounds[k], part.bounds[k + 1]
        names = [nm for u in range(a, e) for nm in units.names[u]]
        recv = part.cut_bytes[k - 1] if k > 0 else 0.0
        send = part.cut_bytes[k] if k < len(part.cut_bytes) else 0.0
        comm = 2 * prob.link_time(k - 1, recv) if k > 0 else 0.0
        comm += 2 * prob.link_time(k, send) if k < len(part.bounds) - 2 else 0.0
        dev = cand.order[(k % P) * d]
        fixed_f, fixed_b = prob.stage_fixed(k)  # the one cost model's fixed parts (plan_costs)
        unit_f, unit_b = tables.unit_fixed(dev)
        host_f, host_b = tables.stage_host(dev)  # the part of fixed_f/fixed_b outside the timers
        redo = bool(cand.recompute[k]) if cand.recompute else False
        stages.append(StagePlan(
            index=k, device=(k % P) * d, nodes=names,
            forward_s=float(fwd[k, a:e].sum()) + fixed_f,
            backward_s=float(bwd[k, a:e].sum()) + fixed_b,
            fixed_forward_s=float(unit_f[a:e].sum()) + fixed_f,
            fixed_backward_s=float(unit_b[a:e].sum() + (unit_f[a:e].sum() if redo else 0.0)) + fixed_b,
            step_s=tables.step_s(dev),
            host_forward_s=host_f, host_backward_s=host_b,
            backward_weight_s=weights[k],
            send_bytes=int(send), recv_bytes=int(recv), comm_s=float(comm),
            peak_memory_bytes=int(cand.timeline.peak_memory_bytes[k % P])
            if cand.virtual == 1 else int(shares[k]),
            forward_flops=int(units.values["forward_flops"][a:e].sum()),
            param_bytes=int(units.param_bytes[a:e].sum()),
            time_source=time_source(tables.costs[cand.order[(k % P) * d]], names),
            recompute=bool(cand.recompute[k]) if cand.recompute else False,
            replica_devices=list(range((k % P) * d, (k % P) * d + d)) if d > 1 else [],
            allreduce_s=float(cand.allreduce[k]) if cand.allreduce else 0.0))
    decisions = [f"schedule {cand.schedule} with {count(cand.microbatches, 'micro-batch')} of "
                 f"{opt.batch_size // cand.microbatches}: predicted "
                 f"{cand.timeline.iteration_s:.4g} s per iteration, bubble "
                 f"{cand.timeline.bubble_fraction:.1%}"]
    if cand.order != tuple(range(ev.p)):
        decisions.append(f"device order {list(cand.order)} (chosen among interchangeable types)")
    decisions += rep.decisions(tables, cand, search.results)
    decisions += profile_decisions(tables.costs, cluster, mb)
    decisions += calibration_decisions(tables.costs, mb)
    decisions += cand.notes  # e.g. which stages recompute their activations, and why
    if opt.precision != "fp32":
        decisions.append(f"precision {opt.precision}: every stage's forward and loss under torch.autocast; "
                         "activations counted in the dtype autocast gives them, messages in "
                         f"{opt.precision}, weights, gradients and optimizer state in float32, GPU time at "
                         f"the {opt.precision} peak (pipecc.cost_precision)")
    fields: dict[str, Any] = {}
    for search_part in techniques.parts("search"):
        said = search.notes.get(search_part.__name__, [])
        lines = getattr(search_part, "decision_lines", None)  # those of `cand` (BPipe: used or not, and why)
        decisions += lines(cand, said, search.estimate) if lines is not None else said
    for search_part in techniques.parts("search"):  # a technique's own plan fields (BPipe's pairs)
        plan_fields = getattr(search_part, "plan_fields", None)
        if plan_fields is not None:
            fields.update(plan_fields(cand))
    return Plan(
        model=ev.graph.model_name, batch_size=opt.batch_size,
        microbatches=cand.microbatches, schedule=cand.schedule,
        devices=[{"name": cluster.devices[x].name, "kind": cluster.devices[x].kind,
                  "placement": cluster.devices[x].placement, "given_index": x}
                 for x in cand.order],
        stages=stages, split_layers=[], bottleneck_s=float(part.bottleneck),
        lower_bound_s=float(lb), lower_bound_compute_s=float(lb_compute),
        predicted_iteration_s=float(cand.timeline.iteration_s),
        bubble_fraction=float(cand.timeline.bubble_fraction), dtype=opt.compute_dtype,
        estimate=dict(search.estimate),
        virtual_stages=cand.virtual, decisions=decisions, alternatives=lost, replicas=d,
        baselines=baselines(ev, cand) if opt.compare else [],
        options={"coarse": opt.coarse, "choose_order": opt.choose_order,
                 "training": opt.training, "recompute": opt.recompute,
                 "activation_balancing": opt.activation_balancing,
                 "flash_attention": opt.flash_attention, "precision": opt.precision,
                 "replicas_requested": opt.replicas,
                 **{k: x for c in tables.costs for k, x in c.plan_options().items()}},
        **fields)
