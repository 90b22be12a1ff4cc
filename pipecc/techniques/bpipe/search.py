"""Activation balancing (BPipe): pair stage s with p-1-s under 1F1B and move stashes between them.

Under 1F1B stage s stashes min(p - s, m) micro-batches, so stage 0 needs about p times the
activation memory of the last stage (PAPERS-SPEC.md 2.2). BPipe (Kim et al., ICML 2023) lets
each *evictor* s < p//2 send its newest stashes to its *acceptor* p-1-s and take them back
before their backward, so both hold about (p+1)/2; the memory freed buys a larger micro-batch
or no recomputation. Its re-evaluation (arXiv 2024) found the gain negligible once flash
attention shrinks activations, and proposed estimating it first: this pass is that estimate.

    for each micro-batch count m and replica degree d (1F1B, one stage per pipeline rank):
        memory-blind cuts ─► per-stage W (static) and A (stash) bytes ─► K_s per pair (2.3, +1)
        ─► balanced counts (schedule.bpipe(...).stash_profile()) as the partitioner's in-flight
        ─► exact cuts ─► simulate with stash transfers on the pair links and the timeline
        memory sweep ─► fits every cap? (else re-derive K from these cuts, twice, then give up)
    best BPipe candidate vs the best plan without it (whatever the search allowed: other
    schedules, recomputation, replicas) ─► speed-up S = T_baseline / T_BPipe (2.7)
    ─► use it when S > 1 + EPSILON ("auto") or always ("on"); `decisions` say why.

K_s (PAPERS-SPEC.md 2.3, in bytes, with the +1 of 2.10 item 1): the evictor holds
W_s + min(K + 1, n_s)·A_s, its acceptor W_a + n_a·A_a + (n_s - K)·A_s, n_k = min(p - k, m); the
K in [1, n_s - 2] minimising the larger (ties: the larger K, fewer transfers); none below
n_s - 1 frees anything, so the pair stays idle (None). The partitioner takes each stage's
count from the generated schedule assuming A_partner ≈ A_own (2.10 item 3, v1); the simulator
then checks the exact bytes, an acceptor holding its evictor's stashes.

Composition (issue 18): with replica groups (`--replicas`, PP x DP) the pairs are pipeline
ranks, replica r of group s evicting to replica r of group p-1-s, every figure a replica's
slice (`techniques.replicas.search`) and the groups' all-reduce in the timeline; with `--recompute auto`
a candidate that fits nowhere without recomputation recomputes some stages (the acceptors'
half first, then those the search without BPipe recomputes, `_with_recompute`); a recomputing
stage stashes only its inputs, which the runtime keeps for its input gradients anyway, so it
never evicts (BPipe's rule refuses such a pair): the evictors move their activations to
acceptors that make room by recomputing. "full" recomputes every stage, so nothing evicts.

Scope (anything else is not considered by "auto" and refused with "on"): BPipe's rule,
`pipecc.techniques.bpipe.requires` (training, 1f1b, one stage per pipeline rank, equal
micro-batches, devices that keep an autograd stash), asked here on a sketch of the options
(`_sketch`) and by the verifier, compile and `pipecc run` on the plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from pipecc.errors import PipeccError, UsageError
from pipecc import techniques
from pipecc.ir.plan import Plan
from pipecc.ir.schedule.actions import ActionKind
from pipecc.ir.schedule.registry import schedule_for
from pipecc.techniques.bpipe.schedule import bpipe_pairs
from pipecc.techniques import capabilities as caps
from pipecc.techniques.replicas import search as rep
from pipecc.passes.partition import InfeasibleError, partition
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_evaluate import Evaluator
from pipecc.targets.timing import CANNOT_RUN_S

MODES = ("auto", "on", "off")
# [D] the estimate must promise more than 2% before "auto" uses BPipe: below that the gain is
# inside the roofline model's own error and not worth the extra traffic and runtime machinery
EPSILON = 0.02
POLICY = "jit"  # PAPERS-SPEC.md 2.4: fewer transfers than "eager" when stages overflow by little


def _sketch(ev: Evaluator) -> Plan:
    """The plans the search would make, as BPipe's rule reads them (1f1b, one stage per device,
    every stage recomputing under `--recompute full`): `pipecc.techniques.bpipe.requires`
    asks it before any candidate exists."""
    opt = ev.options
    return techniques.sketch(schedule="1f1b" if opt.schedule == "auto" else opt.schedule,
                             devices=ev.cluster.devices, training=opt.training,
                             replicas=1 if opt.replicas == "auto" else int(opt.replicas),
                             recompute=opt.recompute == "full")


def before_search(ev: Evaluator) -> None:
    """The planner's hook before its search (`passes.plan_search`): UsageError (one line) for
    a mode that is unknown, or "on" with options out of scope."""
    mode = ev.options.activation_balancing
    if mode not in MODES:
        raise UsageError(f"--activation-balancing {mode!r}: choose auto, on or off")
    why = techniques.bpipe.requires(_sketch(ev), techniques.COMPILED) if mode == "on" else None
    if why is not None:
        raise UsageError(f"--activation-balancing on: {why}")


def thresholds(static: Sequence[float], act: Sequence[float], p: int, m: int,
               forced: bool = False) -> list[int | None]:
    """K_s per evictor (module docstring), None for stages that do not evict. `forced`: every
    pair evicts (K clamped to [1, n_s - 1]) even where that frees nothing."""
    out: list[int | None] = [None] * p
    for s, a in bpipe_pairs(p):
        n_s, n_a = min(p - s, m), min(p - a, m)
        best: tuple[float, int] | None = None
        for k in range(1, n_s - 1):
            evictor = static[s] + min(k + 1, n_s) * act[s]
            acceptor = static[a] + n_a * act[a] + max(n_s - k, 0) * act[s]
            key = (max(evictor, acceptor), -k)
            if best is None or key < (best[0], -best[1]):
                best = (key[0], k)
        plain = max(static[s] + n_s * act[s], static[a] + n_a * act[a])
        if best is not None and best[0] < plain:
            out[s] = best[1]
        elif forced and n_s >= 2:
            out[s] = max(1, n_s - 1)
    return out


def _stage_bytes(prob: Any, bounds: Sequence[int], cuts: Sequence[float]) -> tuple[list[float], list[float]]:
    """[stage] static bytes and stash bytes per micro-batch (internal activations plus the
    received input), as `passes.partition` counts them. A recomputing stage (`prob.recompute`)
    stashes only its received input; the one micro-batch it re-creates in each backward counts
    as static (`techniques.recompute.search`'s memory model)."""
    import numpy as np
    p = len(bounds) - 1
    static = np.broadcast_to(np.asarray(prob.static_mem, dtype=float), (p, len(prob.out_bytes)))
    act = np.broadcast_to(np.asarray(prob.act_mem, dtype=float), (p, len(prob.out_bytes)))
    received = [0.0] + [float(x) for x in cuts]
    redo = prob.recompute or (False,) * p
    W = [float(static[k, bounds[k]:bounds[k + 1]].sum()) for k in range(p)]
    inner = [float(act[k, bounds[k]:bounds[k + 1]].sum()) for k in range(p)]
    W = [w + (a if r else 0.0) for w, a, r in zip(W, inner, redo)]
    A = [(0.0 if r else a) + received[k] for k, (a, r) in enumerate(zip(inner, redo))]
    return W, A


def _overlap(ev: Evaluator, prob: Any, part: Any, s: int, d: int = 1) -> float:
    """The fraction of one more stash evictor s holds at its peak because its SEND_S is still
    moving while its next forward runs: transfer seconds over forward seconds, at most 1. With
    d replicas, replica r of group s sends to replica r of group p-1-s (the first pair speaks
    for all: groups are consecutive devices)."""
    import numpy as np
    a, e = part.bounds[s], part.bounds[s + 1]
    p = len(part.bounds) - 1
    forward = float(np.asarray(prob.fwd)[s, a:e].sum()) + prob.stage_fixed(s)[0]
    W, A = _stage_bytes(prob, part.bounds, part.cut_bytes)
    moving = ev.tables.link_time(s * d, (p - 1 - s) * d, A[s])
    return min(moving / forward, 1.0) if forward > 0 else 1.0


def evaluate_candidate(ev: Evaluator, m: int, forced: bool = False, d: int = 1,
                       recompute: Sequence[bool] | None = None) -> Candidate:
    """The BPipe candidate with m micro-batches (1F1B, one stage per pipeline rank; with d
    replicas every stage on a group of d devices, each replica pairing with the same replica
    of its partner group, `techniques.replicas.search`; `recompute[k]`: stage k recomputes, and does not
    evict, its stash being its inputs): K_s from the memory-blind cuts' bytes, then every
    K shifted by 0, -1, +1, -2, +2 (the cuts move with K, so the formula's K need not be best);
    the fastest that fits exactly wins. Raises InfeasibleError when none fits with balanced
    memory."""
    p, mb = ev.p // d, rep.slice_size(ev.options.batch_size // m, d)
    plain = ev.problem(ev.builder.at(mb), mb, "1f1b", m, tuple(range(ev.p)), 1, recompute, d)
    blind = partition(dataclasses.replace(plain, mem_cap=[math.inf] * p))  # memory-blind first
    if blind.bottleneck >= CANNOT_RUN_S:
        raise InfeasibleError(f"BPipe with {m} micro-batches: no placement runs on these devices")
    W, A = _stage_bytes(plain, blind.bounds, blind.cut_bytes)
    redo = plain.recompute or (False,) * p  # a recomputing stage's stash is its inputs, which stay on it:
    first = [None if redo[s] else k for s, k in enumerate(thresholds(W, A, p, m, forced))]  # it never evicts
    if all(k is None for k in first):
        raise InfeasibleError(f"BPipe with {m} micro-batches: no pair frees memory by evicting")
    overlap = {s: _overlap(ev, plain, blind, s, d) for s, k in enumerate(first) if k is not None}
    fits, errors, seen = [], [], set()
    for shift in (0, -1, 1, -2, 2):
        ks = tuple(None if k is None else min(max(k + shift, 1), max(min(p - s, m) - 1, 1))
                   for s, k in enumerate(first))
        if ks in seen:
            continue
        seen.add(ks)
        try:
            fits.append(_fit(ev, plain, m, ks, overlap, d))
        except InfeasibleError as exc:
            errors.append(str(exc))
    if not fits:
        raise InfeasibleError(errors[0])
    return min(fits, key=lambda c: c.timeline.iteration_s)


def _fit(ev: Evaluator, plain: Any, m: int, ks: Sequence[int | None], overlap: dict[int, float],
         d: int = 1) -> Candidate:
    """The candidate with thresholds `ks`: cuts for the balanced counts (each evictor's plus its
    `overlap`), then the simulator's exact check (with d replicas, the groups' all-reduce too).
    InfeasibleError when it does not fit."""
    p, mb, order = ev.p // d, rep.slice_size(ev.options.batch_size // m, d), tuple(range(ev.p))
    counts = [float(c) for c in schedule_for("1f1b", p, m, bpipe_thresholds=ks, bpipe_policy=POLICY).stash_profile()]
    for s, extra in overlap.items():  # NOTE: an eviction still moving while the next F grows
        counts[s] += extra            # (simulate's timeline sweep) costs that F's share so far
    part = partition(dataclasses.replace(plain, inflight=tuple(counts)))  # InfeasibleError
    prob, part = ev.tables.recost(dataclasses.replace(plain, inflight=tuple(counts)), part.bounds, order, mb, d)
    units = ev.builder.at(mb)
    allreduce = rep.stage_allreduce_s(ev.tables, units, part.bounds, order, d) if d > 1 else None
    timeline = ev.simulate(part, prob, "1f1b", m, 1, order=order, bpipe=list(ks), bpipe_policy=POLICY,
                           allreduce=allreduce)
    for k, (peak, cap) in enumerate(zip(timeline.peak_memory_bytes, plain.mem_cap)):
        cap = cap + plain.cap_margin  # the simulated peak counts the working sets the margin bounds
        if peak > cap * (1 + 1e-9):
            raise InfeasibleError(f"BPipe with {m} micro-batches: stage {k} peaks at {peak / 1e9:.4g} GB > "
                                  f"{cap / 1e9:.4g} GB once stashes move (acceptor bytes, transfers in flight)")
    return Candidate("1f1b", m, order, part, prob, units, timeline, raw=plain,
                         recompute=tuple(bool(r) for r in prob.recompute or ()), replicas=d,
                         allreduce=list(allreduce or []), thresholds=tuple(ks))


def memory_before(ev: Evaluator, cand: Candidate) -> list[float]:
    """[stage] peak bytes of the candidate's cuts under plain 1F1B (no stash moves)."""
    return list(ev.simulate(cand.part, cand.problem, "1f1b", cand.microbatches, 1, order=cand.order,
                            bpipe=[None] * cand.ranks, bpipe_policy=POLICY,
                            allreduce=cand.allreduce or None).peak_memory_bytes)


def _transfers(ev: Evaluator, cand: Candidate) -> tuple[float, float]:
    """(exposed seconds, busiest pair's transfer seconds) of the candidate's stash transfers:
    its iteration minus the same schedule's with free transfers, and the most seconds any
    evictor spends sending out and taking back."""
    free = ev.simulate(cand.part, cand.problem, "1f1b", cand.microbatches, 1, order=cand.order,
                       bpipe=cand.thresholds, bpipe_policy=POLICY, free_stash=True,
                       allreduce=cand.allreduce or None)
    busy: dict[int, float] = {}
    for e in cand.timeline.events:
        if e.kind in (ActionKind.SEND_S, ActionKind.SEND_R):
            pair = min(e.rank, e.peer if e.peer is not None else e.rank)
            busy[pair] = busy.get(pair, 0.0) + e.duration
    return max(cand.timeline.iteration_s - free.iteration_s, 0.0), max(busy.values(), default=0.0)


def _stash_seconds(ev: Evaluator, cand: Candidate) -> list[list[float]]:
    """[stage][mb] one-way seconds of the candidate's stash transfers (0 off the evictors)."""
    table = [[0.0] * cand.microbatches for _ in range(cand.ranks)]
    for e in cand.timeline.events:
        if e.kind is ActionKind.SEND_S:
            table[e.stage][e.microbatch] = e.duration
    return table


def _describe(c: Candidate, batch: int) -> dict[str, Any]:
    return {"schedule": c.schedule, "microbatches": c.microbatches,
            "microbatch_size": batch // c.microbatches, "replicas": c.replicas,
            "recompute": any(c.recompute), "iteration_s": float(c.timeline.iteration_s),
            "peak_memory_bytes": float(max(c.timeline.peak_memory_bytes, default=0.0))}


def _config(d: dict[str, Any]) -> str:
    what = f"{d['schedule']} b={d['microbatch_size']}"
    what += " with recompute" if d["recompute"] else " without recompute"
    if d.get("replicas", 1) > 1:
        what += f" x{d['replicas']} replicas"
    return f"{what} {d['iteration_s']:.4g} s"


def _with_recompute(ev: Evaluator, m: int, d: int, forced: bool, results: Sequence[Candidate]) -> Candidate:
    """The BPipe candidate for (m, d) under the balancer's `--recompute` mode: "none" never
    recomputes, "full" recomputes every stage (BPipe then moves the stages' inputs); "auto"
    tries no recomputation first and, where nothing fits, the stages the search without BPipe
    recomputes at the same (m, d), then every stage that may (its device can, no training-mode
    BatchNorm: `techniques.recompute.search`), each first on the acceptors' half only: a recomputing stage
    stashes only its inputs, which the runtime keeps for its input gradients anyway, so it has
    nothing to evict (`evaluate_candidate` leaves it out of the pairs). InfeasibleError when
    none fits."""
    from pipecc.ir.graph import training_batchnorm_names
    mode, p = ev.options.recompute, ev.p // d
    if mode == "none":
        return evaluate_candidate(ev, m, forced, d)
    if mode == "full":
        return evaluate_candidate(ev, m, forced, d, [True] * p)
    try:
        return evaluate_candidate(ev, m, forced, d)
    except InfeasibleError as exc:
        error = exc
    may = [d > 1 or ev.cluster.devices[k * d].can(caps.RECOMPUTE) for k in range(p)]
    same = [tuple(c.recompute) for c in results
            if (c.schedule, c.microbatches, c.replicas) == ("1f1b", m, d) and any(c.recompute)]
    bn = set(training_batchnorm_names(ev.graph))
    upper = [k >= p // 2 for k in range(p)]  # acceptors (and a middle stage): evictors keep their stash to move
    options = [tuple(f and u for f, u in zip(flags, upper)) for flags in [*same, tuple(may)]]
    for flags in dict.fromkeys([options[0], *same, *options[1:], tuple(may)]):
        flags = tuple(f and a for f, a in zip(flags, may))
        for _ in range(p):
            if not any(flags):
                break
            try:
                cand = evaluate_candidate(ev, m, forced, d, list(flags))
            except InfeasibleError:
                break
            b = cand.part.bounds
            held = [k for k in range(p) if flags[k] and bn & {n for u in range(b[k], b[k + 1])
                                                               for n in cand.units.names[u]}]
            if not held:
                return _fewer(ev, m, forced, d, cand)
            flags = tuple(f and k not in held for k, f in enumerate(flags))
    raise error


def _fewer(ev: Evaluator, m: int, forced: bool, d: int, cand: Candidate) -> Candidate:
    """`cand` with recomputation kept only on the stages that overflow at its cuts without it,
    stashing BPipe's balanced counts (`cand.problem.inflight`), when that fits and is no slower:
    the memory BPipe freed buys back what recomputation cost."""
    from pipecc.passes.partition import evaluate
    memory = evaluate(dataclasses.replace(cand.problem, recompute=None), cand.part.bounds).stage_memory
    need = [bool(r) and mem > cap for r, mem, cap in zip(cand.recompute, memory, cand.problem.mem_cap)]
    if need == list(cand.recompute):
        return cand
    try:
        fewer = evaluate_candidate(ev, m, forced, d, need if any(need) else None)
    except InfeasibleError:
        return cand
    return fewer if fewer.timeline.iteration_s <= cand.timeline.iteration_s else cand


def schedules(options: Any, names: Sequence[str]) -> list[str]:
    """The planner's hook on the schedules its search would try (`passes.plan_search`): with
    `--activation-balancing on` only 1f1b (BPipe's schedule), where 1f1b is among `names`."""
    if options.activation_balancing == "on" and "1f1b" in names:
        return ["1f1b"]
    return list(names)


def all_devices(options: Any) -> bool:
    """The planner's hook on `fewer devices` (`passes.device_count.applies`): `--activation-balancing
    on` asks for a pipeline over the devices as given."""
    return bool(options.activation_balancing == "on")


def after_search(ev: Evaluator, results: list[Candidate], tried: Sequence[tuple[str, int, int]]
                 ) -> tuple[list[Candidate], list[str], dict[str, Any]]:
    """The planner's hook after its search (`passes.plan_search`): weigh BPipe against `results`
    (the search without it, best first; may be empty): returns
    the results with the BPipe candidate first when it is used, the decision lines and the
    estimate (PAPERS-SPEC.md 2.7; {} with mode "off"). `tried`: the (schedule, m, d replicas)
    the search tried; BPipe tries each (m, d) of 1f1b with more than one pipeline rank."""
    ms = sorted({(m, d) for s, m, d in tried if s == "1f1b" and ev.p // d > 1})
    mode = ev.options.activation_balancing
    if mode == "off":
        return results, [], {}
    why = techniques.bpipe.requires(_sketch(ev), techniques.COMPILED)
    if why is not None:  # `auto` (the CLI's default) asked for nothing to turn off: the reason, not the fix
        why = why if mode == "on" else techniques.bpipe.without_fix(why)
        return results, [f"BPipe (activation balancing) not considered: {why}"], {"used": False, "reason": why}
    tried, lost = [], []
    for m, d in ms:
        try:
            tried.append(_with_recompute(ev, m, d, mode == "on", results))
        except InfeasibleError as exc:
            lost.append(str(exc))
    base = results[0] if results else None
    if not tried:
        reason = lost[0] if lost else "no micro-batch count to try"
        if lost and all("no pair frees memory" in x for x in lost):
            reason = ("no pair frees memory by evicting at any micro-batch count (with one stash "
                      "in flight an evictor gains only when it holds 3 or more)")
        estimate = {"used": False, "reason": reason,
                    "baseline": _describe(base, ev.options.batch_size) if base else None}
        if mode == "on":
            raise PipeccError(f"--activation-balancing on: {reason}; use --activation-balancing auto")
        return results, [f"BPipe not used: {reason}"], estimate
    best = min(tried, key=lambda c: (c.timeline.iteration_s, c.microbatches, c.replicas))
    speedup = base.timeline.iteration_s / best.timeline.iteration_s if base else math.inf
    exposed, moving = _transfers(ev, best)
    hidden = 1.0 - exposed / moving if moving > 0 else 1.0
    used = mode == "on" or speedup > 1 + EPSILON
    flash = bool(ev.options.flash_attention)
    after = _describe(best, ev.options.batch_size)
    before_cfg = _describe(base, ev.options.batch_size) if base else None
    if base is None:
        reason = "nothing fits memory without it"
    elif speedup > 1 + EPSILON:
        fewer = sum(best.recompute) < sum(base.recompute)
        reason = "the freed memory buys " + ("a larger micro-batch" if best.microbatches < base.microbatches
                                             else "fewer recomputing stages" if fewer and any(best.recompute)
                                             else "no recomputation" if fewer
                                             else "better-balanced cuts")
    elif not any(base.recompute) and best.microbatches >= base.microbatches:
        reason = "memory does not bind" + (" (flash attention)" if flash else "")
    else:
        reason = "the freed memory buys too little" + (" (flash attention)" if flash else "")
    if hidden < 0.95 and moving > 0:
        reason += f"; stash transfers {hidden:.0%} hidden"
    estimate = {
        "used": used, "speedup": speedup if math.isfinite(speedup) else None,
        "threshold": 1 + EPSILON, "baseline": before_cfg, "bpipe": after,
        "pairs": [{"evictor": s, "acceptor": best.ranks - 1 - s, "threshold": k}
                  for s, k in enumerate(best.thresholds) if k is not None],
        "hidden_fraction": hidden, "exposed_transfer_s": exposed,
        "memory_before_bytes": memory_before(ev, best),
        "memory_after_bytes": [float(x) for x in best.timeline.peak_memory_bytes],
        "memory_cap_bytes": [float(c) + best.raw.cap_margin for c in best.raw.mem_cap] if best.raw is not None else [],
        "flash_attention": flash, "reason": reason,
        "stash_transfer_s": [max(row, default=0.0) for row in _stash_seconds(ev, best)]}
    ratio = "no baseline fits" if base is None else f"estimated {speedup:.2f}x"
    detail = f"BPipe {_config(after)} vs without {_config(before_cfg) if before_cfg else '(none fits)'}"
    if used:
        pairs = ", ".join(f"({p['evictor']}, {p['acceptor']}) K={p['threshold']}" for p in estimate["pairs"])
        forced = " (--activation-balancing on)" if mode == "on" and speedup <= 1 + EPSILON else ""
        line = f"BPipe used{forced}: {ratio} ({reason}; {detail}); pairs {pairs}"
        return [best] + results, [line], estimate
    return results, [f"BPipe not used: {ratio} ({reason}; {detail})"], estimate


def plan_fields(cand: Candidate) -> dict[str, Any]:
    """The emitter's hook (`passes.plan_emit.to_plan`): `Plan.activation_balancing` of a
    candidate (its thresholds)."""
    ks = getattr(cand, "thresholds", ()) or ()
    p = len(ks)
    return {"activation_balancing": [{"evictor": s, "acceptor": p - 1 - s, "threshold": int(k), "policy": POLICY}
                                     for s, k in enumerate(ks) if k is not None]}


def decision_lines(cand: Candidate, notes: list[str], estimate: dict[str, Any]) -> list[str]:
    """The emitter's hook (`passes.plan_emit.to_plan`): BPipe's `notes` (from `after_search`:
    used or not, and why) when they speak of `cand`: it moves stashes (its thresholds) exactly
    when the estimate says BPipe is used (the planner writes other candidates too: the driver's
    contenders, `pipecc tune`'s)."""
    return notes if bool(cand.thresholds) == bool(estimate.get("used")) else []
