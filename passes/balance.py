"""The balance pass: choose schedule, micro-batch count, device order, layer splits and cuts.

    costed graph + cluster ─► units (passes.units) ─► for each (schedule, m): partition
    (passes.partition, exact) ─► simulate (passes.simulate) ─► the fastest that fits memory
    ─► intra-layer split of layers too heavy for a balanced cut (passes.split_layers) ─► Plan

What a unit costs on a device, in time and memory, is that device's cost model
(`pipecc.targets.timing.DeviceCosts`, picked once per device by `device_costs`): the roofline
for CPUs and GPUs, the FPGA model behind estimates.json for FPGA cards. The partitioner sums
unit times; `Balancer.recost` then re-costs each stage of the chosen partition as a whole
where the device's model says so (FPGA dataflow stages), so the plan and estimates.json agree.
A unit a device cannot run costs CANNOT_RUN_S there, and a device whose stages take one
float32 tensor blocks every other cut next to them (`PartitionProblem.blocked`).
Which stages recompute their activations (`PlanOptions.recompute`) is `passes.recompute`'s
choice per candidate; `problem(..., recompute=)` charges them (one more forward in backward,
one micro-batch's activations plus the received inputs in memory).

Zero-bubble schedules (`ZERO_BUBBLE`: zb-h1) split each stage's backward into I (input
gradient) and W (weight gradient); the simulator gets both, each stage's W being the sum over
its units of the backward seconds times the device model's `weight_share`. The partitioner
itself still balances F + B per stage (the 1F1B steady state, which ZB-H1 shares). No FPGA
plan uses them: the FPGA backend has no separate weight-gradient pass.
"""

from __future__ import annotations

# NOTE(size): the Balancer is one object on purpose: the passes it drives (recompute, replicas,
# bpipe, split search) call back into its cost tables, problem builder and simulator; their own
# policies already live in their modules.

import dataclasses
import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipecc.errors import PipeccError, UsageError
from pipecc.ir import techniques
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan, StagePlan
from pipecc.ir.schedule.registry import SPLIT_BACKWARD_COST, TRAINING_SCHEDULES, VIRTUAL, ZERO_BUBBLE, schedule_for
from pipecc.ir.techniques import capabilities as caps
from pipecc.passes import baselines, replicas as rep
from pipecc.passes import bpipe as bpipe_pass
from pipecc.passes import recompute as recompute_pass
from pipecc.passes.partition import (InfeasibleError, Partition, PartitionProblem,
                                     best_device_order, evaluate, lower_bound, partition)
from pipecc.passes.simulate import StageCosts, Timeline, simulate
from pipecc.passes.units import Units, UnitBuilder
from pipecc.report.formatting import count
from pipecc.targets.fpga_timing import FpgaCosts
from pipecc.targets.hardware import Cluster, Device
from pipecc.targets.profiled import Profile, ProfiledCosts, profile_decisions, time_source
from pipecc.targets.timing import CANNOT_RUN_S, DeviceCosts, RooflineCosts

__all__ = ["Balancer", "PlanOptions", "device_costs"]


@dataclass
class PlanOptions:
    batch_size: int
    microbatches: int | str = "auto"
    schedule: str = "auto"
    training: bool = True
    optimizer_states: int = 2         # Adam: two moments per weight
    dtype: str = "fp32"
    coarse: bool = False
    choose_order: bool = False
    split_layers: bool = True
    virtual_stages: int = 2           # for interleaved
    compare: bool = False
    fpga_number: str | None = None    # FPGA stages' number format (None: from dtype)
    profile: Profile | None = None    # measured costs (`pipecc.targets.profiled.use_profile`)
    recompute: str = "none"           # activation recomputation: none, full or auto (passes.recompute)
    replicas: int | str = 1           # PP x DP degree: N or "auto" (passes.replicas; the CLI's default is auto)
    bipartition: str = "off"          # separate FP/BP cuts: off or auto (passes.bipartition_plan)
    bipartition_window: int = 8       # units each cut may move from the single cut (PAPERS-SPEC §3.4)
    activation_balancing: str = "off"  # BPipe: auto, on or off (passes.bpipe; the CLI's default is auto)
    flash_attention: bool = False     # the graph was costed with flash attention (cost.annotate)


@dataclass
class _Candidate:
    schedule: str
    microbatches: int
    order: tuple[int, ...]
    part: Partition
    problem: PartitionProblem
    units: Units
    timeline: Timeline
    virtual: int = 1
    notes: list[str] = field(default_factory=list)
    raw: PartitionProblem | None = None   # before stages were re-costed (for baselines)
    recompute: tuple[bool, ...] = ()      # [stage] recomputes its activations; (): none does
    replicas: int = 1                     # d: every stage on a group of d devices
    allreduce: list[float] = field(default_factory=list)  # [stage] group all-reduce seconds
    thresholds: tuple[int | None, ...] = ()  # BPipe: [stage] evictor threshold K or None; (): none

    @property
    def ranks(self) -> int:
        """Pipeline ranks P (replica groups)."""
        return len(self.order) // self.replicas


