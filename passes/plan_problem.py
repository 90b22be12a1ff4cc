"""The partition problem of one candidate: a `PartitionProblem` from the cost tables.

Stage k runs on device order[k % p] with the memory its device's model counts
(`DeviceCosts.memory`: DRAM for CPUs/GPUs, on-chip BRAM for FPGA cards) and as many
micro-batches in flight as the schedule stashes there (`inflight`, from the generated
schedule). A unit a device cannot run costs CANNOT_RUN_S there, and a device whose stages
take one float32 tensor blocks every other cut next to them (`PartitionProblem.blocked`).
A stage with `recompute[k]` pays one more forward in its backward and holds one
micro-batch's activations (`techniques.recompute.search`); with d > 1 replicas the problem is over
replica groups (`techniques.replicas.search.group_problem`). Every time is the one cost model's
(`CostTables`): unit times with their per-call fixed costs, each stage's per-micro-batch
fixed costs (`PartitionProblem.fixed_fwd/fixed_bwd`), messages with both hosts' costs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

import numpy as np

from pipecc.ir.schedule.registry import schedule_for
from pipecc.techniques import capabilities as caps
from pipecc.techniques.replicas import search as rep
from pipecc.passes.partition import PartitionProblem, cut_bytes
from pipecc.passes.plan_costs import CostTables
from pipecc.passes.units import Units

__all__ = ["inflight", "problem", "recomputing"]


def recomputing(prob: PartitionProblem, recompute: Sequence[bool] | None) -> PartitionProblem:
    """`prob` with `recompute[k]` stages paying one more forward in their backward (and marked,
    for the memory model) — what `problem` does on its own devices."""
    if recompute is None or not any(recompute):
        return prob
    if len(recompute) != len(prob.mem_cap):
        raise ValueError(f"recompute needs one flag per stage ({len(prob.mem_cap)}), got {len(recompute)}")
    fwd = np.asarray(prob.fwd, dtype=float)
    bwd = np.asarray(prob.bwd, dtype=float) + np.where(np.asarray(recompute, dtype=bool)[:, None], fwd, 0.0)
    fixed_bwd = None
    if prob.fixed_fwd is not None:  # the re-run forward pays its fixed part again
        fixed_bwd = [b + (f if r else 0.0) for f, b, r in
                     zip(prob.fixed_fwd, prob.fixed_bwd or [0.0] * len(recompute), recompute)]
    return dataclasses.replace(prob, bwd=bwd, recompute=tuple(bool(r) for r in recompute),
                               fixed_bwd=fixed_bwd if fixed_bwd is not None else prob.fixed_bwd)


@functools.lru_cache(maxsize=256)  # NOTE: --choose-order asks once per device order
def inflight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Micro-batches stashed at once by each of p stages (v per rank): the schedule's peak
    stash per rank (gpipe: m; 1f1b: min(ranks - r, m)), spread evenly over a rank's stages."""
    prof = schedule_for(schedule, p, m, num_ranks=p // v).rank_stash_profile()
    return tuple(math.ceil(prof[k % (p // v)] / v) for k in range(p))


def problem(tables: CostTables, units: Units, mb: int, schedule: str, m: int, order: Sequence[int],
            v: int = 1, recompute: Sequence[bool] | None = None, d: int = 1) -> PartitionProblem:
    """The problem of (schedule, m micro-batches of mb, device order, v stages per rank,
    recomputing stages, d replicas) over `tables` (module docstring). With d > 1, stage k is on
    replica group k % (p/d) and `mb` is a replica's slice."""
    p, training, cluster = tables.p, tables.options.training, tables.cluster
    if d > 1:
        P = p // d
        held = inflight(schedule, P * v, m, v) if training else [1] * (P * v)
        prob = _with_step_inputs(rep.group_problem(tables, units, mb, held, order, d, v), tables, mb * m)
        return _with_working_sets(recomputing(prob, recompute), units, training)  # NOTE: no FPGA is ever replicated
    fwd, bwd = tables.times(units, mb)
    devs = [order[k % p] for k in range(p * v)]
    if recompute is not None and len(recompute) != len(devs):
        raise ValueError(f"recompute needs one flag per stage ({len(devs)}), got {len(recompute)}")
    if recompute is not None:  # never on a device that cannot (an FPGA card; any order may put one anywhere)
        recompute = [bool(r) and cluster.devices[x].can(caps.RECOMPUTE) for r, x in zip(recompute, devs)]
    if recompute is not None and any(recompute):  # the re-run forward joins the backward
        bwd = bwd[devs] + np.where(np.asarray(recompute, dtype=bool)[:, None], fwd[devs], 0.0)
        fwd, devs_t = fwd[devs], list(range(len(devs)))
    else:
        recompute, devs_t = None, devs
    mems = [tables.costs[x].memory(units, v) for x in devs]
    held = inflight(schedule, p * v, m, v) if training else [1] * (p * v)
    held = [i if mem.inflight is None else mem.inflight for i, mem in zip(held, mems)]
    def link_time(k: int, nbytes: float) -> float:  # the cost model's message (its docstring)
        return tables.link_time(devs[k], devs[k + 1], nbytes)
    one = [tables.costs[x].one_tensor_boundaries for x in devs]
    blocked = None
    if any(one):  # such a stage takes one float32 tensor in and sends one out
        bad = ~tables.builder.one_tensor_cut
        none = np.zeros_like(bad)
        blocked = [bad if one[k] or one[k + 1] else none for k in range(len(devs) - 1)]
    fixed = [tables.stage_fixed(x) for x in devs]
    fixed_bwd = [b + (f if recompute is not None and recompute[k] else 0.0)
                 for k, (f, b) in enumerate(fixed)]
    prob = PartitionProblem(
        fixed_fwd=[f for f, _ in fixed], fixed_bwd=fixed_bwd,
        fwd=fwd[devs_t], bwd=bwd[devs_t], out_bytes=units.values["output_bytes"],
        last_use=units.last_use, static_mem=np.stack([mem.static for mem in mems]),
        act_mem=np.stack([mem.act for mem in mems]), mem_cap=[mem.cap for mem in mems],
        inflight=held, link_time=link_time, blocked=blocked, training=training,
        recompute=None if recompute is None else tuple(bool(r) for r in recompute),
        labels=[f"device {k} ({cluster.devices[x].name}"
                + (f", {mem.what}" if mem.what else "") + ")"
                for k, (x, mem) in enumerate(zip(devs, mems))])
    fpga = any(cluster.devices[x].kind == "fpga" for x in devs)  # NOTE: on-chip memory is its own model
    return prob if fpga else _with_working_sets(_with_step_inputs(prob, tables, mb * m), units, training)


def _with_step_inputs(prob: PartitionProblem, tables: CostTables, rows: int) -> PartitionProblem:
    """`prob` with the step's model inputs (``rows`` samples: a replica's share of the batch)
    charged to the first unit's static memory: the rank of stage 0 moves the whole step's inputs
    to its device and splits them into micro-batch views (`runtime.engine._split_inputs`), so it
    holds them all step, whichever micro-batches are in flight."""
    extra = tables.builder.input_bytes(rows)
    if not extra:
        return prob
    static = np.array(prob.static_mem, dtype=float, copy=True)
    static[..., 0] += extra
    return dataclasses.replace(prob, static_mem=static)


def _with_working_sets(prob: PartitionProblem, units: Units, training: bool) -> PartitionProblem:
    """`prob` with the units' backward working sets and unkept sent outputs (the simulator's
    memory terms, `Evaluator.simulate`), when training; and its M_k made a bound on them, in the
    form its exact search needs (a constant per stage): each cap lowered by the largest working
    set of any unit plus the largest cut (an input gradient still being sent). Not in M_k (it is
    additive over units and grows with the stage's end; these are not): the outputs a stage sends
    that no backward keeps (a recomputing stage: all it sends), the optimizer step's
    temporaries, a tied weight's second copy (docs/memory.md)."""
    if not training or units.work_bytes is None or units.unkept_out_bytes is None:
        return prob
    cuts = cut_bytes(prob.out_bytes, prob.last_use)
    margin = float(np.max(units.work_bytes, initial=0.0)) + max(cuts, default=0.0)
    caps = [c - margin if math.isfinite(c) else c for c in prob.mem_cap]
    return dataclasses.replace(prob, work_mem=units.work_bytes, held_out_mem=units.unkept_out_bytes, mem_cap=caps,
                               cap_margin=margin)
