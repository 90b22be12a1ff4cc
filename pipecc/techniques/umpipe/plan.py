"""UMPIPE in the planner: per-chunk stage costs of a chosen plan, and `--microbatch-sizes`.

    plan (its partition, devices, schedule) ─► Curves: f_s(b), g_s(b), link times, memory for
    b = 1..B ─► search.search (auto) or the given list ─► the plan with per-stage
    `microbatch_sizes`, its predicted time (the recurrence) and a decision line

Per-chunk costs (PAPERS-SPEC.md §1.2, §1.6 "Cost model"): the one cost model's
(`passes.plan_costs.CostTables`), as the planner's own stages have them: `times(units_b, b)`
summed over the stage's units for every chunk size b (the roofline, or the profiled curves
`a + c·b` with `--profile`, each with its per-call fixed costs), plus the stage's
per-micro-batch fixed costs (`stage_fixed`) per chunk, `link_time` per message and the
per-iteration `step_s` as each stage's tail. Those fixed costs are what makes a split matter:
on a model linear in b every split would look the same in compute and UMPIPE would only ever
trade fill/drain against link latency. With equal sizes the curves give the planner's figures
(tests/test_one_cost_model.py).

The search prices a split under the plan's schedule (`pricing`): GPipe's recurrence, or the
event simulator over 1F1B's row order with unequal chunks (`schedule.one_f_one_b_uneven`,
PAPERS-SPEC.md §1.3), whose memory depends on the split.

Where UMPIPE applies is its rule, `pipecc.techniques.umpipe.requires` (a training plan under
GPipe's or 1F1B's row order, one stage per device, no replica groups, no recomputing stage, devices that take
chunks of different sizes: the runtime's and the recurrence's scope); `auto` says in the plan's
decisions why it did not try otherwise, an explicit list is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pipecc.errors import UsageError
from pipecc import techniques
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.registry import schedule_for
from pipecc.techniques.umpipe import search as umpipe
from pipecc.techniques.umpipe.data import UmpipeChunkCosts, UmpipeSearch
from pipecc.passes.contract import Contract, PlanContext, TechniqueStep
from pipecc.passes.partition import cut_bytes
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.passes.simulate import simulate

__all__ = ["STEP", "curves_for_plan", "apply", "parse_option", "base_options", "pricing", "step"]


def parse_option(text: str) -> str | list[int]:
    """`--microbatch-sizes`: "auto", "equal" or a comma list of positive ints (checked against
    the batch later, `check_given`)."""
    if text in ("auto", "equal"):
        return text
    try:
        return umpipe.parse_sizes(text)
    except ValueError as exc:
        raise UsageError(f"--microbatch-sizes: {exc}") from None


def check_given(sizes: Sequence[int], batch: int) -> None:
    """One-line usage errors for a list that is not a split of the batch."""
    text = ",".join(str(b) for b in sizes)
    if any(b <= 0 for b in sizes):
        bad = next(b for b in sizes if b <= 0)
        raise UsageError(f"--microbatch-sizes {text} has a size of {bad}; every size must be at "
                         "least 1")
    if sum(sizes) != batch:
        raise UsageError(f"--microbatch-sizes {text} sums to {sum(sizes)}, not the batch size {batch}")


def curves_for_plan(ev: Evaluator, plan: Plan) -> umpipe.Curves:
    """f_s(b), g_s(b), link times and memory of the plan's stages for b = 1..B (module
    docstring). `ev` must be built on the plan's graph (after layer splitting)."""
    B, p = plan.batch_size, len(plan.stages)
    order = [d.get("given_index", i) for i, d in enumerate(plan.devices)]
    devs = [order[s.device] for s in plan.stages]
    bounds = ev.builder.at(1).stage_bounds(plan.stages)
    tables = ev.tables
    fixed = [tables.stage_fixed(d) for d in devs]  # per chunk, whatever it holds
    f, g = np.zeros((p, B + 1)), np.zeros((p, B + 1))
    send_f, send_b = np.zeros((p, B + 1)), np.zeros((p, B + 1))
    mem, static, cap = np.zeros((p, B + 1)), np.zeros(p), np.zeros(p)
    for b in range(1, B + 1):
        units = ev.builder.at(b)
        fwd, bwd = tables.times(units, b)
        cuts = cut_bytes(units.values["output_bytes"], units.last_use)
        for k, d in enumerate(devs):
            a, e = bounds[k], bounds[k + 1]
            f[k, b] = fwd[d, a:e].sum() + fixed[k][0]
            g[k, b] = bwd[d, a:e].sum() + fixed[k][1]
            recv = cuts[a - 1] if k > 0 else 0.0
            memory = tables.costs[d].memory(units, 1)
            mem[k, b] = float(memory.act[a:e].sum()) + recv
            if b == 1:
                static[k], cap[k] = float(memory.static[a:e].sum()), float(memory.cap)
            if k < p - 1:
                nbytes = cuts[e - 1]
                send_f[k, b] = tables.link_time(d, devs[k + 1], nbytes)
                # the gradient of stage k's chunk goes back over the link from k+1 to k
                send_b[k + 1, b] = tables.link_time(devs[k + 1], d, nbytes)
    tail = np.array([tables.step_s(d) for d in devs])
    return umpipe.Curves(f, g, send_f, send_b, mem=mem, static=static, cap=cap,
                         tail=tail if tail.any() else None)


