"""Measured tuning (`pipecc tune`): compile several plans, run each a few steps, keep the fastest.

    candidates(analysis, cluster, options, k)   the planner's choice, its next best distinct
                                                candidates (k in all), and the baselines:
                                                equal-count, torch.distributed.pipelining's
                                                split, data parallelism (where they fit)
    measure(cands, workdir, steps, timeout, budget_s)
                                                compile each into workdir/cand_<i>, run it
                                                (`pipecc run --json` in its own process group),
                                                its median step time, or why it failed

Order: the planner's choice, the baselines, the planner's next best (a `--budget-s` skips from
the end). The tuned plan is never measured slower than a baseline that fit and ran.
A candidate is a `Candidate` (label, plan, graph). Distinct: another device set, schedule,
micro-batch count, replica count or stage cut (`key`). The baselines use the planner's best
plain-pipeline schedule and micro-batch count over all devices, with their tool's cuts:
  * equal-count: the same number of graph nodes per stage;
  * torch.distributed.pipelining: a `pipe_split` every n/p layers, the manual split its
    documentation shows (torch 2.13 has no automatic splitter), as units of the planner's
    graph (`passes.baselines.equal_count`, the --compare row of the same name);
  * data parallelism: one stage replicated on every device (`--replicas p`).

A candidate that fails to compile, fails to run or hangs (no result within `timeout`: its
whole process group is stopped) is reported with its reason and skipped; past `budget_s`
(counted from the first compile) no new candidate starts, the planner's choice always does.
The work folder is removed on the way out, on an error and on Ctrl-C alike.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.passes.plan_options import PlanOptions

__all__ = ["Candidate", "candidates", "key", "measure", "table"]

FAILED, TIMEOUT, SKIPPED, OK = "failed", "timeout", "skipped", "ok"
RUN_COMMAND = [sys.executable, "-m", "pipecc.cli", "run"]  # a candidate's run (tests replace it)
GRACE_S = 30.0  # a candidate may take 2 x --timeout + this before it is stopped (start-up, steps)


@dataclass
class Candidate:
    """One plan to measure and what became of it."""

    label: str
    plan: Plan
    graph: AnnotatedGraph
    status: str = ""               # ok, failed, timeout, skipped ("" not yet run)
    measured_s: float | None = None  # median step seconds (`pipecc run --json`'s step_s.median)
    reason: str = ""
    folder: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def predicted_s(self) -> float:
        return float(self.plan.predicted_iteration_s)

    def shape(self) -> str:
        p = self.plan
        stages = len(p.stages)
        ranks = stages // max(1, p.virtual_stages) * p.replicas
        return (f"{stages} stage{'s' if stages > 1 else ''}" + (f" x {p.replicas} replicas" if p.replicas > 1 else "")
                + f" on {ranks} device{'s' if ranks > 1 else ''}")


def key(plan: Plan) -> tuple[Any, ...]:
    """What makes two plans distinct: devices, schedule, micro-batches, replicas, cuts."""
    return (tuple(int(d.get("given_index", i)) for i, d in enumerate(plan.devices)), plan.schedule,
            plan.microbatches, plan.replicas, tuple(tuple(s.nodes) for s in plan.stages),
            tuple((s.node, s.parts) for s in plan.split_layers), bool(plan.activation_balancing),
            json.dumps(plan.microbatch_sizes))


def candidates(analysis: Any, cluster: Any, options: PlanOptions, k: int, *, debug: bool = False,
               note: Callable[[str], None] = lambda _: None) -> list[Candidate]:
    """The planner's choice first, then the baselines that fit and are not already listed, then
    the planner's next best distinct candidates (k of its own in all, over all devices and,
    unless `use_all_devices`, over fewer; last, so that a budget cuts them before a baseline).
    `note` hears why a baseline was left out."""
    from pipecc import driver
    from pipecc.passes import device_count
    from pipecc.passes.plan_search import Planner
    if k < 1:
        raise UsageError(f"-k {k}: tune at least one candidate (-k 1 measures the planner's choice)")
    graph = analysis.graph
    chosen, chosen_graph = driver.plan(analysis, cluster, options, debug=debug)
    out = [Candidate("planner's choice", chosen, chosen_graph)]
    seen = {key(chosen)}
    resolved, measured = driver.resolve_options(options, analysis, cluster)  # a profile's links measured
    clusters: list[tuple[list[int] | None, Any]] = [(None, measured)]
    if device_count.applies(options, len(cluster.devices)):
        clusters += device_count.subsets(measured)
    ranked: list[tuple[float, Plan]] = []
    full: Planner | None = None
    for keep, sub in clusters:
        try:
            planner = Planner(graph, sub, resolved)
            planner.run()
        except PipeccError:
            continue
        if keep is None:
            full = planner
        for cand in planner.ranked(k):
            plan = planner.to_plan(cand)
            if keep is not None:
                plan = device_count.remap(plan, keep)
                plan.options["devices_given"] = len(cluster.devices)
            ranked.append((plan.predicted_iteration_s, plan))
    ranked.sort(key=lambda r: r[0])
    others: list[Plan] = []
    for _, plan in ranked:  # the planner's next best, k - 1 of them
        if len(others) >= k - 1:
            break
        if key(plan) not in seen and all(key(plan) != key(o) for o in others):
            others.append(plan)
    for label, plan, base_graph, why in _baselines(analysis, cluster, options, full, debug):
        if plan is None:
            note(f"{label} not tuned: {why}")
        elif key(plan) in seen:
            note(f"{label} not tuned: it is candidate "
                 f"{next(i for i, c in enumerate(out, 1) if key(c.plan) == key(plan))}'s plan")
        else:
            seen.add(key(plan))
            out.append(Candidate(label, plan, base_graph or graph))
    for rank, plan in enumerate(others, 2):  # after the baselines: a budget cuts these first
        if key(plan) not in seen:
            seen.add(key(plan))
            out.append(Candidate(f"planner #{rank}", plan, graph))
    for c in out:
        c.plan.model_path, c.plan.model_args = chosen.model_path, dict(chosen.model_args)
    return out


def _baselines(analysis: Any, cluster: Any, options: PlanOptions, planner: Any,
               debug: bool) -> list[tuple[str, Plan | None, AnnotatedGraph | None, str]]:
    """(label, plan or None, why not) for the equal-count, pipelining and data-parallel plans."""
    from pipecc import driver
    from pipecc.passes import baselines as rules
    p = len(cluster.devices)
    out: list[tuple[str, Plan | None, AnnotatedGraph | None, str]] = []
    base = None
    if planner is not None:
        base = next((c for c in planner.results if c.replicas == 1 and c.virtual == 1 and not c.thresholds
                     and len(c.part.bounds) - 1 == p), None)
    for label, weights in (("equal-count", "nodes"), ("torch.distributed.pipelining split", None)):
        if p < 2:
            out.append((label, None, None, "one device"))
            continue
        if base is None:
            out.append((label, None, None, f"no plain pipeline over all {p} devices fits"))
            continue
        units = base.units
        w = [len(names) for names in units.names] if weights == "nodes" else None
        try:
            plan = _with_bounds(planner, base, rules.equal_count(units.n, p, w))
        except (PipeccError, ValueError) as exc:
            out.append((label, None, None, str(exc)))
            continue
        out.append((label, plan, None, ""))
    if p > 1:
        try:
            opts = PlanOptions.of(options, replicas=p, use_all_devices=True, microbatch_sizes="equal",
                                  bipartition="off", activation_balancing="off")
            plan, graph = driver.plan(analysis, cluster, opts, debug=debug)
            out.append(("data parallelism", plan, graph, ""))
        except PipeccError as exc:
            out.append(("data parallelism", None, None, str(exc).split("\n")[0]))
    return out


def _with_bounds(planner: Any, base: Any, bounds: tuple[int, ...]) -> Plan:
    """The plan of `base` (a plain-pipeline candidate) with its cuts replaced by `bounds`, costed
    and simulated like the planner's own (a placement that does not fit memory is refused)."""
    from pipecc.techniques.replicas import search as rep
    ev = planner.evaluator
    mb = rep.slice_size(int(ev.options.batch_size) // base.microbatches, 1)
    prob, part = ev.tables.recost(base.raw or base.problem, bounds, base.order, mb, 1)
    if not getattr(part, "fits", True):
        raise PipeccError("its cuts do not fit memory")
    timeline = ev.simulate(part, prob, base.schedule, base.microbatches, 1, order=base.order)
    cand = dataclasses.replace(base, part=part, problem=prob, timeline=timeline, notes=[], thresholds=())
    plan = planner.to_plan(cand)
    return plan


# ----------------------------------------------------------------------------- measuring
def compile_candidate(analysis: Any, cand: Candidate, folder: Path) -> None:
    """Write `cand`'s compiled folder (`driver.compile`); a PipeccError says why not."""
    from pipecc import driver
    driver.compile(analysis, cand.plan, cand.graph, folder)


def run_candidate(folder: Path, steps: int, timeout: float) -> dict[str, Any]:
    """`pipecc run FOLDER --json` in its own process group: its JSON document. A PipeccError
    (its one error line) when it fails; TimeoutError when it has not ended within
    `timeout` x 2 + `GRACE_S` (the ranks' own peer timeout is `timeout`), its processes stopped."""
    limit = 2 * timeout + GRACE_S
    cmd = [*RUN_COMMAND, str(folder), "--steps", str(steps), "--json",
           "--warmup-steps", "1" if steps > 1 else "0", "--timeout", f"{timeout:g}", "-q"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _stop(proc)
        raise TimeoutError(f"no result within {limit:g} s (--timeout {timeout:g}); its processes were stopped") from None
    except BaseException:  # Ctrl-C: the candidate's processes go too
        _stop(proc)
        raise
    if proc.returncode != 0:
        lines = [ln for ln in err.splitlines() if ln.startswith("pipecc: error:")]
        raise PipeccError((lines[-1].removeprefix("pipecc: error: ") if lines
                           else (err.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]))
    try:
        return json.loads(out)
    except ValueError:
        raise PipeccError("`pipecc run --json` printed no JSON document") from None


def _stop(proc: subprocess.Popen) -> None:
    """Stop a candidate's whole process group: SIGTERM, then SIGKILL after 5 s."""
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def measure(analysis: Any, cands: list[Candidate], workdir: Path, *, steps: int, timeout: float,
            budget_s: float | None, clock: Callable[[], float] = time.monotonic,
            on_done: Callable[[int, Candidate], None] = lambda i, c: None) -> None:
    """Compile and run every candidate in turn (module docstring); each gets its status,
    measured seconds or reason. `on_done(i, c)` after each (the progress bar)."""
    start = clock()
    for i, cand in enumerate(cands):
        if i > 0 and budget_s is not None and clock() - start > budget_s:
            cand.status, cand.reason = SKIPPED, f"past the --budget-s {budget_s:g} s budget"
            on_done(i, cand)
            continue
        cand.folder = workdir / f"cand_{i}"
        try:
            compile_candidate(analysis, cand, cand.folder)
            doc = run_candidate(cand.folder, steps, timeout)
            median = (doc.get("step_s") or {}).get("median")
            if not isinstance(median, (int, float)):
                raise PipeccError("its run reported no step time")
            cand.status, cand.measured_s = OK, float(median)
        except TimeoutError as exc:
            cand.status, cand.reason = TIMEOUT, str(exc)
        except (PipeccError, OSError) as exc:
            cand.status, cand.reason = FAILED, str(exc).split("\n")[0]
        on_done(i, cand)


def table(cands: list[Candidate]) -> str:
    """The candidates as a text table: predicted vs measured step time, best measured marked."""
    best = fastest(cands)
    rows = [("#", "candidate", "shape", "schedule", "m", "predicted s", "measured s", "result")]
    for i, c in enumerate(cands, 1):
        result = "fastest" if c is best else c.status if c.status == OK else f"{c.status}: {c.reason}"
        rows.append((str(i), c.label, c.shape(), c.plan.schedule, str(c.plan.microbatches),
                     f"{c.predicted_s:.4g}", f"{c.measured_s:.4g}" if c.measured_s is not None else "-", result))
    widths = [max(len(r[j]) for r in rows) for j in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows)


def fastest(cands: list[Candidate]) -> Candidate | None:
    """The candidate measured fastest (None: none was measured)."""
    done = [c for c in cands if c.status == OK and c.measured_s is not None]
    return min(done, key=lambda c: c.measured_s) if done else None  # type: ignore[arg-type, return-value]


def rows(cands: list[Candidate]) -> list[dict[str, Any]]:
    """The table as JSON rows (`pipecc tune --json`)."""
    best = fastest(cands)
    return [{"index": i, "label": c.label, "stages": len(c.plan.stages), "replicas": c.plan.replicas,
             "devices": [int(d.get("given_index", j)) for j, d in enumerate(c.plan.devices)],
             "schedule": c.plan.schedule, "microbatches": c.plan.microbatches,
             "predicted_s": c.predicted_s, "measured_s": c.measured_s, "status": c.status,
             "reason": c.reason, "chosen": c is best} for i, c in enumerate(cands)]
