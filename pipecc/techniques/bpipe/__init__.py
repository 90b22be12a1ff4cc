"""BPipe's rule (activation balancing): where pairing stage s with p-1-s and moving stashes
between them can run. One `requires`, asked by the planner (before it
considers BPipe, on a sketch of the options), the plan verifier, compile and `pipecc run`.

BPipe moves autograd saved tensors between the ranks of a 1F1B pipeline (PAPERS-SPEC.md 2.2):
so a training plan under 1f1b, one stage per pipeline rank, equal micro-batches, stages whose
devices keep an autograd stash and a runtime with one process per rank; it does not move
Bi-Partition's segment stashes. It composes with replica groups (replica r of stage s pairs
with replica r of stage p-1-s: the pairs are pipeline ranks) and with recomputation on any
stage but an evictor (a recomputing stage stashes only its inputs, which the runtime keeps for
the input gradients anyway: evicting them would move nothing and free nothing).
The pairs themselves: (s, p-1-s) with s < p//2, each stage in one pair, 1 <= K <= p - s, one
return policy.

The rest of BPipe is this package's parts: `schedule` (the stash transfers inserted into 1F1B,
IR), `search` (the planner pass: thresholds, candidates, the estimate), `codegen` (the compiled
folder's check of its pairs), `runtime` (the executor's SEND_S/RECV_S/SEND_R/RECV_R handler) over
`runtime_stash` (the saved-tensor store and its transport), `report` (its lines in `pipecc plan`
and `pipecc inspect`).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import Schedule
from pipecc.techniques import capabilities as cap
from pipecc.techniques.bpipe.schedule import BPIPE_POLICIES as POLICIES, bpipe, placement_problem
from pipecc.techniques.options import Option
from pipecc.techniques.facts import bipartition_on, stages_per_device, training, unequal

NAME = "BPipe"
TAG = "activation balancing (BPipe)"
OFF = "--activation-balancing off"
LOWERS = "transfers"  # `lower` inserts the stash transfers into 1F1B's rows
OPTIONS = (Option("--activation-balancing", "activation_balancing", "auto", "auto|on|off",
                  "BPipe: under 1F1B, stage s sends stashed activations to stage p-1-s and "
                  "takes them back before their backward, to spend the freed memory on a larger "
                  "micro-batch or no recomputation. auto (default): only where pipecc's estimate "
                  "predicts a speed-up; on: always (1f1b, replicas 1); off: never",
                  words={"auto": "auto", "on": "on", "off": "off"}, api_default="off",
                  choices=("auto", "on", "off")),)


def without_fix(why: str) -> str:
    """A `requires` line without its fix (": use ..." / "; use ..."), for the planner's note when
    BPipe was only weighed (`--activation-balancing auto`): there is nothing to turn off."""
    return re.split(r"[:;] use ", why, maxsplit=1)[0]


def uses(plan: Plan) -> bool:
    return bool(plan.activation_balancing)


def options_problem(options: Any) -> str | None:
    """Why the planner's options (`passes.plan_options.PlanOptions`) cannot ask for BPipe (one
    line with the fix), or None."""
    if options.activation_balancing == "on" and options.microbatch_sizes not in ("equal", "auto"):
        return "--activation-balancing on needs equal micro-batches: drop --microbatch-sizes"
    return None


def one_shape(options: Any) -> str | None:
    """The switch that plans its folder for one input shape (`pipecc.varlen.check_options` refuses
    it with `--length`), or None."""
    return "--activation-balancing on" if options.activation_balancing == "on" else None


def pairs_problem(pairs: Sequence[Any], p: int) -> str | None:
    """Why `pairs` (`Plan.activation_balancing`) is not a pairing of `p` stages the schedule can
    build, or None."""
    seen: set[int] = set()
    policies: set[str] = set()
    for pair in pairs:
        try:
            s, a, k = int(pair["evictor"]), int(pair["acceptor"]), pair["threshold"]
        except (KeyError, TypeError, ValueError):
            return f"{TAG}: entry {pair!r} needs integer evictor, acceptor and threshold; fix the plan or use {OFF}"
        if a != p - 1 - s or not 0 <= s < p // 2:
            return (f"{TAG}: odd pairing ({s}, {a}), pairs are (s, p-1-s) with s < p//2 (p = {p}); "
                    f"fix the plan or use {OFF}")
        if s in seen:
            return f"{TAG}: stage {s} appears in two pairs; fix the plan or use {OFF}"
        seen.add(s)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= p - s:
            return f"{TAG}: threshold {k!r} of stage {s} is out of range 1..{p - s}; fix the plan or use {OFF}"
        policy = str(pair.get("policy", "jit")) if isinstance(pair, dict) else "jit"
        if policy not in POLICIES:
            return f"{TAG}: policy {policy!r}, choose {' or '.join(POLICIES)}; fix the plan or use {OFF}"
        policies.add(policy)
    if len(policies) > 1:
        return f"{TAG}: the pairs mix return policies {sorted(policies)}; use one, or {OFF}"
    return None


def thresholds(balancing: Sequence[dict], stages: int) -> tuple[list[int | None], str]:
    """Per stage its eviction threshold K (None: not an evictor) and the pairs' return policy,
    from ``pipecc.json``'s ``activation_balancing``; refuses the pairs `pairs_problem` refuses
    (a pairing other than (s, p-1-s) with s < p // 2, a stage in two pairs, K out of range,
    mixed policies)."""
    why = pairs_problem(balancing, stages)
    if why is not None:
        raise PipeccError(why)
    out: list[int | None] = [None] * stages
    policies = set()
    for pair in balancing:
        out[int(pair["evictor"])] = int(pair["threshold"])
        policies.add(str(pair.get("policy", "jit")))
    return out, policies.pop() if policies else "jit"


def at_run(kind: str | Schedule, world: int, microbatches: int, stages_per_rank: int,
           sizes: Sequence[Sequence[int]] | None, balancing: Sequence[dict] | None) -> Schedule | None:
    """BPipe's rule checked again on a run's own placement (`pipecc.runtime.engine.build_schedule`:
    one process may hold every stage): the schedule its pairs run, built by name (1f1b, one stage
    per rank, equal micro-batches), or None without pairs or when `kind` is a folder's parsed
    ``schedule.txt`` (whose pairs must still be ones the runtime can run)."""
    if not balancing:
        return None
    if isinstance(kind, Schedule):
        thresholds(balancing, kind.num_stages)
        return None
    ks, policy = thresholds(balancing, world * stages_per_rank)
    problem = placement_problem(kind, stages_per_rank, sizes is not None)
    if problem is not None:
        what = {"schedule": f"schedule {kind!r}", "stages": f"{stages_per_rank} stages per rank",
                "sizes": "unequal micro-batch sizes"}[problem]
        raise UsageError(f"{TAG} runs under the 1f1b schedule with one stage per rank, "
                         f"not {what}; drop --schedule or compile with {OFF}")
    from pipecc.ir.schedule.registry import schedule_for
    from pipecc.ir.schedule.text import ScheduleError
    try:
        return schedule_for("1f1b", world, microbatches, bpipe_thresholds=ks, bpipe_policy=policy)
    except (ValueError, ScheduleError) as e:
        raise PipeccError(f"activation balancing: {getattr(e, 'summary', e)}") from None


def requires(plan: Plan, caps: cap.Capabilities) -> str | None:
    """Why BPipe cannot run in `plan` on `caps` (one line with the fix), or None. The context
    rules hold whether or not the plan has pairs yet (the planner asks before it makes them)."""
    if not training(plan):
        return f"{TAG} needs a training plan (a forward-only one stashes no activations); use {OFF}"
    problem = placement_problem(plan.schedule, stages_per_device(plan), unequal(plan))
    if problem == "schedule":
        return f"{TAG} pairs stages under the 1f1b schedule only, not {plan.schedule}: use --schedule 1f1b, or {OFF}"
    if problem == "stages":
        return f"{TAG} needs one stage per device, not {stages_per_device(plan)}: use --schedule 1f1b, or {OFF}"
    if problem == "sizes":
        return f"{TAG} needs equal micro-batches, the plan has unequal ones: use --microbatch-sizes equal, or {OFF}"
    where = caps.first_lacking(plan, cap.SAVED_TENSOR_STASH)
    if where is not None:
        return f"{TAG}: {where} keeps no autograd stash to move; use {OFF}"
    if bipartition_on(plan):
        return (f"{TAG} does not move the stashes of Bi-Partition's separate forward and backward cuts: "
                f"use --bipartition off, or {OFF}")
    if len(plan.stages) < 2:
        return f"{TAG} needs two stages or more (one stage has no partner); use {OFF}"
    if not caps.runtime_can(cap.STASH_TRANSFER):
        return (f"{TAG} moves saved tensors between ranks, which {caps.where} cannot: compile with "
                f"`pipecc compile` and run with `pipecc run`, or plan with {OFF}")
    why = pairs_problem(plan.activation_balancing, len(plan.stages))
    if why is not None:
        return why
    for pair in plan.activation_balancing:
        s = int(pair["evictor"])
        if plan.stages[s].recompute:
            return (f"{TAG}: evictor stage {s} recomputes its activations, so it stashes only its inputs, which "
                    f"stay on it for its input gradients (nothing to move); recompute on the acceptors only, or "
                    f"use {OFF}")
    return None


def lower(plan: Plan, schedule: Schedule) -> Schedule:
    """The plan's schedule with its stash transfers: `schedule` (1F1B) with SEND_S/RECV_S/
    SEND_R/RECV_R between each pair (``schedule.bpipe``, the plan's thresholds and policy),
    validated; `schedule` itself without pairs."""
    if not uses(plan):
        return schedule
    from pipecc.ir.schedule.validate import validate
    policy = str(plan.activation_balancing[0].get("policy", "jit"))
    lowered = bpipe(schedule, plan.bpipe_thresholds(), policy)
    validate(lowered)
    return lowered
