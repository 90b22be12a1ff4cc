"""Activation recomputation: which stages re-run their forward during backward (`--recompute`).

A recomputed stage keeps only what it received per micro-batch in flight and re-creates its
internal activations during each backward (torch.utils.checkpoint in its generated forward;
GPipe's rematerialisation, PAPERS-SPEC §1.4; Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"). The cost model: its backward costs its backward plus one more forward,
its memory is `static + Σ act (one micro-batch, while recomputing) + inflight · received bytes`
instead of `static + inflight · (Σ act + received bytes)` (`passes.partition`'s M_k, the
simulator's `recompute_bytes`).

Modes (`PlanOptions.recompute`):
  * "none": no stage recomputes (the default).
  * "full": every stage recomputes.
  * "auto": per (schedule, micro-batches) candidate, the plan without recomputation first;
    where memory binds (the cuts a memory-blind partition would choose overflow some stage, or
    nothing fits at all) the stages over their cap recompute, falling back to every stage when
    that is not enough; recomputing stages that then fit without it are dropped again when the
    plan stays feasible and no slower. The faster of the two plans wins, and `decisions` say
    which stages recompute and why ("stage 2 recomputes its activations: 41.2 GB > 36 GB
    without").

Refused (one line): what `pipecc.techniques.recompute.requires` refuses (recomputation in a
forward-only plan; "full" on a device that cannot recompute, an FPGA card's dataflow hardware:
"auto" never picks those, `caps.RECOMPUTE`) and, needing the graph (`graph_requires`), "full"
on a model with BatchNorm in training mode (recomputing updates its running statistics a second
time; "auto" never picks a stage that holds one).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from pipecc.errors import UsageError
from pipecc import techniques
from pipecc.ir.graph import AnnotatedGraph, training_batchnorm_names
from pipecc.ir.schedule.registry import VIRTUAL
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps
from pipecc.passes.partition import InfeasibleError, evaluate, partition
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.techniques.replicas.search import slice_size

MODES = ("none", "full", "auto")


def check(ev: Evaluator) -> None:
    """UsageError (one line) for a `--recompute` mode these devices or this model cannot take."""
    mode = ev.options.recompute
    if mode not in MODES:
        raise UsageError(f"--recompute {mode!r}: choose none, full or auto")
    if mode == "none":
        return
    # "auto" recomputes only stages whose devices can, so only its forward-only rule applies
    draft = techniques.sketch(schedule="1f1b", devices=ev.cluster.devices, recompute=True,
                              training=ev.options.training)
    caps = techniques.COMPILED if mode == "full" else techniques.Capabilities(kinds={})
    why = techniques.recompute.requires(draft, caps)
    if why is not None:
        raise UsageError(f"--recompute {mode}: {why}")
    if mode != "full":
        return
    bn = training_batchnorm_names(ev.graph)
    if bn:
        raise UsageError(f"--recompute full: BatchNorm {bn[0]} in training mode would update its "
                         "running statistics twice when its stage recomputes; use --recompute "
                         "auto, which recomputes only stages without BatchNorm")


def graph_requires(graph: AnnotatedGraph, plan: Plan) -> str | None:
    """The part of recomputation's rule that needs the graph (`pipecc.techniques.recompute`
    has the rest): a recomputed stage holding BatchNorm in training mode would update its
    running statistics twice. None when no such stage."""
    marked = [s for s in plan.stages if s.recompute]
    bn = set(training_batchnorm_names(graph)) if marked else set()
    for s in marked:
        held = [n for n in s.nodes if n in bn]
        if held:
            return (f"stage {s.index} recomputes activations but holds BatchNorm {held[0]} in training mode, "
                    "whose running statistics would be updated twice; plan with --recompute auto or none")
    return None


def candidate(ev: Evaluator, schedule: str, m: int, d: int = 1) -> Candidate | None:
    """The planner's hook for each candidate it tries (`passes.plan_search`): the candidate
    (schedule, m, d replicas) under the options' recompute mode (module docstring); None with
    "none" (the evaluator's plain candidate)."""
    check(ev)
    mode = ev.options.recompute
    n = ev.p // d * (ev.options.virtual_stages if schedule in VIRTUAL else 1)
    if mode == "none":
        return None
    if mode == "full":
        cand = ev.evaluate(schedule, m, recompute=[True] * n, d=d)
        cand.notes.append("every stage recomputes its activations (--recompute full)")
        return cand
    return _auto(ev, schedule, m, n, d)


def nothing_fits(ev: Evaluator, schedule: str, m: int, reason: str, d: int = 1) -> str:
    """The planner's hook when no candidate fits (`passes.plan_search`): `reason` (why
    (schedule, m) fits no memory) plus "or recompute activations" when the mode is "none" and
    recomputing every stage that may would fit it."""
    if ev.options.recompute != "none" or not ev.options.training or "no split fits memory" not in reason:
        return reason
    n = ev.p // d * (ev.options.virtual_stages if schedule in VIRTUAL else 1)
    if _feasible(ev, schedule, m, _allowed(ev, n, tuple(range(ev.p)), d), d) is None:
        return reason
    return f"{reason}, or recompute activations (--recompute auto)"


def _auto(ev: Evaluator, schedule: str, m: int, n: int, d: int = 1) -> Candidate:
    base: Candidate | None = None
    error: InfeasibleError | None = None
    try:
        base = ev.evaluate(schedule, m, d=d)
    except InfeasibleError as exc:
        error = exc
    allowed = _allowed(ev, n, base.order if base is not None else tuple(range(ev.p)), d)
    over = _over_cap_roomy(ev, schedule, m, n, d)
    want = [o and a for o, a in zip(over, allowed)]
    if base is not None and not any(want):
        return base  # memory does not bind: nothing to gain
    best = None
    for flags in (want, allowed):
        if not any(flags):
            continue
        best = _feasible(ev, schedule, m, flags, d)
        if best is not None:
            break
    if best is not None:  # drop recomputation where the chosen cuts fit without it
        best = _fewer(ev, schedule, m, best, d)
    if best is None:
        if error is not None:
            raise error
        return base  # type: ignore[return-value]
    if base is not None and base.timeline.iteration_s <= best.timeline.iteration_s:
        return base
    best.notes += _why(best, base)
    return best


def _allowed(ev: Evaluator, n: int, order: Sequence[int], d: int = 1) -> list[bool]:
    """Stages that may recompute: on a device that can (`caps.RECOMPUTE`: not an FPGA card's
    dataflow hardware; replica groups, d > 1, never hold one)."""
    if d > 1:
        return [True] * n
    return [ev.cluster.devices[order[k % ev.p]].can(caps.RECOMPUTE) for k in range(n)]


def _over_cap_roomy(ev: Evaluator, schedule: str, m: int, n: int, d: int = 1) -> list[bool]:
    """Stages that overflow their memory at the cuts a memory-blind partition chooses."""
    v = n // (ev.p // d)
    mb = slice_size(ev.options.batch_size // m, d)
    prob = ev.problem(ev.builder.at(mb), mb, schedule, m, tuple(range(ev.p)), v, d=d)
    roomy = dataclasses.replace(prob, mem_cap=[float("inf")] * len(prob.mem_cap))
    try:
        part = evaluate(prob, partition(roomy).bounds)
    except InfeasibleError:
        return [False] * n
    return [mem > cap for mem, cap in zip(part.stage_memory, prob.mem_cap)]


def _feasible(ev: Evaluator, schedule: str, m: int, flags: list[bool], d: int = 1) -> Candidate | None:
    """The candidate with `flags` recomputing, minus recomputation on BatchNorm stages (a stage
    holding training-mode BatchNorm must not recompute); None if nothing fits."""
    bn = set(training_batchnorm_names(ev.graph))
    flags = list(flags)
    for _ in range(len(flags) + 1):
        try:
            cand = ev.evaluate(schedule, m, recompute=flags, d=d)
        except InfeasibleError:
            return None
        bad = [k for k, names in enumerate(_stage_names(cand)) if flags[k] and bn & set(names)]
        if not bad:
            return cand
        for k in bad:
            flags[k] = False
        if not any(flags):
            return None
    return None


def _fewer(ev: Evaluator, schedule: str, m: int, cand: Candidate, d: int = 1) -> Candidate:
    """`cand` with recomputation only on the stages whose memory at its cuts needs it, when that
    plan is feasible and no slower."""
    need = [r and over for r, over in zip(cand.recompute, _over_without(cand))]
    if list(need) == list(cand.recompute) or not any(need):
        return cand
    fewer = _feasible(ev, schedule, m, need, d)
    if fewer is not None and fewer.timeline.iteration_s <= cand.timeline.iteration_s:
        return fewer
    return cand


def _memory_without(cand: Candidate) -> tuple[float, ...]:
    """Each stage's memory at `cand`'s cuts if no stage recomputed."""
    return evaluate(dataclasses.replace(cand.problem, recompute=None), cand.part.bounds).stage_memory


def _over_without(cand: Candidate) -> list[bool]:
    caps = cand.problem.mem_cap
    return [mem > cap for mem, cap in zip(_memory_without(cand), caps)]


def _stage_names(cand: Candidate) -> list[list[str]]:
    b = cand.part.bounds
    return [[nm for u in range(b[k], b[k + 1]) for nm in cand.units.names[u]]
            for k in range(len(b) - 1)]


def _why(cand: Candidate, base: Candidate | None) -> list[str]:
    """One decision line per recomputing stage, and what the plan without it would have done."""
    gb = lambda x: f"{x / 1e9:.3g} GB"  # noqa: E731
    out = []
    for k, (r, mem, cap) in enumerate(zip(cand.recompute, _memory_without(cand), cand.problem.mem_cap)):
        if not r:
            continue
        if mem > cap:
            out.append(f"stage {k} recomputes its activations: {gb(mem)} > {gb(cap)} without")
        else:
            out.append(f"stage {k} recomputes its activations ({gb(mem)} of {gb(cap)} without): "
                       "recomputing fewer stages did not fit or was slower")
    if base is None:
        out.append("without recomputation no placement fits memory (--recompute auto)")
    else:
        out.append(f"recomputation is faster here: {cand.timeline.iteration_s:.4g} s per iteration "
                   f"vs {base.timeline.iteration_s:.4g} s without (memory forced its cuts)")
    return out
