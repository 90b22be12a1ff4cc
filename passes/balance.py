"""The balance pass: choose schedule, micro-batch count, device order, layer splits and cuts.

    costed graph + cluster ─► units (passes.units) ─► for each (schedule, m): partition
    (passes.partition, exact) ─► simulate (passes.simulate) ─► the fastest that fits memory
    ─► intra-layer split of layers too heavy for a balanced cut (passes.split_layers) ─► Plan

Time of a unit on a device is the device's roofline (`Device.compute_time`): forward on the
forward FLOPs and bytes, backward on the backward FLOPs and twice the bytes (it reads the
output gradient and the stash and writes the input gradient). On an FPGA a unit costs what
the FPGA model (`pipecc.targets.fpga_model`, the one behind estimates.json) gives its processes,
summed over a stage for the exact partitioner; the chosen partition's FPGA stages are then
re-costed with the model's dataflow time of the whole stage (`Balancer.recost`), so the plan
and estimates.json agree. Ops the FPGA backend cannot generate get an infinite time, and cuts
next to an FPGA stage must carry exactly one float32 tensor (`PartitionProblem.blocked`),
which keeps what the backend cannot build off FPGAs.
Memory per stage: weights, gradients and optimizer state (Adam: 2 fp32 moments, so 4x the
weights' bytes in training), plus the activations stashed per micro-batch in flight.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from pipecc.targets.devices import Cluster
from pipecc.errors import PipeccError, UsageError
from pipecc.targets.fpga_model import parse_number
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan, StagePlan
from pipecc.ir.schedule import gpipe, interleaved_1f1b, one_f_one_b
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
BRAM18_BYTES = 18 * 1024 / 8  # one BRAM18 block: an FPGA stage's memory is counted in these


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
    raw: PartitionProblem | None = None   # before FPGA stages were re-costed (for baselines)


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
        self._cycles: dict[tuple[str, str], np.ndarray] = {}

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

    def _fpga_number(self) -> str:
        return self.opt.fpga_number or self.opt.dtype

    def _fpga_cycles(self, dev: Any) -> np.ndarray:
        """[unit] (latency, interval, floor, clock, bram18) of each unit on an FPGA card
        (`fpga_model.unit_cycles`); NaN rows for units the FPGA backend cannot generate."""
        from pipecc.targets import fpga_model
        key = (dev.name, self._fpga_number())
        if key not in self._cycles:
            rows = np.full((len(self.builder.groups), 5), np.nan)
            for u, g in enumerate(self.builder.groups):
                nodes = [n for n in g if n.op != "get_attr"]
                if not all(fpga_model.supported(n) for n in nodes):
                    continue
                try:  # lowering also judges a node in context (a broadcasting add, ...)
                    rows[u] = fpga_model.unit_cycles(nodes, dev, self._fpga_number(),
                                                     gm=self.graph.gm, point=self.graph.point)
                except fpga_model.UnsupportedOpError:
                    continue
            self._cycles[key] = rows
        return self._cycles[key]

    def _fpga_times(self, dev: Any, mb: int, floor: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Per-unit seconds on an FPGA from the analytic model that writes estimates.json
        (`pipecc.targets.fpga_model.unit_cycles`): (latency + (mb-1)·interval) / f_clk of the unit's
        processes, additive over a stage (the partitioner needs that); `recost` replaces an
        FPGA stage's sum with the model's real dataflow time of the stage. With `floor`, the
        MAC floor (mb·floor / f_clk) the lower bound uses. Units with an op the FPGA backend
        cannot generate get UNSUPPORTED_S. Backward (training) is costed as twice the
        forward, as a dataflow design of the transposed products would take; the FPGA
        backend itself generates inference only (see `pipecc run`)."""
        c = self._fpga_cycles(dev)
        fwd = mb * c[:, 2] / c[:, 3] if floor else (c[:, 0] + (mb - 1) * c[:, 1]) / c[:, 3]
        fwd = np.where(np.isnan(fwd), UNSUPPORTED_S, fwd)
        return fwd, (2 * fwd if self.opt.training else np.zeros_like(fwd))

    def _fpga_stage_s(self, dev: Any, units: range, mb: int) -> float | None:
        """The FPGA model's dataflow time of one stage (what estimates.json says), or None
        when the stage cannot be lowered as a whole."""
        from pipecc.targets import fpga_model
        nodes = [n for u in units for n in self.builder.groups[u] if n.op != "get_attr"]
        try:
            return fpga_model.stage_time_s(nodes, dev, self._fpga_number(), mb,
                                           gm=self.graph.gm, point=self.graph.point)
        except fpga_model.UnsupportedOpError:
            return None

    def recost(self, prob: PartitionProblem, bounds: Sequence[int], order: Sequence[int],
               mb: int) -> tuple[PartitionProblem, Partition]:
        """The partition at `bounds` with each FPGA stage's additive unit times scaled to the
        FPGA model's dataflow time of the whole stage, so the plan's stage times are those of
        `estimates.json`. Other stages are unchanged."""
        fwd = np.array(prob.fwd, dtype=float)
        bwd = np.array(prob.bwd, dtype=float)
        changed = False
        for k in range(len(bounds) - 1):
            dev = self.cluster.devices[order[k % self.p]]
            a, e = bounds[k], bounds[k + 1]
            if dev.kind != "fpga" or fwd[k, a:e].sum() >= UNSUPPORTED_S:
                continue
            exact = self._fpga_stage_s(dev, range(a, e), mb)
            total = fwd[k, a:e].sum()
            if exact is None or total <= 0:
                continue
            fwd[k, a:e] *= exact / total
            bwd[k, a:e] = 2 * fwd[k, a:e] if self.opt.training else 0.0
            changed = True
        if not changed:
            return prob, evaluate(prob, bounds)
        prob = dataclasses.replace(prob, fwd=fwd, bwd=bwd)
        return prob, evaluate(prob, bounds)

    def problem(self, units: Units, mb: int, schedule: str, m: int, order: Sequence[int],
                v: int = 1) -> PartitionProblem:
        """Stage k on device order[k % p]. An FPGA stage's memory is its on-chip BRAM (the
        generated design keeps weights and frame buffers there): per unit what
        `fpga_model.unit_cycles` says, against the card's BRAM18; activations stashed for a
        training backward would live in the card's DDR and are not modelled."""
        fwd, bwd = self.times(units, mb)
        devs = [order[k % self.p] for k in range(self.p * v)]
        states = (2 + self.opt.optimizer_states) if self.opt.training else 1
        static = units.param_bytes * states
        act = units.values["stash_bytes"] if self.opt.training else np.zeros(units.n)
        caps = [self.cluster.devices[d].memory_bytes * MEMORY_HEADROOM / v for d in devs]
        inflight = _inflight(schedule, self.p * v, m, v) if self.opt.training else [1] * (self.p * v)
        links = [self.cluster.link(devs[k], devs[k + 1]) if devs[k] != devs[k + 1] else None
                 for k in range(len(devs) - 1)]

        def link_time(k: int, nbytes: float) -> float:
            return links[k].time(nbytes) if links[k] is not None and nbytes > 0 else 0.0
        fpga = [self.cluster.devices[d].kind == "fpga" for d in devs]
        blocked = None
        if any(fpga):  # an FPGA stage takes one float32 tensor in and sends one out
            bad = ~self.builder.one_tensor_cut
            none = np.zeros_like(bad)
            blocked = [bad if fpga[k] or fpga[k + 1] else none for k in range(len(devs) - 1)]
            static, act = np.tile(static, (len(devs), 1)), np.tile(act, (len(devs), 1))
            inflight = list(inflight)
            for k, d in enumerate(devs):
                if fpga[k]:
                    dev = self.cluster.devices[d]
                    static[k] = np.nan_to_num(self._fpga_cycles(dev)[:, 4]) * BRAM18_BYTES
                    act[k], inflight[k] = 0.0, 0
                    caps[k] = dev.fpga["bram18"] * BRAM18_BYTES
        return PartitionProblem(
            fwd=fwd[devs], bwd=bwd[devs], out_bytes=units.values["output_bytes"],
            last_use=units.last_use, static_mem=static, act_mem=act, mem_cap=caps,
            inflight=inflight, link_time=link_time, blocked=blocked,
            labels=[f"device {k} ({self.cluster.devices[d].name}"
                    + (", on-chip BRAM" if fpga[k] else "") + ")" for k, d in enumerate(devs)])

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
            raise InfeasibleError(self._unsupported_message(prob, order))
        raw = prob
        prob, part = self.recost(prob, part.bounds, order, mb)
        timeline = self._simulate(part, prob, schedule, m, v)
        return _Candidate(schedule, m, order, part, prob, units, timeline, v, raw=raw)

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
        act_mem = np.broadcast_to(np.asarray(prob.act_mem, dtype=float), fwd.shape)
        static_mem = np.broadcast_to(np.asarray(prob.static_mem, dtype=float), fwd.shape)
        act = [float(act_mem[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        static = [float(static_mem[k, part.bounds[k]:part.bounds[k + 1]].sum())
                  for k in range(stages)]
        costs = StageCosts.per_stage(m, f, b, send_forward_s=send, send_backward_s=back,
                                     activation_bytes=act, static_bytes=static)
        if schedule == "inference":
            from pipecc.ir.schedule import inference
            sched = inference(stages, m)
        else:
            sched = _schedule(schedule, stages // v, m, v) if v > 1 else _schedule(schedule, stages, m, 1)
        return simulate(sched, costs)

    def _unsupported_message(self, prob: PartitionProblem, order: Sequence[int]) -> str:
        """Why every placement puts something on an FPGA it cannot take: memory elsewhere,
        no one-tensor boundary around the FPGA stage, or ops it cannot generate."""
        from pipecc.targets import fpga_model
        fpgas = ", ".join(f"{k} ({self.cluster.devices[d].name})" for k, d in enumerate(order)
                          if self.cluster.devices[d].kind == "fpga")
        bad = [n for g in self.builder.groups for n in g if not fpga_model.supported(n)]
        example = f"{bad[0].meta['pipecc.op']} at node {bad[0].meta['pipecc.name']}" if bad else "?"
        fix = ("leave the FPGA out of --devices" if self.opt.choose_order and self.p > 1
               else "put a CPU/GPU there or use --choose-order")
        roomy = dataclasses.replace(prob, mem_cap=[math.inf] * len(prob.mem_cap))
        if partition(roomy).bottleneck < UNSUPPORTED_S:
            short = [f"{k} ({self.cluster.devices[d].name})" for k, d in enumerate(order)
                     if self.cluster.devices[d].kind != "fpga"]
            return (f"no placement fits memory: the only splits that fit put on FPGA device "
                    f"{fpgas} ops it cannot generate (e.g. {example}) or a boundary of more than "
                    f"one tensor, because device {', '.join(short)} cannot hold the rest; add "
                    f"devices with more memory or use more micro-batches")
        if partition(dataclasses.replace(roomy, blocked=None)).bottleneck < UNSUPPORTED_S:
            return (f"FPGA device {fpgas} needs a stage boundary of one float32 tensor on each "
                    f"side, and no such cut leaves it only ops it can generate; {fix}")
        return (f"FPGA device {fpgas} would have to run ops the FPGA backend cannot "
                f"generate (e.g. {example}); {fix}")

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
            if "on-chip BRAM" in reason:
                reason += ("; an FPGA stage keeps its weights on chip: let pipecc place it "
                           "(--choose-order) or use a narrower --fpga-number such as ap_fixed<16,6>")
            raise PipeccError(reason if reason.startswith(("FPGA", "no placement"))
                              else f"no schedule fits memory: {reason}")
        results.sort(key=lambda c: (c.timeline.iteration_s, c.microbatches))
        self.results, self.infeasible = results, lost
        best = results[0]
        return self.to_plan(best, self.alternatives(best)), best

    def alternatives(self, chosen: _Candidate) -> list[dict[str, Any]]:
        """Why every other (schedule, micro-batches) lost to `chosen` (before layer splits)."""
        out = list(self.infeasible)
        for c in self.results:
            if c is not chosen:
                out.append({"schedule": c.schedule, "microbatches": c.microbatches,
                            "reason": f"slower: {c.timeline.iteration_s:.4g} s per iteration "
                                      f"(bubble {c.timeline.bubble_fraction:.1%}) vs "
                                      f"{chosen.timeline.iteration_s:.4g} s"})
        return out

    def contenders(self, within: float = math.inf, most: int = 3) -> list[_Candidate]:
        """The fastest candidate of each schedule within `within` of the best (at most
        `most`, best first): layer splitting may reorder these, so each gets split."""
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
        fwd, bwd = self.times(cand.units, self.opt.batch_size // cand.microbatches)
        best = (fwd + bwd).min(axis=0)
        return {names[-1]: float(best[u]) for u, names in enumerate(cand.units.names)}

    # ------------------------------------------------------------------ output
    def bound_problem(self, prob: PartitionProblem, order: Sequence[int],
                      mb: int) -> PartitionProblem:
        """`prob` with the costs a lower bound may use: FPGA rows hold the FPGA model's MAC
        floor (`_fpga_times(floor=True)`), which no stage holding the unit can beat (the
        additive unit times the partitioner uses may exceed a dataflow stage's), and units
        whose on-chip memory alone exceeds the card count as unable to run there."""
        if not any(self.cluster.devices[d].kind == "fpga" for d in order):
            return prob
        fwd, bwd = np.array(prob.fwd, dtype=float), np.array(prob.bwd, dtype=float)
        for k in range(fwd.shape[0]):
            dev = self.cluster.devices[order[k % self.p]]
            if dev.kind == "fpga":
                fwd[k], bwd[k] = self._fpga_times(dev, mb, floor=True)
                big = np.nan_to_num(self._fpga_cycles(dev)[:, 4]) > dev.fpga["bram18"]
                fwd[k, big] = bwd[k, big] = UNSUPPORTED_S
        return dataclasses.replace(prob, fwd=fwd, bwd=bwd)

    def lower_bound(self, cand: _Candidate) -> float:
        """`partition.lower_bound` on the candidate's devices, with `bound_problem`'s costs."""
        prob = self.bound_problem(cand.problem, cand.order, self.opt.batch_size // cand.microbatches)
        return lower_bound(prob, cand.units.splittable, unusable=UNSUPPORTED_S)

    def baselines(self, cand: _Candidate) -> list[dict[str, Any]]:
        """The partitions other tools would produce, on the same cost model."""
        units, prob = cand.units, cand.raw or cand.problem
        p = len(prob.mem_cap)
        fwd, bwd = np.asarray(prob.fwd), np.asarray(prob.bwd)
        ref_times = fwd[0] + bwd[0]
        out = []
        for name, bounds in [
            ("equal-count (torch.distributed.pipelining)", baselines.equal_count(units.n, p)),
            ("equal-params (DeepSpeed parameters)", baselines.equal_params(units.param_bytes, p)),
            ("block-partition by time (torchgpipe)", baselines.block_partition(ref_times, p)),
        ]:
            _, part = self.recost(prob, bounds, cand.order, self.opt.batch_size // cand.microbatches)
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
                     "training": self.opt.training,
                     **({"fpga_number": parse_number(self._fpga_number()).text}
                        if any(d.kind == "fpga" for d in self.cluster.devices) else {})})


def plan(graph: AnnotatedGraph, cluster: Cluster, options: PlanOptions) -> Plan:
    """Plan without layer splitting (see `pipecc.driver.plan` for the whole pipeline)."""
    return Balancer(graph, cluster, options).run()[0]

