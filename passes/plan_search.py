"""The balance search: choose schedule, micro-batch count, replication degree and cuts.

    costed graph + cluster ─► cost tables (passes.plan_costs) ─► for each (schedule, m, d):
    evaluate (passes.plan_evaluate: problem ─► exact partition ─► simulate), through the
    recompute pass's mode ─► BPipe weighed against the best (pipecc.techniques.bpipe.search) ─► the fastest
    that fits memory ─► Plan (passes.plan_emit)

The techniques' searches join it through their `search` parts' optional hooks
(`pipecc.techniques` protocol), each called in `TECHNIQUES` order, never by name:
`before_search(ev)` before any candidate (BPipe's mode checks), `schedules(options, names)` on
the schedules to try (BPipe forced keeps 1f1b), `candidate(ev, schedule, m, d)`
for each (the first that returns one; else the evaluator's plain candidate: recomputation's
modes), `after_search(ev, results, tried)` on the ranked results (BPipe weighed against them;
its decision lines kept per technique in `SearchRecord.notes`),
`nothing_fits(ev, schedule, m, reason, d)` on the reason when none fits (recomputation's fix).
The replica groups (`techniques.replicas.search`) are the search's own dimension, d.

Layer splitting (`passes.split_search`), unequal micro-batches (`techniques.umpipe.plan`) and
separate forward/backward cuts (`techniques.bipartition.plan`) run after it, on its plan, as the
driver's later steps. `Planner` holds one search's state (its candidates, best first, and the
BPipe estimate); the numbers are the evaluator's. `ranked(k)` lists the k best distinct
candidates (`pipecc tune` measures them) without changing the choice.

No stage with negligible compute (issue 20): a candidate with a stage doing under
`NEGLIGIBLE_SHARE` of its busiest stage's compute (GPT's stage 0 holding only `idx.size(1)`)
ranks after every candidate without one, whatever it predicts; it is chosen only when no other
placement on these devices fits, and the plan says so. (Whether fewer devices do better is the
driver's `fewer devices` step, `passes.device_count`.)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import numpy as np

from pipecc.errors import PipeccError, UsageError
from pipecc import techniques
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.registry import TRAINING_SCHEDULES, VIRTUAL, ZERO_BUBBLE
from pipecc.techniques import capabilities as caps
from pipecc.techniques.replicas import search as rep
from pipecc.passes.partition import InfeasibleError, partition
from pipecc.targets.timing import CANNOT_RUN_S
from pipecc.passes.plan_costs import CostTables
from pipecc.passes.plan_emit import SearchRecord, to_plan
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.passes.plan_options import PlanOptions
from pipecc.report.formatting import count
from pipecc.targets.hardware import Cluster

__all__ = ["NEGLIGIBLE_SHARE", "Planner", "negligible_stages"]

# A design threshold, not a cost figure: a stage computing under 1 % of what its pipeline's
# busiest stage computes holds a device (and a message each way) for nothing worth a rank
NEGLIGIBLE_SHARE = 0.01


def negligible_stages(stage_s: Sequence[float]) -> list[int]:
    """The stages (indices) of a pipeline whose compute seconds `stage_s` are negligible: under
    `NEGLIGIBLE_SHARE` of the busiest one's. None with one stage."""
    top = max(stage_s, default=0.0)
    if len(stage_s) < 2 or top <= 0:
        return []
    return [k for k, t in enumerate(stage_s) if t < NEGLIGIBLE_SHARE * top]


def stage_seconds(cand: Candidate) -> list[float]:
    """[stage] forward + backward seconds of `cand`'s stages on their devices."""
    b, fwd, bwd = cand.part.bounds, np.asarray(cand.problem.fwd), np.asarray(cand.problem.bwd)
    return [float(fwd[k, b[k]:b[k + 1]].sum() + bwd[k, b[k]:b[k + 1]].sum()) for k in range(len(b) - 1)]


def _rank_key(c: Candidate) -> tuple[bool, float, int, int]:
    return (bool(negligible_stages(stage_seconds(c))), c.timeline.iteration_s, c.microbatches, c.replicas)