def _recomputing(prob: PartitionProblem, recompute: Sequence[bool] | None) -> PartitionProblem:
    """`prob` with `recompute[k]` stages paying one more forward in their backward (and marked,
    for the memory model) — what `Balancer.problem` does on its own devices."""
    if recompute is None or not any(recompute):
        return prob
    if len(recompute) != len(prob.mem_cap):
        raise ValueError(f"recompute needs one flag per stage ({len(prob.mem_cap)}), got {len(recompute)}")
    fwd = np.asarray(prob.fwd, dtype=float)
    bwd = np.asarray(prob.bwd, dtype=float) + np.where(np.asarray(recompute, dtype=bool)[:, None], fwd, 0.0)
    return dataclasses.replace(prob, bwd=bwd, recompute=tuple(bool(r) for r in recompute))


@functools.lru_cache(maxsize=256)  # NOTE: --choose-order asks once per device order
def _inflight(schedule: str, p: int, m: int, v: int) -> tuple[int, ...]:
    """Micro-batches stashed at once by each of p stages (v per rank): the schedule's peak
    stash per rank (gpipe: m; 1f1b: min(ranks - r, m)), spread evenly over a rank's stages."""
    prof = schedule_for(schedule, p, m, num_ranks=p // v).rank_stash_profile()
    return tuple(math.ceil(prof[k % (p // v)] / v) for k in range(p))


def device_costs(device: Device, builder: UnitBuilder, options: PlanOptions) -> DeviceCosts:
    """The one place that picks a device's cost model: FPGA cards get the FPGA model of
    estimates.json (in the plan's FPGA number format), a device the profile timed its
    measured curves (the roofline for nodes without one), everything else the roofline."""
    if device.kind == "fpga":
        return FpgaCosts(device, builder.graph, builder.groups,
                         number=options.fpga_number or options.dtype, training=options.training)
    roofline = RooflineCosts(device, dtype=options.dtype, training=options.training,
                             optimizer_states=options.optimizer_states)
    target = options.profile.target_for(device) if options.profile is not None else None
    if target is not None:
        return ProfiledCosts(roofline, builder.graph, builder.groups, options.profile, target)
    return roofline


class Balancer:
    """Holds the graph, cluster and options; `run()` returns the Plan."""

    def __init__(self, graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions,
                 splittable: Sequence[str] = ()) -> None:
        self.graph, self.cluster, self.opt = graph, cluster, options
        self.builder = UnitBuilder(graph, coarse=options.coarse, splittable=splittable)
        self.p = len(cluster.devices)
        self._times: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # NOTE: one model per device type, shared by its devices: the FPGA model caches costs
        models: dict[str, DeviceCosts] = {}
        for dev in cluster.devices:
            if dev.name not in models:
                models[dev.name] = device_costs(dev, self.builder, options)
        self.costs = [models[dev.name] for dev in cluster.devices]  # [device] its cost model
        self._shares: dict[int, np.ndarray] = {}  # mb -> [device][unit] weight_share
        self.estimate: dict[str, Any] = {}  # the BPipe estimate of the last run (passes.bpipe)

    # ------------------------------------------------------------------ costs
    def times(self, units: Units, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """[device][unit] forward and backward seconds at micro-batch size mb."""
        if mb in self._times:
            return self._times[mb]
        fwd = np.zeros((self.p, units.n))
        bwd = np.zeros((self.p, units.n))
        done: dict[int, int] = {}  # NOTE: devices of one type share their model: time it once
        for d, costs in enumerate(self.costs):
            if id(costs) in done:
                fwd[d], bwd[d] = fwd[done[id(costs)]], bwd[done[id(costs)]]
                continue
            fwd[d], bwd[d] = costs.unit_times(units, mb)
            done[id(costs)] = d
        self._times[mb] = (fwd, bwd)
        return fwd, bwd

    def recost(self, prob: PartitionProblem, bounds: Sequence[int], order: Sequence[int],
               mb: int, d: int = 1) -> tuple[PartitionProblem, Partition]:
        """The partition at `bounds` with each stage's additive unit times replaced by its
        device model's time of the whole stage where the model has one (`stage_times`: an
        FPGA stage's dataflow time, as in `estimates.json`). Other stages are unchanged."""
        fwd = np.array(prob.fwd, dtype=float)
        bwd = np.array(prob.bwd, dtype=float)
        changed = False
        for k in range(len(bounds) - 1):
            a, e = bounds[k], bounds[k + 1]
            if fwd[k, a:e].sum() >= CANNOT_RUN_S:
                continue
            # NOTE: replica groups (d > 1) hold no FPGA: the group's first device speaks for it
            whole = self.costs[order[(k % (self.p // d)) * d]].stage_times(range(a, e), fwd[k, a:e], mb)
            if whole is None:
                continue
            fwd[k, a:e], bwd[k, a:e] = whole
            changed = True
        if not changed:
            return prob, evaluate(prob, bounds)
        prob = dataclasses.replace(prob, fwd=fwd, bwd=bwd)
        return prob, evaluate(prob, bounds)

    def problem(self, units: Units, mb: int, schedule: str, m: int, order: Sequence[int],
                v: int = 1, recompute: Sequence[bool] | None = None, d: int = 1) -> PartitionProblem:
        """Stage k on device order[k % p], with the memory its device's model counts
        (`DeviceCosts.memory`: DRAM for CPUs/GPUs, on-chip BRAM for FPGA cards). A stage with
        `recompute[k]` pays one more forward in its backward and holds one micro-batch's
        activations (`passes.recompute`). With d > 1 replicas, stage k on replica group
        k % (p/d) and `mb` is a replica's slice (`passes.replicas.group_problem`)."""
        if d > 1:
            P = self.p // d
            inflight = _inflight(schedule, P * v, m, v) if self.opt.training else [1] * (P * v)
            prob = rep.group_problem(self, units, mb, inflight, order, d, v)
            return _recomputing(prob, recompute)  # NOTE: no FPGA is ever replicated
        fwd, bwd = self.times(units, mb)
        devs = [order[k % self.p] for k in range(self.p * v)]
        if recompute is not None and len(recompute) != len(devs):
            raise ValueError(f"recompute needs one flag per stage ({len(devs)}), got {len(recompute)}")
        if recompute is not None:  # never on a device that cannot (an FPGA card; any order may put one anywhere)
            recompute = [bool(r) and self.cluster.devices[d].can(caps.RECOMPUTE)
                         for r, d in zip(recompute, devs)]
        if recompute is not None and any(recompute):  # the re-run forward joins the backward
            bwd = bwd[devs] + np.where(np.asarray(recompute, dtype=bool)[:, None], fwd[devs], 0.0)
            fwd, devs_t = fwd[devs], list(range(len(devs)))
        else:
            recompute, devs_t = None, devs
        mems = [self.costs[d].memory(units, v) for d in devs]
        inflight = _inflight(schedule, self.p * v, m, v) if self.opt.training else [1] * (self.p * v)
        inflight = [i if mem.inflight is None else mem.inflight for i, mem in zip(inflight, mems)]
        links = [self.cluster.link(devs[k], devs[k + 1]) if devs[k] != devs[k + 1] else None
                 for k in range(len(devs) - 1)]

        def link_time(k: int, nbytes: float) -> float:
            return links[k].time(nbytes) if links[k] is not None and nbytes > 0 else 0.0
        one = [self.costs[d].one_tensor_boundaries for d in devs]
        blocked = None
        if any(one):  # such a stage takes one float32 tensor in and sends one out
            bad = ~self.builder.one_tensor_cut
            none = np.zeros_like(bad)
            blocked = [bad if one[k] or one[k + 1] else none for k in range(len(devs) - 1)]
        return PartitionProblem(
            fwd=fwd[devs_t], bwd=bwd[devs_t], out_bytes=units.values["output_bytes"],
            last_use=units.last_use, static_mem=np.stack([mem.static for mem in mems]),
            act_mem=np.stack([mem.act for mem in mems]), mem_cap=[mem.cap for mem in mems],
            inflight=inflight, link_time=link_time, blocked=blocked, training=self.opt.training,
            recompute=None if recompute is None else tuple(bool(r) for r in recompute),
            labels=[f"device {k} ({self.cluster.devices[d].name}"
                    + (f", {mem.what}" if mem.what else "") + ")"
                    for k, (d, mem) in enumerate(zip(devs, mems))])

    # ------------------------------------------------------------------ search
    def candidates(self) -> list[tuple[str, int, int]]:
        """(schedule, micro-batches, replicas) to try: every schedule and m as before, each
        with every replication degree d allowed (`passes.replicas.allowed`); P = n/d pipeline
        ranks. One rank (plain data parallelism) has one meaningful schedule: 1f1b."""
        b = self.opt.batch_size
        if self.opt.microbatches == "auto":
            ms = [m for m in range(1, b + 1) if b % m == 0 and m <= 64]
        else:
            m = int(self.opt.microbatches)
            if m < 1 or b % m:
                raise UsageError(f"--microbatches {m} must divide the batch size {b}")
            ms = [m]
        unreplicable = [dev.name for dev in self.cluster.devices if not dev.can(caps.REPLICATE)]
        rep.check_requested(self.opt.replicas, self.p, self.cluster.devices)
        rep.check_slices(self.opt.replicas, b, ms)
        n_units = self.builder.at(1).n

        allowed = {m: rep.allowed(self.opt.replicas, self.p, b // m, bool(unreplicable)) for m in ms}
        if not any(self.p // d <= n_units for ds in allowed.values() for d in ds):
            groups = [d for d in rep.allowed("auto", self.p, b // min(ms), bool(unreplicable))
                      if self.p // d <= n_units]  # would replica groups fit?
            raise PipeccError(f"{self.p} devices but only {n_units} units to place; use fewer "
                              "devices" + (" or --replicas auto" if groups else ""))

        def degrees(m: int) -> list[int]:
            return [d for d in allowed[m] if self.p // d <= n_units]
        if not self.opt.training:
            return [("inference", m, d) for m in ms for d in degrees(m)]
        scheds = TRAINING_SCHEDULES if self.opt.schedule == "auto" else (self.opt.schedule,)

        def refused(s: str) -> str | None:  # the zero-bubble rule on these devices
            draft = techniques.sketch(schedule=s, devices=self.cluster.devices)
            return techniques.zero_bubble.requires(draft, techniques.COMPILED)
        if self.opt.schedule in ZERO_BUBBLE and refused(self.opt.schedule):
            raise UsageError(f"--schedule {self.opt.schedule}: {refused(self.opt.schedule)}")
        # auto: a zero-bubble schedule these devices cannot run is no candidate
        scheds = tuple(s for s in scheds if s not in ZERO_BUBBLE or not refused(s))
        out = []
        for s in scheds:
            for m in ms:
                for d in degrees(m):
                    P = self.p // d
                    if s in VIRTUAL and (m % P or self.opt.virtual_stages < 2 or P == 1):
                        continue
                    if P == 1 and s != "1f1b" and self.opt.schedule == "auto":
                        continue  # one rank: gpipe is 1f1b holding every micro-batch at once
                    out.append((s, m, d))
        if not out:
            raise UsageError(f"--schedule interleaved needs a micro-batch count divisible by "
                             f"{self.p} devices")
        return out

    def evaluate_candidate(self, schedule: str, m: int, recompute: Sequence[bool] | None = None,
                           d: int = 1) -> _Candidate:
        """The best partition for (schedule, m, d replicas), with `recompute[k]` stages
        recomputing."""
        mb = rep.slice_size(self.opt.batch_size // m, d)  # NOTE: d replicas: the largest slice
        units = self.builder.at(mb)
        v = self.opt.virtual_stages if schedule in VIRTUAL else 1
        order = tuple(range(self.p))
        prob = self.problem(units, mb, schedule, m, order, v, recompute, d)
        if self.opt.choose_order and v == 1 and self.p > 1 and d == 1:
            order, part = self._best_order(units, mb, schedule, m, recompute)
            prob = self.problem(units, mb, schedule, m, order, v, recompute)
        else:
            part = partition(prob)
        if part.bottleneck >= CANNOT_RUN_S:
            raise InfeasibleError(self._unsupported_message(prob, order))
        raw = prob
        prob, part = self.recost(prob, part.bounds, order, mb, d)
        allreduce = rep.stage_allreduce_s(self, units, part.bounds, order, d) if d > 1 else None
        timeline = self._simulate(part, prob, schedule, m, v, order=order, allreduce=allreduce)
        # NOTE: the partitioner is exact for its model: the 1F1B steady state with transfers
        # overlapped. With few micro-batches, or GPipe's two one-way streams, fill and drain
        # weigh more, and cuts exact for the stream model (training=False) or for the old
        # model (comm charged to both stages) can simulate faster: the simulator chooses.
        tried = {tuple(part.bounds)}
        for other in (dataclasses.replace(raw, training=False), dataclasses.replace(raw, comm="charged")):
            if other == raw:
                continue
            alt = partition(other)
            if alt.bottleneck >= CANNOT_RUN_S or tuple(alt.bounds) in tried:
                continue
            tried.add(tuple(alt.bounds))
            prob2, part2 = self.recost(raw, alt.bounds, order, mb, d)
            allreduce2 = rep.stage_allreduce_s(self, units, part2.bounds, order, d) if d > 1 else None
            timeline2 = self._simulate(part2, prob2, schedule, m, v, order=order, allreduce=allreduce2)
            if timeline2.iteration_s < timeline.iteration_s:
                prob, part, timeline, allreduce = prob2, part2, timeline2, allreduce2
        return _Candidate(schedule, m, order, part, prob, units, timeline, v, raw=raw,
                          recompute=tuple(bool(r) for r in prob.recompute or ()),
                          replicas=d, allreduce=list(allreduce or []))

    def candidate(self, *args: Any, **kwargs: Any) -> _Candidate:
        """A `_Candidate` (for passes that build their own, such as `passes.bpipe`)."""
        return _Candidate(*args, **kwargs)

    def _best_order(self, units: Units, mb: int, schedule: str, m: int,
                    recompute: Sequence[bool] | None = None):
        types = [d.name for d in self.cluster.devices]
        return best_device_order(
            lambda order: self.problem(units, mb, schedule, m, order, 1, recompute), types)

    def weight_times(self, part: Partition, prob: PartitionProblem, order: Sequence[int],
                     mb: int, d: int = 1) -> list[float]:
        """[stage] seconds of the stage's backward that compute weight gradients (zero-bubble
        W): its units' backward seconds in `prob` times their device's `weight_share` (with d
        replicas, `mb` is a replica's slice and stage k's device the first of group k % (p/d))."""
        if mb not in self._shares:
            units = self.builder.at(mb)
            self._shares[mb] = np.stack([c.weight_share(units, mb) for c in self.costs])
        share, bwd = self._shares[mb], np.array(prob.bwd, dtype=float)
        redo = prob.recompute or []
        out = []
        for k in range(len(part.bounds) - 1):
            a, e = part.bounds[k], part.bounds[k + 1]
            own = bwd[k, a:e] - (np.asarray(prob.fwd)[k, a:e] if k < len(redo) and redo[k] else 0.0)
            dev = order[(k % (self.p // d)) * d]
            out.append(float((own * share[dev, a:e]).sum()))  # a re-run forward is I's
        return out

    def _simulate(self, part: Partition, prob: PartitionProblem, schedule: str, m: int,
                  v: int, order: Sequence[int] | None = None,
                  allreduce: Sequence[float] | None = None,
                  bpipe: Sequence[int | None] | None = None, free_stash: bool = False) -> Timeline:
        """The candidate's timeline; `allreduce` [stage]: replica groups' all-reduce seconds
        (summed per rank), None without replication. `bpipe` [stage]: BPipe thresholds (1F1B,
        one stage per device): a stash (internal activations plus the received input, as the
        partitioner counts it) moves over the pair's link (free with `free_stash`); all None:
        the same stash bytes without moves (memory before balancing)."""
        stages = len(part.bounds) - 1
        fwd = np.asarray(prob.fwd)
        bwd = np.asarray(prob.bwd)
        f = [float(fwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        b = [float(bwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        send = [prob.link_time(k, part.cut_bytes[k]) if k < stages - 1 else 0.0 for k in range(stages)]
        back = [0.0] + send[:-1]
        act_mem = np.broadcast_to(np.asarray(prob.act_mem, dtype=float), fwd.shape)
        static_mem = np.broadcast_to(np.asarray(prob.static_mem, dtype=float), fwd.shape)
        act = [float(act_mem[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        static = [float(static_mem[k, part.bounds[k]:part.bounds[k + 1]].sum())
                  for k in range(stages)]
        redo = None
        if prob.recompute is not None:  # stash the received inputs; re-create `act` in each B
            redo = [a if r else 0.0 for a, r in zip(act, prob.recompute)]
            received = [0.0] + [float(x) for x in part.cut_bytes]  # stage 0's input is not charged
            act = [received[k] if r else act[k] for k, r in enumerate(prob.recompute)]
        if bpipe is not None:  # NOTE: the partitioner's stash: the received input counts too
            act = [a + (float(part.cut_bytes[k - 1]) if k > 0 else 0.0) for k, a in enumerate(act)]
        split: dict[str, list[float]] = {}
        if schedule in ZERO_BUBBLE:  # I and W actions: the backward's two parts
            d = self.p * v // stages  # replicas per stage group
            w = self.weight_times(part, prob, order or tuple(range(self.p)),
                                  rep.slice_size(self.opt.batch_size // m, d), d)
            split = {"backward_weight_s": w, "backward_input_s": [bk - wk for bk, wk in zip(b, w)],
                     "split_cost": SPLIT_BACKWARD_COST}  # what the runtime's split measured
        costs = StageCosts.per_stage(m, f, b, send_forward_s=send, send_backward_s=back,
                                     activation_bytes=act, static_bytes=static,
                                     recompute_bytes=redo, **split)
        sched = schedule_for(schedule, stages, m, num_ranks=stages // v, bpipe_thresholds=bpipe,
                             bpipe_policy=bpipe_pass.POLICY)
        if bpipe is not None:
            devs = order or tuple(range(self.p))
            costs.stash_transfer_s = [
                [0.0 if free_stash or sched.partner is None or sched.partner[k] is None
                 else self.cluster.link(devs[k], devs[sched.partner[k]]).time(act[k])] * m
                for k in range(stages)]
        if allreduce is not None:
            per_rank = [0.0] * sched.num_ranks
            for k, t in enumerate(allreduce):
                per_rank[sched.stage_to_rank[k]] += t
            costs.allreduce_s = per_rank
        return simulate(sched, costs)

    def _unsupported_message(self, prob: PartitionProblem, order: Sequence[int]) -> str:
        """Why every placement puts something on an FPGA it cannot take: memory elsewhere,
        no one-tensor boundary around the FPGA stage, or ops it cannot generate.
        NOTE: the FPGA cost model is the one that refuses units and cuts, hence the words."""
        fpgas = ", ".join(f"{k} ({self.cluster.devices[d].name})" for k, d in enumerate(order)
                          if self.costs[d].one_tensor_boundaries)
        bad = next((b for c in self.costs if (b := c.unsupported_nodes())), [])
        if not fpgas or not bad:  # no FPGA refuses anything: the figures make every time huge
            slow = sorted({self.cluster.devices[d].name for d in order})
            return (f"every placement takes over {CANNOT_RUN_S:g} s per micro-batch on device(s) "
                    f"{', '.join(slow)}: their figures (mem_bandwidth, peak_flops) are too small to "
                    "plan with; check the cluster file")
        example = f"{bad[0].meta['pipecc.op']} at node {bad[0].meta['pipecc.name']}" if bad else "?"
        fix = ("leave the FPGA out of --devices" if self.opt.choose_order and self.p > 1
               else "put a CPU/GPU there or use --choose-order")
        roomy = dataclasses.replace(prob, mem_cap=[math.inf] * len(prob.mem_cap))
        if partition(roomy).bottleneck < CANNOT_RUN_S:
            short = [f"{k} ({self.cluster.devices[d].name})" for k, d in enumerate(order)
                     if not self.costs[d].one_tensor_boundaries]
            return (f"no placement fits memory: the only splits that fit put on FPGA device "
                    f"{fpgas} ops it cannot generate (e.g. {example}) or a boundary of more than "
                    f"one tensor, because device {', '.join(short)} cannot hold the rest; add "
                    f"devices with more memory or use more micro-batches")
        if partition(dataclasses.replace(roomy, blocked=None)).bottleneck < CANNOT_RUN_S:
            return (f"FPGA device {fpgas} needs a stage boundary of one float32 tensor on each "
                    f"side, and no such cut leaves it only ops it can generate; {fix}")
        return (f"FPGA device {fpgas} would have to run ops the FPGA backend cannot "
                f"generate (e.g. {example}); {fix}")

    def run(self) -> tuple[Plan, _Candidate]:
        bpipe_pass.check(self)
        results: list[_Candidate] = []
        lost: list[dict[str, Any]] = []
        tried = self.candidates()
        if self.opt.activation_balancing == "on":  # BPipe forced: 1F1B on single devices only
            tried = [c for c in tried if c[0] == "1f1b" and c[2] == 1] or tried
        for schedule, m, d in tried:
            try:
                results.append(recompute_pass.evaluate_candidate(self, schedule, m, d))
            except InfeasibleError as exc:
                lost.append({"schedule": schedule, "microbatches": m, "replicas": d,
                             "reason": str(exc)})
        results.sort(key=lambda c: (c.timeline.iteration_s, c.microbatches, c.replicas))
        ms = sorted({m for s, m, d in tried if s == "1f1b" and d == 1})
        results, self._bpipe_notes = bpipe_pass.apply(self, results, ms)
        if not results:
            reason = lost[0]["reason"] if lost else "no candidate"
            if lost:  # would recomputing activations fit it? (only with --recompute none)
                reason = recompute_pass.hint(self, lost[0]["schedule"], lost[0]["microbatches"], reason,
                                             lost[0].get("replicas", 1))
            if "on-chip BRAM" in reason:
                reason += ("; an FPGA stage keeps its weights on chip: let pipecc place it "
                           "(--choose-order) or use a narrower --fpga-number such as ap_fixed<16,6>")
            raise PipeccError(reason if reason.startswith(("FPGA", "no placement", "every placement"))
                              else f"no schedule fits memory: {reason}")
        self.results, self.infeasible = results, lost
        best = results[0]
        return self.to_plan(best, self.alternatives(best)), best

    def alternatives(self, chosen: _Candidate) -> list[dict[str, Any]]:
        """Why every other (schedule, micro-batches) lost to `chosen` (before layer splits)."""
        out = list(self.infeasible)
        for c in self.results:
            if c is not chosen:
                out.append({"schedule": c.schedule, "microbatches": c.microbatches,
                            "replicas": c.replicas,
                            "reason": f"slower: {c.timeline.iteration_s:.4g} s per iteration "
                                      f"(bubble {c.timeline.bubble_fraction:.1%}) vs "
                                      f"{chosen.timeline.iteration_s:.4g} s"})
        return out

    def contenders(self, within: float = math.inf, most: int = len(TRAINING_SCHEDULES)) -> list[_Candidate]:
        """The fastest candidate of each schedule within `within` of the best (at most
        `most`, best first): layer splitting may reorder these, so each gets split. (A
        replicated candidate competes under its schedule's name like any other.)"""
        out: list[_Candidate] = []
        top = self.results[0].timeline.iteration_s
        for c in self.results:
            if c.timeline.iteration_s > top * (1 + within) or len(out) >= most:
                break
            if all(o.schedule != c.schedule for o in out):
                out.append(c)
        return out

    def unit_times(self, cand: _Candidate) -> dict[str, float]:
        """Each single-node unit's fwd+bwd time on its fastest device, by node name."""
        fwd, bwd = self.times(cand.units,
                              rep.slice_size(self.opt.batch_size // cand.microbatches, cand.replicas))
        best = (fwd + bwd).min(axis=0)
        return {names[-1]: float(best[u]) for u, names in enumerate(cand.units.names)}

    # ------------------------------------------------------------------ output
    def bound_problem(self, prob: PartitionProblem, order: Sequence[int],
                      mb: int) -> PartitionProblem:
        """`prob` with the costs a lower bound may use: each device model's `floor_times`
        where it has them (FPGA: the MAC floor, which no stage holding the unit can beat,
        while the additive unit times the partitioner uses may exceed a dataflow stage's;
        units whose on-chip memory alone exceeds the card count as unable to run there)."""
        floors = [self.costs[order[k % self.p]].floor_times(mb)
                  for k in range(len(prob.mem_cap))]
        if all(f is None for f in floors):
            return prob
        fwd, bwd = np.array(prob.fwd, dtype=float), np.array(prob.bwd, dtype=float)
        for k, floor in enumerate(floors):
            if floor is not None:
                fwd[k], bwd[k] = floor
        return dataclasses.replace(prob, fwd=fwd, bwd=bwd)

    def lower_bound(self, cand: _Candidate, comm: bool = True) -> float:
        """A bottleneck no plan with the candidate's micro-batch count beats, whatever its cuts,
        layer splits or replication degree: the least over every degree d the devices and the
        micro-batch allow (`passes.replicas.allowed`, whatever --replicas asked) of
        `partition.lower_bound` on that degree's problem (P = n/d groups at a slice of mb/d,
        `passes.replicas.group_problem`; d = 1: the candidate's devices with `bound_problem`'s
        costs). Each is valid for its d because the group problem *is* the partitioner's
        model of every d-replicated plan, so the least is valid for all. comm=False: the
        comm-blind bound of earlier releases (reported next to it)."""
        mb = self.opt.batch_size // cand.microbatches
        unreplicable = not all(dev.can(caps.REPLICATE) for dev in self.cluster.devices)
        best = math.inf
        for d in rep.allowed("auto", self.p, mb, unreplicable):
            if d == cand.replicas:
                units, prob = cand.units, cand.problem
            elif self.p // d > cand.units.n:
                continue
            else:
                units = self.builder.at(rep.slice_size(mb, d))
                order = cand.order if d == 1 else tuple(range(self.p))
                # NOTE: the schedule only sets in-flight counts (memory), which no bound uses
                prob = self.problem(units, rep.slice_size(mb, d), "1f1b", cand.microbatches, order, 1, d=d)
            if d == 1:
                prob = self.bound_problem(prob, cand.order, mb)
            best = min(best, lower_bound(prob, units.splittable, comm=comm))
        return best

    def baselines(self, cand: _Candidate) -> list[dict[str, Any]]:
        """The partitions other tools would produce, on the same cost model."""
        units, prob = cand.units, cand.raw or cand.problem
        p, mb = len(prob.mem_cap), rep.slice_size(self.opt.batch_size // cand.microbatches, cand.replicas)
        fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
        ref_times = fwd[0] + bwd[0]
        out = []
        for name, bounds in [
            ("equal-count (torch.distributed.pipelining)", baselines.equal_count(units.n, p)),
            ("equal-params (DeepSpeed parameters)", baselines.equal_params(units.param_bytes, p)),
            ("block-partition by time (torchgpipe)", baselines.block_partition(ref_times, p)),
        ]:
            _, part = self.recost(prob, bounds, cand.order, mb, cand.replicas)
            out.append({"name": name, "bounds": list(part.bounds), "bottleneck_s": part.bottleneck,
                        "fits_memory": bool(getattr(part, "fits", True))})
        return out

    def to_plan(self, cand: _Candidate, lost: list[dict[str, Any]]) -> Plan:
        """The Plan of `cand`. With replicas d > 1, stage k runs on pipeline rank j = k % P
        (P = n/d): devices j*d .. j*d+d-1 (`StagePlan.replica_devices`, `device` = j*d), its
        forward_s/backward_s a replica's (slice of mb/d, slowest member), `allreduce_s` its
        group's gradient all-reduce per iteration. `bottleneck_s` stays the steady-state
        seconds per micro-batch of B/m samples (the P-rank pipeline of groups; the all-reduce,
        once per iteration, is in `predicted_iteration_s`), so it and `lower_bound_s` compare
        across d."""
        part, units, prob = cand.part, cand.units, cand.problem
        fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
        lb, lb_compute = self.lower_bound(cand), self.lower_bound(cand, comm=False)
        d, P = cand.replicas, cand.ranks
        weights = self.weight_times(part, prob, cand.order,
                                    rep.slice_size(self.opt.batch_size // cand.microbatches, d), d)
        stages = []
        for k in range(len(part.bounds) - 1):
            a, e = part.bounds[k], part.bounds[k + 1]
            names = [nm for u in range(a, e) for nm in units.names[u]]
            recv = part.cut_bytes[k - 1] if k > 0 else 0.0
            send = part.cut_bytes[k] if k < len(part.cut_bytes) else 0.0
            comm = 2 * prob.link_time(k - 1, recv) if k > 0 else 0.0
            comm += 2 * prob.link_time(k, send) if k < len(part.bounds) - 2 else 0.0
            stages.append(StagePlan(
                index=k, device=(k % P) * d, nodes=names,
                forward_s=float(fwd[k, a:e].sum()), backward_s=float(bwd[k, a:e].sum()),
                backward_weight_s=weights[k],
                send_bytes=int(send), recv_bytes=int(recv), comm_s=float(comm),
                peak_memory_bytes=int(cand.timeline.peak_memory_bytes[k % P])
                if cand.virtual == 1 else int(part.stage_memory[k]),
                forward_flops=int(units.values["forward_flops"][a:e].sum()),
                param_bytes=int(units.param_bytes[a:e].sum()),
                time_source=time_source(self.costs[cand.order[(k % P) * d]], names),
                recompute=bool(cand.recompute[k]) if cand.recompute else False,
                replica_devices=list(range((k % P) * d, (k % P) * d + d)) if d > 1 else [],
                allreduce_s=float(cand.allreduce[k]) if cand.allreduce else 0.0))
        decisions = [f"schedule {cand.schedule} with {count(cand.microbatches, 'micro-batch')} of "
                     f"{self.opt.batch_size // cand.microbatches}: predicted "
                     f"{cand.timeline.iteration_s:.4g} s per iteration, bubble "
                     f"{cand.timeline.bubble_fraction:.1%}"]
        if cand.order != tuple(range(self.p)):
            decisions.append(f"device order {list(cand.order)} (chosen among interchangeable types)")
        decisions += rep.decisions(self, cand)
        decisions += profile_decisions(self.costs, self.cluster,
                                       rep.slice_size(self.opt.batch_size // cand.microbatches, d))
        decisions += cand.notes  # e.g. which stages recompute their activations, and why
        if bool(cand.thresholds) == bool(self.estimate.get("used")):  # BPipe used or not, and why
            decisions += getattr(self, "_bpipe_notes", [])
        return Plan(
            model=self.graph.model_name, batch_size=self.opt.batch_size,
            microbatches=cand.microbatches, schedule=cand.schedule,
            devices=[{"name": self.cluster.devices[d].name, "kind": self.cluster.devices[d].kind,
                      "placement": self.cluster.devices[d].placement, "given_index": d}
                     for d in cand.order],
            stages=stages, split_layers=[], bottleneck_s=float(part.bottleneck),
            lower_bound_s=float(lb), lower_bound_compute_s=float(lb_compute),
            predicted_iteration_s=float(cand.timeline.iteration_s),
            bubble_fraction=float(cand.timeline.bubble_fraction), dtype=self.opt.dtype,
            activation_balancing=bpipe_pass.plan_fields(cand), estimate=dict(self.estimate),
            virtual_stages=cand.virtual, decisions=decisions, alternatives=lost, replicas=d,
            baselines=self.baselines(cand) if self.opt.compare else [],
            options={"coarse": self.opt.coarse, "choose_order": self.opt.choose_order,
                     "training": self.opt.training, "recompute": self.opt.recompute,
                     "activation_balancing": self.opt.activation_balancing,
                     "flash_attention": self.opt.flash_attention,
                     "replicas_requested": self.opt.replicas,
                     **{k: x for c in self.costs for k, x in c.plan_options().items()}})
