"""The one cost model: what a unit, a stage, a message and its weight gradients cost on each device.

What a unit costs on a device, in time and memory, is that device's cost model
(`pipecc.targets.timing.DeviceCosts`, picked once per device type by `device_costs`): the
roofline for CPUs and GPUs, measured curves where a `pipecc profile` timed the device, the
FPGA model behind estimates.json for FPGA cards. To these it adds the fixed costs of
`pipecc.targets.fixed_costs` (per op call, the small-kernel half-rate work, per micro-batch
per stage, per iteration per stage, per message; that module's docstring has the formulas).
`CostTables` (also `CostModel`) holds them for one graph and cluster and answers every
numeric question the planner, the simulator, UMPIPE, BPipe, Bi-Partition, replica groups
and, through plan.json, the report and `run --json` ask; none of them has a model of its own:

    times(units, mb)          [device][unit] forward and backward seconds (cached per mb),
                              the per-call fixed costs included
    unit_fixed(d)             [unit] that per-call part on device d (forward, backward)
    stage_fixed(d)            one micro-batch's per-stage fixed forward and backward seconds
    stage_host(d)             the part of it that is host work outside the stage timers (calibrated)
    step_s(d)                 a stage's per-iteration fixed seconds (optimizer step)
    link_time(i, j, nbytes)   one message from device i to j: the link plus both hosts' costs
    recost(prob, bounds, ..)  a partition with each stage re-costed as a whole where its
                              device's model says so (FPGA dataflow stages: estimates.json)
    weight_times(part, ..)    [stage] the weight-gradient share of each backward (zero-bubble W)
    bound_problem(prob, ..)   the costs a lower bound may use (FPGA: the MAC floor)
    unit_times(units, mb)     each single-node unit's time on its fastest device (layer splits)

Pure numbers over the device models; the problems built from them are `passes.plan_problem`'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from pipecc.ir.graph import META_COST, META_NAME, AnnotatedGraph
from pipecc.passes.partition import Partition, PartitionProblem, evaluate
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.units import UnitBuilder, Units
from pipecc.targets.calibrated import CalibratedCosts, Calibration
from pipecc.targets import fixed_costs as fixed_mod
from pipecc.targets.fixed_costs import FixedCosts
from pipecc.targets.fpga_timing import FpgaCosts
from pipecc.targets.hardware import Cluster, Device
from pipecc.targets.profiled import ProfiledCosts
from pipecc.targets.timing import CANNOT_RUN_S, DeviceCosts, RooflineCosts

__all__ = ["CostModel", "CostTables", "device_costs", "fixed_for"]

CALL_OPS = ("call_module", "call_function", "call_method")


def device_costs(device: Device, builder: UnitBuilder, options: PlanOptions) -> DeviceCosts:
    """The one place that picks a device's cost model: FPGA cards get the FPGA model of
    estimates.json (in the plan's FPGA number format), a device the profile timed its
    measured curves (the roofline for nodes without one), everything else the roofline; with
    --calibrate (`options.calibrate`, a Calibration) a CPU's or GPU's model is scaled by the run's factors."""
    if device.kind == "fpga":
        return FpgaCosts(device, builder.graph, builder.groups,
                         number=options.fpga_number or options.dtype, training=options.training)
    roofline = RooflineCosts(device, dtype=options.compute_dtype, training=options.training,
                             optimizer_states=options.optimizer_states)
    target = options.profile.target_for(device) if options.profile is not None else None
    costs: DeviceCosts = roofline if target is None else ProfiledCosts(
        roofline, builder.graph, builder.groups, options.profile, target)
    # NOTE: --calibrate scales what the model above predicts by what a run measured
    return costs if options.calibrate is None else CalibratedCosts(costs, options.calibrate)


def fixed_for(cluster: Cluster, options: PlanOptions) -> list[FixedCosts]:
    """[device] its fixed costs (`fixed_costs.fixed_costs_for`); a CPU device's defaults grow
    by `fixed_costs.host_share` of the cluster's CPU ranks (a profile's figures were measured
    with the plan's ranks running: they already hold it)."""
    cpus = sum(1 for dev in cluster.devices if dev.kind == "cpu")
    out = []
    for dev in cluster.devices:
        fixed = fixed_mod.fixed_costs_for(dev, options.profile)
        if dev.kind == "cpu" and fixed is fixed_mod.DEFAULTS.get("cpu"):
            fixed = fixed.scaled(fixed_mod.host_share(cpus))
        out.append(fixed)
    return out


def _is_getitem(node: Any) -> bool:
    """A tuple index (operator.getitem): Python, no dispatched op."""
    return node.op == "call_function" and getattr(node.target, "__name__", "") == "getitem"


class CostTables:
    """One graph's costs on one cluster under `options` (module docstring). `costs[d]` is
    device d's model; devices of one type share it (the FPGA model caches its costs);
    `fixed[d]` its fixed costs."""

    def __init__(self, graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions,
                 splittable: Sequence[str] = ()) -> None:
        assert isinstance(options.batch_size, int), "the driver resolves batch_size first"
        self.graph, self.cluster, self.options = graph, cluster, options
        self.builder = UnitBuilder(graph, coarse=options.coarse, splittable=splittable)
        self.p = len(cluster.devices)
        models: dict[str, DeviceCosts] = {}
        for dev in cluster.devices:
            if dev.name not in models:
                models[dev.name] = device_costs(dev, self.builder, options)
        self.costs: list[DeviceCosts] = [models[dev.name] for dev in cluster.devices]
        self.fixed: list[FixedCosts] = fixed_for(cluster, options)
        # NOTE: --calibrate may lower a device's fixed part (a stage measured under it)
        cal = options.calibrate if isinstance(options.calibrate, Calibration) else None
        self.fixed_factors = [cal.fixed_factor(dev.name) if cal is not None else (1.0, 1.0)
                              for dev in cluster.devices]
        # NOTE: an FPGA card keeps its model: its rank's host work is the CPU emulation's
        self.host = [cal.host_s(dev.name) if cal is not None and dev.kind != "fpga" else 0.0
                     for dev in cluster.devices]
        self._unit_fixed: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._times: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._shares: dict[int, np.ndarray] = {}  # mb -> [device][unit] weight_share
        self._link_memo: dict[tuple[int, int, float], float] = {}  # (i, j, bytes) -> link_time

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
        for d in range(self.p):
            f, b = self.unit_fixed(d)
            fwd[d] += f
            bwd[d] += b
        self._times[mb] = (fwd, bwd)
        return fwd, bwd

    def unit_fixed(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """[unit] the per-call fixed forward and backward seconds on device d, whatever the
        micro-batch (`pipecc.targets.fixed_costs` docstring): op_forward_s / op_backward_s per
        node the device runs without a measured curve (a curve holds its own), and w_half/rate
        per matmul-class node (twice in the backward), times the calibration's fixed factors
        (`Calibration.fixed_factor`, 1 without). Zero on an FPGA card (its model has them) and
        for the backward of a forward-only plan."""
        if d in self._unit_fixed:
            return self._unit_fixed[d]
        dev, fixed, groups = self.cluster.devices[d], self.fixed[d], self.builder.groups
        for e in self._unit_fixed:  # NOTE: a device like one done already (its type, model, fixed costs)
            other = self.cluster.devices[e]
            if (other.kind == dev.kind and self.costs[e] is self.costs[d]
                    and other.attainable_flops(self.options.compute_dtype, matmul=True)
                    == dev.attainable_flops(self.options.compute_dtype, matmul=True)
                    and self.fixed[e] == fixed and self.fixed_factors[e] == self.fixed_factors[d]):
                self._unit_fixed[d] = self._unit_fixed[e]
                return self._unit_fixed[d]
        f, b = np.zeros(len(groups)), np.zeros(len(groups))
        if dev.kind != "fpga":
            curves = getattr(self.costs[d], "curves", {})  # ProfiledCosts: measured nodes
            rate = dev.attainable_flops(self.options.compute_dtype, matmul=True)
            half = fixed_mod.HALF_RATE_WORK.get(dev.kind, 0.0) / rate if rate > 0 else 0.0
            for u, group in enumerate(groups):
                calls = [n for n in group if n.op in CALL_OPS and not _is_getitem(n)
                         and n.meta[META_NAME] not in curves]
                matmuls = sum(1 for n in calls if n.meta[META_COST].forward_flops_matmul != 0)
                f[u] = len(calls) * fixed.op_forward_s + matmuls * half
                if self.options.training:
                    b[u] = len(calls) * fixed.op_backward_s + 2 * matmuls * half
        g_f, g_b = self.fixed_factors[d]
        self._unit_fixed[d] = (f * g_f, b * g_b)
        return self._unit_fixed[d]

    def piece_fixed(self, d: int) -> np.ndarray:
        """[unit] the per-call fixed seconds (forward + backward) every piece of the unit pays on
        device d when a layer split divides it (`bound.lower_bound`'s `split_fixed`): each
        stage holding part of a split layer holds at least one op call of its rewrite (a
        shard, a shard's helper, the combine: `passes.split_layers`), and each call pays
        op_forward_s (+ op_backward_s when training) times the calibration's fixed factors.
        At most the unit's own per-call fixed cost (`unit_fixed`), so never more than the
        unit's time: 0 on an FPGA card and for a unit whose calls all run on measured curves.
        The matmul half-rate term is left out (a helper such as a narrow has none)."""
        f, b = self.unit_fixed(d)
        if self.cluster.devices[d].kind == "fpga":
            return np.zeros_like(f)
        fixed, (g_f, g_b) = self.fixed[d], self.fixed_factors[d]
        op = fixed.op_forward_s * g_f + (fixed.op_backward_s * g_b if self.options.training else 0.0)
        return np.minimum(op, f + b)

    def stage_fixed(self, d: int) -> tuple[float, float]:
        """One micro-batch's per-stage fixed forward and backward seconds on device d:
        microbatch_s split by MICROBATCH_FORWARD_SHARE (forward only without training), times
        the calibration's fixed factors."""
        mb_s, share = self.fixed[d].microbatch_s, fixed_mod.MICROBATCH_FORWARD_SHARE
        g_f, g_b = self.fixed_factors[d]
        h_f, h_b = self.stage_host(d)
        if not self.options.training:
            return mb_s * share * g_f + h_f, 0.0
        return mb_s * share * g_f + h_f, mb_s * (1.0 - share) * g_b + h_b

    def stage_host(self, d: int) -> tuple[float, float]:
        """The part of `stage_fixed(d)` that is host work outside the stage's timed actions per
        micro-batch, forward and backward: a calibrating run's measured `host_s`
        (`Calibration.host_s`), split by MICROBATCH_FORWARD_SHARE (all forward without
        training); 0 uncalibrated."""
        h = self.host[d]
        if not self.options.training:
            return h, 0.0
        share = fixed_mod.MICROBATCH_FORWARD_SHARE
        return h * share, h * (1.0 - share)

    def step_s(self, d: int) -> float:
        """A stage's per-iteration fixed seconds on device d (optimizer step; 0 without
        training)."""
        return self.fixed[d].step_s if self.options.training else 0.0

    def message_s(self, i: int, j: int) -> float:
        """Both hosts' cost of one message from device i to j: message_s of each, none on a
        measured link (a `pipecc profile` ping-pong holds them)."""
        link = self.cluster.link(i, j)
        if link.name.startswith("measured "):
            return 0.0
        return self.fixed[i].message_s + self.fixed[j].message_s

    def link_time(self, i: int, j: int, nbytes: float) -> float:
        """Seconds of one message of nbytes from device i to device j: the link's latency and
        bandwidth plus `message_s`; 0 for no bytes or the same device. (Remembered: the
        partitioner asks for every cut's bytes on every link, candidate after candidate.)"""
        if nbytes <= 0 or i == j:
            return 0.0
        key = (i, j, nbytes)
        t = self._link_memo.get(key)
        if t is None:
            t = self._link_memo[key] = self.cluster.link(i, j).time(nbytes) + self.message_s(i, j)
        return t

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

    def weight_times(self, part: Partition, prob: PartitionProblem, order: Sequence[int],
                     mb: int, d: int = 1) -> list[float]:
        """[stage] seconds of the stage's backward that compute weight gradients (zero-bubble
        W): its units' backward seconds in `prob` times their device's `weight_share` (with d
        replicas, `mb` is a replica's slice and stage k's device the first of group k % (p/d))."""
        if mb not in self._shares:
            units = self.builder.at(mb)
            shares: dict[int, np.ndarray] = {}  # NOTE: devices of one type share their model
            self._shares[mb] = np.stack([shares[id(c)] if id(c) in shares else
                                         shares.setdefault(id(c), c.weight_share(units, mb))
                                         for c in self.costs])
        share, bwd = self._shares[mb], np.array(prob.bwd, dtype=float)
        redo = prob.recompute or []
        out = []
        for k in range(len(part.bounds) - 1):
            a, e = part.bounds[k], part.bounds[k + 1]
            own = bwd[k, a:e] - (np.asarray(prob.fwd)[k, a:e] if k < len(redo) and redo[k] else 0.0)
            dev = order[(k % (self.p // d)) * d]
            out.append(float((own * share[dev, a:e]).sum()))  # a re-run forward is I's
        return out

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

    def unit_times(self, units: Units, mb: int) -> dict[str, float]:
        """Each single-node unit's fwd+bwd time on its fastest device, by node name."""
        fwd, bwd = self.times(units, mb)
        best = (fwd + bwd).min(axis=0)
        return {names[-1]: float(best[u]) for u, names in enumerate(units.names)}


CostModel = CostTables  # NOTE: the one cost model's name (issue #20); CostTables is its history