class Planner:
    """One balance search over `graph` on `cluster` (module docstring): `run()` returns the
    Plan and the candidate it was written from; `results` then holds every feasible candidate,
    best first, and `infeasible` why the others fit nothing."""

    def __init__(self, graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions,
                 splittable: Sequence[str] = (), bounds: bool = True) -> None:
        self.tables = CostTables(graph, cluster, options, splittable)
        # False: the plan's lower bounds are left 0 (the layer-split search's trial plans: it
        # keeps the unsplit plan's bound, which covers every split, and drops theirs)
        self.bounds = bounds
        self.evaluator = Evaluator(self.tables)
        self.options, self.cluster, self.p = options, cluster, self.tables.p
        self.record = SearchRecord()
        self.infeasible: list[dict[str, Any]] = []

    @property
    def results(self) -> list[Candidate]:
        return self.record.results

    def candidates(self) -> list[tuple[str, int, int]]:
        """(schedule, micro-batches, replicas) to try: every schedule and m, each with every
        replication degree d allowed (`techniques.replicas.search.allowed`); P = n/d pipeline ranks. One
        rank (plain data parallelism) has one meaningful schedule: 1f1b."""
        opt, p, devices = self.options, self.p, self.cluster.devices
        assert isinstance(opt.batch_size, int)
        b = opt.batch_size
        if opt.microbatches == "auto":
            ms = [m for m in range(1, b + 1) if b % m == 0 and m <= 64]
        else:
            m = int(opt.microbatches)
            if m < 1 or b % m:
                if "B" not in self.tables.graph.symbols and m > 1:  # a batch the model fixes (a static ONNX dim)
                    fixed = self.tables.graph.gm.meta.get("pipecc.fixed_batch")
                    raise UsageError(f"--microbatches {m}: the model has a fixed batch"
                                     f"{f' of {fixed}' if fixed else ''} (its input's first dim is not symbolic), "
                                     "which pipecc does not split; give --microbatches 1, or export it with a "
                                     "symbolic batch dim")
                raise UsageError(f"--microbatches {m} must divide the batch size {b}")
            ms = [m]
        unreplicable = [dev.name for dev in devices if not dev.can(caps.REPLICATE)]
        rep.check_requested(opt.replicas, p, devices)
        rep.check_slices(opt.replicas, b, ms)
        n_units = len(self.tables.builder.groups)

        allowed = {m: rep.allowed(opt.replicas, p, b // m, bool(unreplicable)) for m in ms}
        if not any(p // d <= n_units for ds in allowed.values() for d in ds):
            groups = [d for d in rep.allowed("auto", p, b // min(ms), bool(unreplicable))
                      if p // d <= n_units]  # would replica groups fit?
            raise PipeccError(f"{p} devices but only {n_units} units to place; use fewer "
                              "devices" + (" or --replicas auto" if groups else ""))

        def degrees(m: int) -> list[int]:
            return [d for d in allowed[m] if p // d <= n_units]
        if not opt.training:
            return [("inference", m, d) for m in ms for d in degrees(m)]
        scheds = TRAINING_SCHEDULES if opt.schedule == "auto" else (opt.schedule,)

        def refused(s: str) -> str | None:  # the zero-bubble rule on these devices (the one the sketch uses)
            return techniques.requires(techniques.sketch(schedule=s, devices=devices), techniques.COMPILED)
        if opt.schedule in ZERO_BUBBLE and refused(opt.schedule):
            raise UsageError(f"--schedule {opt.schedule}: {refused(opt.schedule)}")
        # auto: a zero-bubble schedule these devices cannot run is no candidate
        scheds = tuple(s for s in scheds if s not in ZERO_BUBBLE or not refused(s))
        out = []
        for s in scheds:
            for m in ms:
                for d in degrees(m):
                    P = p // d
                    if s in VIRTUAL and (m % P or opt.virtual_stages < 2 or P == 1):
                        continue
                    if P == 1 and s != "1f1b" and opt.schedule == "auto":
                        continue  # one rank: gpipe is 1f1b holding every micro-batch at once
                    out.append((s, m, d))
        if not out:
            raise UsageError(f"--schedule interleaved needs a micro-batch count divisible by "
                             f"{p} devices")
        return out

    def run(self) -> tuple[Plan, Candidate]:
        ev = self.evaluator
        for before in techniques.hooks("search", "before_search"):
            before(ev)
        results: list[Candidate] = []
        lost: list[dict[str, Any]] = []
        tried = self.candidates()
        names = list(dict.fromkeys(s for s, m, d in tried))
        for keep in techniques.hooks("search", "schedules"):  # a technique that needs some schedules (BPipe forced: 1f1b)
            names = keep(self.options, names)
        tried = [c for c in tried if c[0] in names]
        for schedule, m, d in tried:
            try:
                cand = self.evaluate(schedule, m, d)
                results.append(self.spread(cand) or cand)
            except InfeasibleError as exc:
                lost.append({"schedule": schedule, "microbatches": m, "replicas": d,
                             "reason": str(exc)})
        results.sort(key=_rank_key)  # a negligible stage ranks last (module docstring)
        notes: dict[str, list[str]] = {}
        estimate: dict[str, Any] = {}
        for part in techniques.parts("search"):
            after = getattr(part, "after_search", None)
            if after is not None:
                results, notes[part.__name__], found = after(ev, results, tried)
                estimate.update(found)
        self.record = SearchRecord(results, estimate, notes)
        if not results:
            reason = lost[0]["reason"] if lost else "no candidate"
            if lost:  # a technique's way out, e.g. would recomputing activations fit it?
                for nothing_fits in techniques.hooks("search", "nothing_fits"):
                    reason = nothing_fits(ev, lost[0]["schedule"], lost[0]["microbatches"], reason,
                                          lost[0].get("replicas", 1))
            if "on-chip BRAM" in reason:
                reason += ("; an FPGA stage keeps its weights on chip: let pipecc place it "
                           "(--choose-order) or use a narrower --fpga-number such as ap_fixed<16,6>")
            raise PipeccError(reason if reason.startswith(("FPGA", "no placement", "every placement"))
                              else f"no schedule fits memory: {reason}")
        self.infeasible = lost
        best = results[0]
        return self.to_plan(best), best

    def evaluate(self, schedule: str, m: int, d: int) -> Candidate:
        """The candidate (schedule, m, d replicas): the first technique's `candidate` hook that
        gives one (module docstring), else the evaluator's plain candidate. InfeasibleError
        when nothing fits."""
        for candidate in techniques.hooks("search", "candidate"):
            cand = candidate(self.evaluator, schedule, m, d)
            if cand is not None:
                return cand
        return self.evaluator.evaluate(schedule, m, d=d)

    def to_plan(self, cand: Candidate) -> Plan:
        """The Plan of `cand`, with why every other candidate lost (`alternatives`)."""
        plan = to_plan(self.evaluator, cand, self.alternatives(cand), self.record, bounds=self.bounds)
        idle = negligible_stages(stage_seconds(cand))
        if idle:
            plan.decisions.append(
                f"stage {', '.join(map(str, idle))} computes under {NEGLIGIBLE_SHARE:.0%} of the busiest "
                f"stage: no placement on {count(self.p, 'device')} without such a stage fits")
        return plan

    def spread(self, c: Candidate) -> Candidate | None:
        """`c` re-cut so that its first and last stages each compute at least `NEGLIGIBLE_SHARE`
        of the whole (cuts that would leave them less are blocked), costed and simulated like
        the evaluator's own; None when `c` has no negligible stage, when it is not a plain
        pipeline of one stage per rank, or when no such cut fits (a negligible middle stage
        is left as it is: blocking one cut cannot bound a stage between two)."""
        if not negligible_stages(stage_seconds(c)) or c.virtual != 1 or c.thresholds:
            return None
        raw = c.raw or c.problem
        fwd, bwd = np.asarray(raw.fwd), np.asarray(raw.bwd)
        stages, n = fwd.shape[0], fwd.shape[1]
        first, last = fwd[0] + bwd[0], fwd[-1] + bwd[-1]
        head = np.concatenate(([0.0], np.cumsum(first)))            # [j] stage 0 = units 0..j-1
        tail = np.concatenate((np.cumsum(last[::-1])[::-1], [0.0]))  # [j] last stage = units j..
        mask = [list(row) for row in raw.blocked] if raw.blocked is not None else \
            [[False] * (n + 1) for _ in range(stages - 1)]
        for j in range(n + 1):
            mask[0][j] = mask[0][j] or bool(head[j] < NEGLIGIBLE_SHARE * head[-1])
            mask[-1][j] = mask[-1][j] or bool(tail[j] < NEGLIGIBLE_SHARE * tail[0])
        try:
            part = partition(dataclasses.replace(raw, blocked=mask))
        except InfeasibleError:
            return None
        if part.bottleneck >= CANNOT_RUN_S:
            return None
        ev, d = self.evaluator, c.replicas
        assert isinstance(self.options.batch_size, int)
        mb = rep.slice_size(self.options.batch_size // c.microbatches, d)
        prob, part = ev.tables.recost(raw, part.bounds, c.order, mb, d)
        allreduce = rep.stage_allreduce_s(ev.tables, c.units, part.bounds, c.order, d) if d > 1 else None
        timeline = ev.simulate(part, prob, c.schedule, c.microbatches, 1, order=c.order, allreduce=allreduce)
        out = dataclasses.replace(c, part=part, problem=prob, timeline=timeline,
                                  allreduce=list(allreduce or []))
        return None if negligible_stages(stage_seconds(out)) else out

    def ranked(self, k: int) -> list[Candidate]:
        """The `k` best distinct candidates, best first (after `run`): distinct in schedule,
        micro-batches, replicas or cuts. The first is the one `run` chose."""
        out: list[Candidate] = []
        seen: set[tuple[Any, ...]] = set()
        for c in self.results:
            key = (c.schedule, c.microbatches, c.replicas, tuple(c.part.bounds), c.thresholds, c.recompute)
            if key not in seen:
                seen.add(key)
                out.append(c)
            if len(out) >= k:
                break
        return out

    def alternatives(self, chosen: Candidate) -> list[dict[str, Any]]:
        """Why every other (schedule, micro-batches) lost to `chosen` (before layer splits)."""
        out = list(self.infeasible)
        for c in self.results:
            if c is not chosen:
                idle = negligible_stages(stage_seconds(c))
                why = (f"stage {idle[0]} would compute under {NEGLIGIBLE_SHARE:.0%} of the busiest "
                       f"stage ({c.timeline.iteration_s:.4g} s per iteration)" if idle and not
                       negligible_stages(stage_seconds(chosen)) else
                       f"slower: {c.timeline.iteration_s:.4g} s per iteration "
                       f"(bubble {c.timeline.bubble_fraction:.1%}) vs "
                       f"{chosen.timeline.iteration_s:.4g} s")
                out.append({"schedule": c.schedule, "microbatches": c.microbatches,
                            "replicas": c.replicas, "reason": why})
        return out

    def contenders(self, within: float = math.inf, most: int = len(TRAINING_SCHEDULES)) -> list[Candidate]:
        """The fastest candidate of each schedule within `within` of the best (at most
        `most`, best first): layer splitting may reorder these, so each gets split. (A
        replicated candidate competes under its schedule's name like any other.)"""
        out: list[Candidate] = []
        top = self.results[0].timeline.iteration_s
        for c in self.results:
            if c.timeline.iteration_s > top * (1 + within) or len(out) >= most:
                break
            if all(o.schedule != c.schedule for o in out):
                out.append(c)
        return out

    def unit_times(self, cand: Candidate) -> dict[str, float]:
        """Each single-node unit's fwd+bwd time on its fastest device, by node name."""
        assert isinstance(self.options.batch_size, int)
        mb = rep.slice_size(self.options.batch_size // cand.microbatches, cand.replicas)
        return self.tables.unit_times(cand.units, mb)
