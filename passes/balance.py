"""The balance pass: choose schedule, micro-batch count, device order, layer splits and cuts.

    costed graph + cluster ─► units (passes.units) ─► for each (schedule, m): partition
    (passes.partition, exact) ─► simulate (passes.simulate) ─► the fastest that fits memory
    ─► intra-layer split of layers too heavy for a balanced cut (passes.split_layers) ─► Plan

Time of a unit on a device is the device's roofline (`Device.compute_time`): forward on the
forward FLOPs and bytes, backward on the backward FLOPs and twice the bytes (it reads the
output gradient and the stash and writes the input gradient). FPGA devices get an infinite
time for op kinds the FPGA backend cannot generate, which keeps such nodes off them.
Memory per stage: weights, gradients and optimizer state (Adam: 2 fp32 moments, so 4x the
weights' bytes in training), plus the activations stashed per micro-batch in flight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipecc.devices import Cluster
from pipecc.errors import PipeccError, UsageError
from pipecc.ir import AnnotatedGraph
from pipecc.plan import Plan, StagePlan
from pipecc.schedule import gpipe, interleaved_1f1b, one_f_one_b
from pipecc.passes import baselines
from pipecc.passes.partition import (InfeasibleError, Partition, PartitionProblem, evaluate,
                                     lower_bound, partition)
from pipecc.passes.simulate import StageCosts, Timeline, simulate
from pipecc.passes.units import Units, UnitBuilder

SCHEDULES = ("gpipe", "1f1b", "interleaved")
MEMORY_HEADROOM = 0.9  # framework workspace, allocator fragmentation: plan to 90% of capacity
# NOTE: a finite stand-in for "cannot run here": the partitioner's bisection needs finite
# costs; any placement whose bottleneck reaches it has put an unsupported op on an FPGA.
UNSUPPORTED_S = 1e9


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


def _inflight(schedule: str, p: int, m: int, v: int) -> list[int]:
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - k, m) for k in range(p)]
    # interleaved: rank r holds its v stages' activations; spread over them evenly
    prof = interleaved_1f1b(p // v, m, v).rank_stash_profile()
    return [math.ceil(prof[k % (p // v)] / v) for k in range(p)]


def _schedule(schedule: str, p: int, m: int, v: int):
    if schedule == "gpipe":
        return gpipe(p, m)
    if schedule == "1f1b":
        return one_f_one_b(p, m)
    return interleaved_1f1b(p, m, v)


class Balancer:
    """Holds the graph, cluster and options; `run()` returns the Plan."""

    def __init__(self, graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions,
                 splittable: Sequence[str] = ()) -> None:
        self.graph, self.cluster, self.opt = graph, cluster, options
        self.builder = UnitBuilder(graph, coarse=options.coarse, splittable=splittable)
        self.p = len(cluster.devices)
        self._times: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    # ------------------------------------------------------------------ costs
    def times(self, units: Units, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """[device][unit] forward and backward seconds at micro-batch size mb."""
        if mb in self._times:
            return self._times[mb]
        v = units.values
        fwd = np.zeros((self.p, units.n))
        bwd = np.zeros((self.p, units.n))
        for d, dev in enumerate(self.cluster.devices):
            if dev.kind == "fpga":
                fwd[d], bwd[d] = self._fpga_times(dev, mb)
                continue
            for u in range(units.n):
                fwd[d, u] = dev.compute_time(v["forward_flops"][u], v["forward_flops_matmul"][u],
                                             v["bytes_moved"][u], self.opt.dtype)
                bwd[d, u] = dev.compute_time(v["backward_flops"][u], v["backward_flops_matmul"][u],
                                             2 * v["bytes_moved"][u], self.opt.dtype) \
                    if self.opt.training else 0.0
        self._times[mb] = (fwd, bwd)
        return fwd, bwd

    def _fpga_times(self, dev: Any, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """Per-unit seconds on an FPGA from the analytic model that writes estimates.json
        (`pipecc.fpga_model`): additive shares of the dataflow stage time of all supported
        nodes on this card. Units with an op the FPGA backend cannot generate get
        UNSUPPORTED_S. Backward (training) is costed as twice the forward, as a dataflow
        design of the transposed products would take; the FPGA backend itself generates
        inference only (see `pipecc run`)."""
        from pipecc import fpga_model
        nodes = [n for g in self.builder.groups for n in g]
        ok = {n for n in nodes if fpga_model.supported(n)}
        shares: dict[str, float] = {}
        for _ in range(len(nodes)):
            # supported() judges a node alone; lowering also checks it in context (a
            # broadcasting add, a reshape across the batch): drop what lowering refuses
            try:
                shares = fpga_model.node_times_s([n for n in nodes if n in ok and n.op != "get_attr"],
                                                 dev.name, self.opt.dtype, mb, self.graph.point)
                break
            except fpga_model.UnsupportedOpError as exc:
                refused = {n for n in ok if n.meta.get("pipecc.name") == exc.node or n.name == exc.node}
                if not refused:
                    raise
                ok -= refused
        fwd = np.zeros(len(self.builder.groups))
        for u, g in enumerate(self.builder.groups):
            if not all(n in ok for n in g):
                fwd[u] = UNSUPPORTED_S
            else:
                fwd[u] = sum(shares.get(n.name, 0.0) for n in g)
        return fwd, (2 * fwd if self.opt.training else np.zeros_like(fwd))

    def problem(self, units: Units, mb: int, schedule: str, m: int, order: Sequence[int],
                v: int = 1) -> PartitionProblem:
        fwd, bwd = self.times(units, mb)
        devs = [order[k % self.p] for k in range(self.p * v)]
        states = (2 + self.opt.optimizer_states) if self.opt.training else 1
        static = units.param_bytes * states
        caps = [self.cluster.devices[d].memory_bytes * MEMORY_HEADROOM / v for d in devs]
        links = [self.cluster.link(devs[k], devs[k + 1]) if devs[k] != devs[k + 1] else None
                 for k in range(len(devs) - 1)]

        def link_time(k: int, nbytes: float) -> float:
            return links[k].time(nbytes) if links[k] is not None and nbytes > 0 else 0.0
        return PartitionProblem(
            fwd=fwd[devs], bwd=bwd[devs], out_bytes=units.values["output_bytes"],
            last_use=units.last_use, static_mem=static,
            act_mem=units.values["stash_bytes"] if self.opt.training else np.zeros(units.n),
            mem_cap=caps, inflight=_inflight(schedule, self.p * v, m, v) if self.opt.training
            else [1] * (self.p * v), link_time=link_time)

    # ------------------------------------------------------------------ search
    def candidates(self) -> list[tuple[str, int]]:
        b = self.opt.batch_size
        if self.opt.microbatches == "auto":
            ms = [m for m in range(1, b + 1) if b % m == 0 and m <= 64]
        else:
            m = int(self.opt.microbatches)
            if m < 1 or b % m:
                raise UsageError(f"--microbatches {m} must divide the batch size {b}")
            ms = [m]
        if not self.opt.training:
            return [("inference", m) for m in ms]
        scheds = SCHEDULES if self.opt.schedule == "auto" else (self.opt.schedule,)
        out = []
        for s in scheds:
            for m in ms:
                if s == "interleaved" and (m % self.p or self.opt.virtual_stages < 2):
                    continue
                out.append((s, m))
        if not out:
            raise UsageError(f"--schedule interleaved needs a micro-batch count divisible by "
                             f"{self.p} devices")
        return out

    def evaluate_candidate(self, schedule: str, m: int) -> _Candidate:
        mb = self.opt.batch_size // m
        units = self.builder.at(mb)
        v = self.opt.virtual_stages if schedule == "interleaved" else 1
        order = tuple(range(self.p))
        prob = self.problem(units, mb, schedule, m, order, v)
        if self.opt.choose_order and v == 1 and self.p > 1:
            order, part = self._best_order(units, mb, schedule, m)
            prob = self.problem(units, mb, schedule, m, order, v)
        else:
            part = partition(prob)
        if part.bottleneck >= UNSUPPORTED_S:
            raise InfeasibleError(self._unsupported_message(units, order))
        timeline = self._simulate(part, prob, schedule, m, v)
        return _Candidate(schedule, m, order, part, prob, units, timeline, v)

    def _best_order(self, units: Units, mb: int, schedule: str, m: int):
        from pipecc.passes.partition import best_device_order
        types = [d.name for d in self.cluster.devices]
        return best_device_order(lambda order: self.problem(units, mb, schedule, m, order), types)

    def _simulate(self, part: Partition, prob: PartitionProblem, schedule: str, m: int,
                  v: int) -> Timeline:
        stages = len(part.bounds) - 1
        fwd = np.asarray(prob.fwd)
        bwd = np.asarray(prob.bwd)
        f = [float(fwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        b = [float(bwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        send = [prob.link_time(k, part.cut_bytes[k]) if k < stages - 1 else 0.0 for k in range(stages)]
        back = [0.0] + send[:-1]
        act = [float(np.asarray(prob.act_mem)[part.bounds[k]:part.bounds[k + 1]].sum())
               for k in range(stages)]
        static = [float(np.asarray(prob.static_mem)[part.bounds[k]:part.bounds[k + 1]].sum())
                  for k in range(stages)]
        costs = StageCosts.per_stage(m, f, b, send_forward_s=send, send_backward_s=back,
                                     activation_bytes=act, static_bytes=static)
        if schedule == "inference":
            from pipecc.schedule import inference
            sched = inference(stages, m)
        else:
            sched = _schedule(schedule, stages // v, m, v) if v > 1 else _schedule(schedule, stages, m, 1)
        return simulate(sched, costs)

    def _unsupported_message(self, units: Units, order: Sequence[int]) -> str:
        from pipecc import fpga_model
        fpgas = [f"{k} ({self.cluster.devices[d].name})" for k, d in enumerate(order)
                 if self.cluster.devices[d].kind == "fpga"]
        bad = [n for g in self.builder.groups for n in g if not fpga_model.supported(n)]
        example = f"{bad[0].meta['pipecc.op']} at node {bad[0].meta['pipecc.name']}" if bad else "?"
        return (f"FPGA device {', '.join(fpgas)} would have to run ops the FPGA backend cannot "
                f"generate (e.g. {example}); put a CPU/GPU there or use --choose-order")

    def run(self) -> tuple[Plan, _Candidate]:
        if self.p > self.builder.at(1).n:
            raise PipeccError(f"{self.p} devices but only {self.builder.at(1).n} units to place; "
                              "use fewer devices" + ("" if self.opt.coarse else ""))
        results: list[_Candidate] = []
        lost: list[dict[str, Any]] = []
        for schedule, m in self.candidates():
            try:
                results.append(self.evaluate_candidate(schedule, m))
            except InfeasibleError as exc:
                lost.append({"schedule": schedule, "microbatches": m, "reason": str(exc)})
        if not results:
            reason = lost[0]["reason"] if lost else "no candidate"
            raise PipeccError(reason if reason.startswith("FPGA") else f"no schedule fits memory: {reason}")
        results.sort(key=lambda c: (c.timeline.iteration_s, c.microbatches))
        best = results[0]
        for c in results[1:]:
            lost.append({"schedule": c.schedule, "microbatches": c.microbatches,
                         "reason": f"slower: {c.timeline.iteration_s:.4g} s per iteration "
                                   f"(bubble {c.timeline.bubble_fraction:.1%}) vs "
                                   f"{best.timeline.iteration_s:.4g} s"})
        return self.to_plan(best, lost), best

    def unit_times(self, cand: _Candidate) -> dict[str, float]:
        """Each single-node unit's fwd+bwd time on its fastest device, by node name."""
        fwd, bwd = self.times(cand.units, self.opt.batch_size // cand.microbatches)
        best = (fwd + bwd).min(axis=0)
        return {names[-1]: float(best[u]) for u, names in enumerate(cand.units.names)}

    # ------------------------------------------------------------------ output
    def lower_bound(self, cand: _Candidate) -> float:
        return lower_bound(cand.problem, cand.units.splittable, unusable=UNSUPPORTED_S)

    def baselines(self, cand: _Candidate) -> list[dict[str, Any]]:
        """The partitions other tools would produce, on the same cost model."""
        units, prob = cand.units, cand.problem
        p = len(prob.mem_cap)
        fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
        ref_times = fwd[0] + bwd[0]
        out = []
        for name, bounds in [
            ("equal-count (torch.distributed.pipelining)", baselines.equal_count(units.n, p)),
            ("equal-params (DeepSpeed parameters)", baselines.equal_params(units.param_bytes, p)),
            ("block-partition by time (torchgpipe)", baselines.block_partition(ref_times, p)),
        ]:
            part = evaluate(prob, bounds)
            out.append({"name": name, "bounds": list(part.bounds), "bottleneck_s": part.bottleneck,
                        "fits_memory": bool(getattr(part, "fits", True))})
        return out

    def to_plan(self, cand: _Candidate, lost: list[dict[str, Any]]) -> Plan:
        part, units, prob = cand.part, cand.units, cand.problem
        fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
        lb = self.lower_bound(cand)
        stages = []
        for k in range(len(part.bounds) - 1):
            a, e = part.bounds[k], part.bounds[k + 1]
            recv = part.cut_bytes[k - 1] if k > 0 else 0.0
            send = part.cut_bytes[k] if k < len(part.cut_bytes) else 0.0
            comm = 2 * prob.link_time(k - 1, recv) if k > 0 else 0.0
            comm += 2 * prob.link_time(k, send) if k < len(part.bounds) - 2 else 0.0
            stages.append(StagePlan(
                index=k, device=k % self.p, nodes=[nm for u in range(a, e) for nm in units.names[u]],
                forward_s=float(fwd[k, a:e].sum()), backward_s=float(bwd[k, a:e].sum()),
                send_bytes=int(send), recv_bytes=int(recv), comm_s=float(comm),
                peak_memory_bytes=int(cand.timeline.peak_memory_bytes[k % self.p])
                if cand.virtual == 1 else int(part.stage_memory[k]),
                forward_flops=int(units.values["forward_flops"][a:e].sum()),
                param_bytes=int(units.param_bytes[a:e].sum())))
        decisions = [f"schedule {cand.schedule} with {cand.microbatches} micro-batches of "
                     f"{self.opt.batch_size // cand.microbatches}: predicted "
                     f"{cand.timeline.iteration_s:.4g} s per iteration, bubble "
                     f"{cand.timeline.bubble_fraction:.1%}"]
        if cand.order != tuple(range(self.p)):
            decisions.append(f"device order {list(cand.order)} (chosen among interchangeable types)")
        return Plan(
            model=self.graph.model_name, batch_size=self.opt.batch_size,
            microbatches=cand.microbatches, schedule=cand.schedule,
            devices=[{"name": self.cluster.devices[d].name, "kind": self.cluster.devices[d].kind,
                      "placement": self.cluster.devices[d].placement, "given_index": d}
                     for d in cand.order],
            stages=stages, split_layers=[], bottleneck_s=float(part.bottleneck),
            lower_bound_s=float(lb), predicted_iteration_s=float(cand.timeline.iteration_s),
            bubble_fraction=float(cand.timeline.bubble_fraction), dtype=self.opt.dtype,
            virtual_stages=cand.virtual, decisions=decisions, alternatives=lost,
            baselines=self.baselines(cand) if self.opt.compare else [],
            options={"coarse": self.opt.coarse, "choose_order": self.opt.choose_order,
                     "training": self.opt.training})


def plan(graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions) -> Plan:
    """Plan without layer splitting (see `pipecc.driver.plan` for the whole pipeline)."""
    return Balancer(graph, cluster, options).run()[0]