def _describe(sizes: Sequence[Sequence[int]]) -> str:
    return ", ".join(f"stage {s} {list(row)}" for s, row in enumerate(sizes))


def apply(plan: Plan, ev: Evaluator, mode: str | list[int], *, budget_s: float = 10.0) -> Plan:
    """The plan with `mode`'s micro-batch sizes: "auto" runs the GA on its partition and keeps
    the result when faster than the best equal split; a list is used for every stage. The
    plan's stage costs stay the planner's; `predicted_iteration_s`, `bubble_fraction`,
    `microbatches` (stage 0's chunk count) and stage peak memory follow the sizes. A new Plan,
    with the decision line either way: `plan` stays as it was (`pipecc.passes.contract`)."""
    plan = copy.deepcopy(plan)
    curves = curves_for_plan(ev, plan)
    B, p = plan.batch_size, len(plan.stages)
    price = pricing(curves, plan.schedule)
    if mode == "auto":
        res = umpipe.search(curves, budget_s=budget_s, most_chunks=64, price=price)
        base = (f"GA {res.generations} generations, {res.seconds:.1f} s; local greedy "
                f"{res.baselines['local-greedy'][1]:.4g} s, greedy DP {res.baselines['greedy-dp'][1]:.4g} s; "
                f"the planner's {plan.microbatches} equal micro-batches predict "
                f"{plan.predicted_iteration_s:.4g} s on the same cost model")
        if not res.unequal or res.T >= res.edp_T or not res.fits:
            plan.decisions.append(
                f"unequal micro-batches (UMPIPE): none faster than the best equal split "
                f"({len(res.edp_sizes)} of {res.edp_sizes[0]}: {res.edp_T:.4g} s; {base})")
            return plan
        sizes = res.sizes
        plan.decisions.append(
            f"unequal micro-batches (UMPIPE): {_describe(sizes)}: predicted {res.T:.4g} s vs "
            f"{res.edp_T:.4g} s for the best equal split ({len(res.edp_sizes)} of "
            f"{res.edp_sizes[0]}; {res.gain:+.1%}); {base}")
        plan = plan.with_data(UmpipeSearch(
            generations=res.generations, seconds=res.seconds, stopped=res.stopped, edp_s=res.edp_T,
            edp_sizes=res.edp_sizes,
            baselines={k: {"sizes": v[0], "iteration_s": v[1]} for k, v in res.baselines.items()}))
    else:
        check_given(mode, B)
        if len(set(mode)) == 1 and plan.microbatches == len(mode):
            plan.decisions.append(f"micro-batch sizes {list(mode)} (--microbatch-sizes): the "
                                  f"equal split into {len(mode)}, as planned")
            return plan
        sizes = [list(mode) for _ in range(p)]
        m = len(mode)
        versus = ""
        if B % m == 0:
            t_eq = float(price.times([[[B // m] * m] * p])[0])
            versus = f" vs {t_eq:.4g} s for {m} equal micro-batches"
        plan.decisions.append(
            f"micro-batch sizes {list(mode)} on every stage (--microbatch-sizes, {plan.schedule}): predicted "
            f"{float(price.times([sizes])[0]):.4g} s{versus}")
    costs = umpipe.stage_costs(sizes, curves)
    timeline = simulate(schedule_for(plan.schedule, len(sizes), max(len(r) for r in sizes), microbatch_sizes=sizes),
                        costs)
    # NOTE: the stage table's forward_s/backward_s stay the planner's figures at its equal
    # micro-batch; the per-chunk seconds the prediction used travel with the plan (reports
    # rebuild the timeline from them: `pipecc.report.artifacts.timeline_for`)
    plan = plan.with_data(UmpipeChunkCosts(
        stage_figures_microbatch=B // max(plan.microbatches, 1),
        **{k: getattr(costs, k) for k in ("forward_s", "backward_s", "send_forward_s",
                                          "send_backward_s", "activation_bytes", "static_bytes",
                                          "tail_s")}))
    plan.microbatch_sizes = [list(row) for row in sizes]
    plan.microbatches = len(sizes[0])
    plan.predicted_iteration_s = float(timeline.iteration_s)
    plan.bubble_fraction = float(timeline.bubble_fraction)
    for s, peak in zip(plan.stages, timeline.peak_memory_bytes):
        s.peak_memory_bytes = int(peak)
    return plan


def pricing(curves: umpipe.Curves, schedule: str) -> umpipe.GPipePricing | umpipe.SimulatedPricing:
    """How the search prices a split under `schedule`: GPipe's recurrence, or the event
    simulator for 1F1B's row order (`search`'s docstring)."""
    return umpipe.GPipePricing(curves) if schedule == "gpipe" else umpipe.SimulatedPricing(curves, schedule)


def base_options(options: Any, batch: int) -> dict[str, Any]:
    """The driver's hook as it resolves the planner's options (`pipecc.driver.resolve_options`):
    the fields a `--microbatch-sizes S1,S2,...` list fixes (the sizes parsed, the base plan's
    schedule, replicas and micro-batch count: `_base`); none for "auto" and "equal"."""
    sizes: Any = options.microbatch_sizes
    if isinstance(sizes, str) and sizes not in ("auto", "equal"):
        sizes = parse_option(sizes)
    if isinstance(sizes, str):
        return {}
    sizes = [int(b) for b in sizes]
    schedule, replicas, microbatches = _base(
        sizes, options.schedule, options.replicas, options.microbatches, options.training, batch)
    return dict(microbatch_sizes=sizes, schedule=schedule, replicas=replicas, microbatches=microbatches)


def _base(sizes: Any, schedule: str, replicas: int | str, microbatches: int | str,
          training: bool, batch: int) -> tuple[str, int | str, int | str]:
    """(schedule, replicas, microbatches) for the base plan of `--microbatch-sizes S1,S2,...`
    (gpipe unless 1f1b is asked for); one-line usage errors for what cannot take it."""
    text = ",".join(map(str, sizes))
    check_given(sizes, batch)
    # NOTE: the devices are not known yet (the driver asks again on the chosen plan)
    draft = techniques.sketch(schedule="gpipe" if schedule == "auto" else schedule, devices=[{}, {}],
                              training=training, replicas=1 if replicas == "auto" else int(replicas))
    why = techniques.umpipe.requires(draft, techniques.COMPILED)
    if why is not None:
        raise UsageError(f"--microbatch-sizes {text}: {why}")
    if microbatches not in ("auto", len(sizes)):
        raise UsageError(f"--microbatches {microbatches} conflicts with --microbatch-sizes {text} "
                         f"({len(sizes)} sizes); give one of them")
    m: int | str = len(sizes) if batch % len(sizes) == 0 else "auto"
    return ("gpipe" if schedule == "auto" else schedule), 1, m


def step(state: Any, ctx: PlanContext) -> None:
    """The driver's "unequal micro-batches" step, on the chosen plan's partition: "auto" searches
    per-stage micro-batch sizes when the plan allows them (else says why not), a list is used
    as given (`apply`)."""
    mode = ctx.options.microbatch_sizes
    assert state.plan is not None and state.graph is not None
    why = techniques.umpipe.requires(state.plan, techniques.COMPILED)
    if why is not None:
        if mode != "auto":  # NOTE: the CLI forced gpipe, replicas 1: only the model can refuse
            raise UsageError(f"--microbatch-sizes {','.join(map(str, mode))}: {why}")
        state.plan = dataclasses.replace(state.plan, decisions=[*state.plan.decisions, f"UMPIPE not tried: {why}"])
        return
    state.plan = apply(state.plan, ctx.evaluator(state.graph), mode, budget_s=ctx.options.umpipe_budget_s)


STEP = TechniqueStep(
    Contract("unequal micro-batches", ("graph", "costs", "plan", "cluster", "options"), ("plan",),
             "pipecc.techniques.umpipe.plan:apply"),
    "searching unequal micro-batch sizes", lambda options: options.microbatch_sizes != "equal", step)
