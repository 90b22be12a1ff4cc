"""The evaluator: what a candidate plan costs, as a `Candidate` with its simulated `Timeline`.

    Evaluator(tables)
      .problem(units, mb, schedule, m, order, v, recompute, d) -> PartitionProblem
      .simulate(part, prob, schedule, m, v, ...)               -> Timeline
      .evaluate(schedule, m, recompute=None, d=1)              -> Candidate

`evaluate` is one candidate of the search: the exact partition of (schedule, m micro-batches,
d replicas, recomputing stages) on its problem (`passes.plan_problem`), re-costed where a
device model costs whole stages (`CostTables.recost`), simulated under its schedule. The
technique passes (`techniques.recompute.search`, `techniques.bpipe.search`, `techniques.replicas.search`,
`techniques.umpipe.plan`, `techniques.bipartition.plan`) ask an `Evaluator` for problems, timelines and candidates; the
search (`passes.plan_search`) drives them and the emitter (`passes.plan_emit`) writes the plan.

Every figure is the one cost model's (`passes.plan_costs.CostTables`): unit times with their
per-call fixed costs, each stage's per-micro-batch fixed costs (`PartitionProblem.stage_fixed`,
in its F and B), messages with both hosts' costs, and each rank's per-iteration fixed costs
(`StageCosts.tail_s`: the optimizer step after its last action).

Zero-bubble schedules (``ZERO_BUBBLE``: zb-h1) split each stage's backward into I (input
gradient) and W (weight gradient); the simulator gets both, each stage's W being the sum over
its units of the backward seconds times the device model's `weight_share`. The partitioner
itself still balances F + B per stage (the 1F1B steady state, which ZB-H1 shares). No FPGA
plan uses them: the FPGA backend has no separate weight-gradient pass.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Sequence

import numpy as np
import torch

from pipecc.ir.graph import META_PARAMS, AnnotatedGraph
from pipecc.ir.schedule.registry import SPLIT_BACKWARD_COST, VIRTUAL, ZERO_BUBBLE, schedule_for
from pipecc.passes import plan_problem
from pipecc.techniques.replicas import search as rep
from pipecc.passes import step_memory
from pipecc.passes.partition import (InfeasibleError, Partition, PartitionProblem,
                                     best_device_order, evaluate, memory_free, partition)
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_costs import CostTables
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.simulate import StageCosts, Timeline, simulate
from pipecc.passes.units import UnitBuilder, Units
from pipecc.targets.hardware import Cluster
from pipecc.targets.timing import CANNOT_RUN_S

__all__ = ["Evaluator"]


class Evaluator:
    """Costs candidates on one graph and cluster (module docstring). `tables` holds the
    numbers; `options`, `cluster`, `graph`, `builder` and `p` (the device count) are its."""

    def __init__(self, tables: CostTables) -> None:
        self.tables = tables
        self.options: PlanOptions = tables.options
        self.cluster: Cluster = tables.cluster
        self.graph: AnnotatedGraph = tables.graph
        self.builder: UnitBuilder = tables.builder
        self.p: int = tables.p
        # (mb, v, d, order, recompute) -> {variant: bounds or None}: the partitions of a problem
        # memory does not constrain (`partition.memory_free`), which the schedules share (they
        # differ only in in-flight counts, i.e. memory): computed once, not once per schedule
        self._cuts: dict[tuple[Any, ...], dict[str, tuple[int, ...] | None]] = {}

    def _partition(self, prob: PartitionProblem, key: tuple[Any, ...] | None,
                   variant: str) -> Partition | None:
        """`partition(prob)` (None where a variant finds nothing: InfeasibleError or CANNOT_RUN_S;
        the main variant raises), from the cache when `key` is not None; costed on `prob`."""
        cached = self._cuts.get(key, {}) if key is not None else {}
        if variant in cached:
            bounds = cached[variant]
            return None if bounds is None else evaluate(prob, bounds)
        try:
            part: Partition | None = partition(prob)
        except InfeasibleError:
            if variant == "main":
                raise
            part = None
        if part is not None and part.bottleneck >= CANNOT_RUN_S and variant != "main":
            part = None
        if key is not None:
            self._cuts.setdefault(key, {})[variant] = None if part is None else tuple(part.bounds)
        return part

    def problem(self, units: Units, mb: int, schedule: str, m: int, order: Sequence[int],
                v: int = 1, recompute: Sequence[bool] | None = None, d: int = 1) -> PartitionProblem:
        """`passes.plan_problem.problem` over these tables."""
        return plan_problem.problem(self.tables, units, mb, schedule, m, order, v, recompute, d)

    def evaluate(self, schedule: str, m: int, recompute: Sequence[bool] | None = None,
                 d: int = 1) -> Candidate:
        """The best partition for (schedule, m, d replicas), with `recompute[k]` stages
        recomputing. InfeasibleError when nothing fits."""
        opt, tables = self.options, self.tables
        assert isinstance(opt.batch_size, int)
        mb = rep.slice_size(opt.batch_size // m, d)  # NOTE: d replicas: the largest slice
        units = self.builder.at(mb)
        v = opt.virtual_stages if schedule in VIRTUAL else 1
        order = tuple(range(self.p))
        prob = self.problem(units, mb, schedule, m, order, v, recompute, d)
        key: tuple[Any, ...] | None = None  # the partition cache's, when memory binds nothing
        if opt.choose_order and v == 1 and self.p > 1 and d == 1:
            types = [dev.name for dev in self.cluster.devices]
            order, part = best_device_order(
                lambda o: self.problem(units, mb, schedule, m, o, 1, recompute), types)
            prob = self.problem(units, mb, schedule, m, order, v, recompute)
        else:
            key = (mb, v, d, order, None if recompute is None else tuple(bool(r) for r in recompute))
            key = key if memory_free(prob) else None
            part = self._partition(prob, key, "main")
            assert part is not None
        if part.bottleneck >= CANNOT_RUN_S:
            raise InfeasibleError(self._unsupported_message(prob, order))
        raw = prob
        prob, part = tables.recost(prob, part.bounds, order, mb, d)
        allreduce = rep.stage_allreduce_s(tables, units, part.bounds, order, d) if d > 1 else None
        timeline = self.simulate(part, prob, schedule, m, v, order=order, allreduce=allreduce)
        # NOTE: the partitioner is exact for its model: the 1F1B steady state with transfers
        # overlapped. With few micro-batches, or GPipe's two one-way streams, fill and drain
        # weigh more, and cuts exact for the stream model (training=False) or for transfers
        # charged to both stages (`PartitionProblem.comm`) can simulate faster: the simulator
        # chooses.
        tried = {tuple(part.bounds)}
        for name, other in (("stream", dataclasses.replace(raw, training=False)),
                            ("charged", dataclasses.replace(raw, comm="charged"))):
            if other == raw:
                continue
            alt = self._partition(other, key, name) if key is not None else partition(other)
            if alt is None or alt.bottleneck >= CANNOT_RUN_S or tuple(alt.bounds) in tried:
                continue
            tried.add(tuple(alt.bounds))
            prob2, part2 = tables.recost(raw, alt.bounds, order, mb, d)
            allreduce2 = rep.stage_allreduce_s(tables, units, part2.bounds, order, d) if d > 1 else None
            timeline2 = self.simulate(part2, prob2, schedule, m, v, order=order, allreduce=allreduce2)
            if timeline2.iteration_s < timeline.iteration_s:
                prob, part, timeline, allreduce = prob2, part2, timeline2, allreduce2
        return Candidate(schedule, m, order, part, prob, units, timeline, v, raw=raw,
                         recompute=tuple(bool(r) for r in prob.recompute or ()),
                         replicas=d, allreduce=list(allreduce or []))

    def simulate(self, part: Partition, prob: PartitionProblem, schedule: str, m: int,
                 v: int, order: Sequence[int] | None = None,
                 allreduce: Sequence[float] | None = None,
                 bpipe: Sequence[int | None] | None = None, bpipe_policy: str | None = None,
                 free_stash: bool = False) -> Timeline:
        """The timeline of `part` on `prob` under `schedule` with m micro-batches, v stages per
        rank. `allreduce` [stage]: replica groups' all-reduce seconds (summed per rank), None
        without replication. `bpipe` [stage]: BPipe thresholds (1F1B, one stage per device)
        under `bpipe_policy` (`pipecc.techniques.bpipe.search.POLICY`): a stash (internal activations plus the
        received input, as the partitioner counts it) moves over the pair's link (free with
        `free_stash`); all None: the same stash bytes without moves (memory before balancing)."""
        stages = len(part.bounds) - 1
        fwd = np.asarray(prob.fwd)
        bwd = np.asarray(prob.bwd)
        fixed = [prob.stage_fixed(k) for k in range(stages)]  # per micro-batch, whatever it holds
        f = [float(fwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) + fixed[k][0] for k in range(stages)]
        b = [float(bwd[k, part.bounds[k]:part.bounds[k + 1]].sum()) + fixed[k][1] for k in range(stages)]
        send = [prob.link_time(k, part.cut_bytes[k]) if k < stages - 1 else 0.0 for k in range(stages)]
        back = [0.0] + send[:-1]
        act_mem = np.broadcast_to(np.asarray(prob.act_mem, dtype=float), fwd.shape)
        static_mem = np.broadcast_to(np.asarray(prob.static_mem, dtype=float), fwd.shape)
        act = [float(act_mem[k, part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(stages)]
        static = [float(static_mem[k, part.bounds[k]:part.bounds[k + 1]].sum())
                  for k in range(stages)]
        redo = None
        if prob.recompute is not None:  # re-create `act` in each B
            redo = [a if r else 0.0 for a, r in zip(act, prob.recompute)]
        # the stash, as the partitioner's M_k counts it: what a stage received stays with its own
        # activations until its B (the runtime keeps the input leaves); a recomputing stage keeps
        # only what it received
        received = [0.0] + [float(x) for x in part.cut_bytes]  # stage 0's input is not charged
        redone = prob.recompute or (False,) * stages
        sent, fwork, bwork = self.working_sets(part, prob)
        act = [received[k] + sent[k] if r else act[k] + received[k] + sent[k] for k, r in enumerate(redone)]
        split: dict[str, list[float] | float] = {}
        if schedule in ZERO_BUBBLE:  # I and W actions: the backward's two parts
            assert isinstance(self.options.batch_size, int)
            d = self.p * v // stages  # replicas per stage group
            w = self.tables.weight_times(part, prob, order or tuple(range(self.p)),
                                         rep.slice_size(self.options.batch_size // m, d), d)
            split = {"backward_weight_s": w, "backward_input_s": [bk - wk for bk, wk in zip(b, w)],
                     "split_cost": SPLIT_BACKWARD_COST}  # what the runtime's split measured
            pending = self.builder.weight_output_bytes(rep.slice_size(self.options.batch_size // m, d))
            # stage 0's inputs take no gradient: its I does nothing and its W is the whole backward
            weight_grads = [0.0] + [float(pending[part.bounds[k]:part.bounds[k + 1]].sum()) for k in range(1, stages)]
        costs = StageCosts.per_stage(m, f, b, send_forward_s=send, send_backward_s=back,
                                     activation_bytes=act, static_bytes=static,
                                     recompute_bytes=redo, **split)  # type: ignore[arg-type]
        costs.forward_work_bytes, costs.backward_work_bytes = fwork, bwork
        if split:
            costs.weight_grad_bytes = weight_grads
        costs.input_grad_bytes = received if fwork is not None else None
        if bpipe is not None and bpipe_policy is None:
            raise ValueError("bpipe thresholds need their bpipe_policy")
        sched = schedule_for(schedule, stages, m, num_ranks=stages // v, bpipe_thresholds=bpipe,
                             bpipe_policy=bpipe_policy or "jit")
        if bpipe is not None:
            devs, per = order or tuple(range(self.p)), self.p // stages  # per: replicas of a stage
            costs.stash_transfer_s = [
                [0.0 if free_stash or sched.partner is None or sched.partner[k] is None
                 else self.tables.link_time(devs[k * per], devs[sched.partner[k] * per], act[k])] * m
                for k in range(stages)]
        if allreduce is not None:
            per_rank = [0.0] * sched.num_ranks
            for k, t in enumerate(allreduce):
                per_rank[sched.stage_to_rank[k]] += t
            costs.allreduce_s = per_rank
        costs.tail_s = self.step_tail(sched, order)
        costs.step_bytes = self.step_bytes(sched, part, order) if self.options.training else None
        costs.static_bytes = self.with_shared_weights(costs.static_bytes, sched, part, order)
        return simulate(sched, costs, validated=True)  # schedule_for validated it

    @staticmethod
    def working_sets(part: Partition, prob: PartitionProblem) -> tuple[list[float], list[float] | None,
                                                                       list[float] | None]:
        """([stage] sent output bytes its stash holds beyond its kept activations, [stage] forward
        and backward working sets, `StageCosts`; None without `prob.work_mem`): a stage keeps the
        outputs it sent until its backward (`runtime.stage_runner`'s stash), a recomputing stage
        all of them; the last stage's outputs live during its F only (the loss keeps what it needs,
        `frontend.loss_memory`); a backward holds its largest node's output and input gradients."""
        stages, b = len(part.bounds) - 1, part.bounds
        if prob.work_mem is None or prob.held_out_mem is None:
            return [0.0] * stages, None, None
        work, unkept, last = (np.asarray(prob.work_mem, dtype=float), np.asarray(prob.held_out_mem, dtype=float),
                              np.asarray(prob.last_use))
        redone = prob.recompute or (False,) * stages
        sent, fwork = [], []
        for k in range(stages):
            a, e = b[k], b[k + 1]
            u = np.arange(a, e)
            leaves = last[u] >= e
            sent.append(0.0 if k == stages - 1 else float(part.cut_bytes[k]) if redone[k] else float(unkept[u][leaves].sum()))
            # the forward's transients: an output nobody keeps lives from its unit to its last
            # reader in the stage (the last stage's outputs: to the loss, after the stage)
            live = np.zeros(e - a + 2)
            ends = np.minimum(last[u], e) - a if k == stages - 1 else np.where(leaves, -1, last[u] - a)
            keep = ends >= 0
            np.add.at(live, np.arange(e - a)[keep], unkept[u][keep])
            np.subtract.at(live, ends[keep] + 1, unkept[u][keep])
            fwork.append(float(np.cumsum(live).max(initial=0.0)))
        bwork = [float(work[b[k]:b[k + 1]].max(initial=0.0)) for k in range(stages)]
        return sent, fwork, bwork

    def step_bytes(self, sched: Any, part: Partition, order: Sequence[int] | None = None) -> list[float] | None:
        """[rank] what its optimizer step holds beyond the static bytes (`passes.step_memory`:
        by its device kind, its largest parameter tensor and all its parameters, a tied weight
        in each stage that reads it); None when all 0."""
        devs = order or tuple(range(self.p))
        per = self.p // sched.num_ranks  # replicas per stage group
        weights = self.stage_weights(part)
        out = []
        for r in range(sched.num_ranks):
            mine = [b for k in sched.stages_of(r) for b in weights[k].values()]
            kind = self.cluster.devices[devs[(r % sched.num_ranks) * per]].kind
            out.append(step_memory.step_bytes(kind, max(mine, default=0.0), sum(mine), self.options.optimizer_states))
        return out if any(out) else None

    def stage_weights(self, part: Partition) -> list[dict[int, float]]:
        """[stage] the parameters its units read (id -> bytes), each once: a tied weight in
        every stage that reads it (the compiled stages each hold a copy)."""
        reads, _ = self._weights
        out = []
        for k in range(len(part.bounds) - 1):
            read: dict[int, float] = {}
            for u in range(part.bounds[k], part.bounds[k + 1]):
                read.update(reads[u])
            out.append(read)
        return out

    def with_shared_weights(self, static: Sequence[float], sched: Any, part: Partition,
                            order: Sequence[int] | None = None) -> list[float]:
        """[stage] `static` plus the weights a stage reads that the units charge to another stage
        (a tied embedding: the compiled stages each hold a copy, `_fold_parameters`), times what
        the stage's device holds per weight (`RooflineCosts.memory`: 2 + optimizer states when
        training, else 1; an FPGA stage's model is its own: nothing added).
        NOTE: the partitioner's memory check (prefix sums per unit) still charges them once."""
        devs = order or tuple(range(self.p))
        per = self.p // sched.num_ranks
        _, charged = self._weights
        states = (2 + self.options.optimizer_states) if self.options.training else 1
        out = [float(x) for x in static]
        for k, read in enumerate(self.stage_weights(part)):
            if self.cluster.devices[devs[sched.stage_to_rank[k] * per]].kind == "fpga":
                continue
            mine = set().union(*charged[part.bounds[k]:part.bounds[k + 1]])
            out[k] += states * sum(b for i, b in read.items() if i not in mine)
        return out

    @functools.cached_property
    def _weights(self) -> tuple[list[dict[int, float]], list[set[int]]]:
        """[unit] the parameters its nodes read (id -> bytes) and [unit] those charged to it (its
        nodes' META_PARAMS: a weight read by several units is charged to the first)."""
        gm = self.graph.gm

        def attr(name: str) -> Any:
            obj: Any = gm
            for part in name.split("."):
                obj = getattr(obj, part, None)
            return obj

        reads, charged = [], []
        for group in self.builder.groups:
            read: dict[int, float] = {}
            mine: set[int] = set()
            for n in group:
                found = []
                if n.op == "call_module":
                    found += list(gm.get_submodule(str(n.target)).parameters())
                for src in [n, *n.all_input_nodes]:
                    if src.op == "get_attr":
                        found.append(attr(str(src.target)))
                for p in found:
                    if isinstance(p, torch.nn.Parameter):
                        read[id(p)] = float(p.numel() * p.element_size())
                for name, _ in n.meta.get(META_PARAMS, []):
                    p = attr(name)
                    if p is not None:
                        mine.add(id(p))
            reads.append(read)
            charged.append(mine)
        return reads, charged

    def step_tail(self, sched: Any, order: Sequence[int] | None = None) -> list[float] | None:
        """[rank] the per-iteration fixed seconds after its last action (`CostTables.step_s`
        of each stage it runs, on its device: stage k on device order[(k % ranks) * d]);
        None when all are 0."""
        devs = order or tuple(range(self.p))
        ranks = sched.num_ranks
        per = self.p // ranks  # replicas per stage group
        tail = [0.0] * ranks
        for k in range(sched.num_stages):
            r = sched.stage_to_rank[k]
            tail[r] += self.tables.step_s(devs[(r % ranks) * per])
        return tail if any(tail) else None

    def _unsupported_message(self, prob: PartitionProblem, order: Sequence[int]) -> str:
        """Why every placement puts something on an FPGA it cannot take: memory elsewhere,
        no one-tensor boundary around the FPGA stage, or ops it cannot generate.
        NOTE: the FPGA cost model is the one that refuses units and cuts, hence the words."""
        costs, devices = self.tables.costs, self.cluster.devices
        fpgas = ", ".join(f"{k} ({devices[d].name})" for k, d in enumerate(order)
                          if costs[d].one_tensor_boundaries)
        bad = next((b for c in costs if (b := c.unsupported_nodes())), [])
        slow = sorted({devices[d].name for d in order})
        too_slow = (f"every placement takes over {CANNOT_RUN_S:g} s per micro-batch on device(s) "
                    f"{', '.join(slow)}: their figures (mem_bandwidth, peak_flops) are too small to "
                    "plan with; check the cluster file")
        if not fpgas:  # no FPGA refuses anything: the figures make every time huge
            return too_slow
        example = f"{bad[0].meta['pipecc.op']} at node {bad[0].meta['pipecc.name']}" if bad else "?"
        fix = ("leave the FPGA out of --devices" if self.options.choose_order and self.p > 1
               else "put a CPU/GPU there or use --choose-order")
        roomy = dataclasses.replace(prob, mem_cap=[float("inf")] * len(prob.mem_cap))
        if partition(roomy).bottleneck < CANNOT_RUN_S:
            short = [f"{k} ({devices[d].name})" for k, d in enumerate(order)
                     if not costs[d].one_tensor_boundaries]
            return (f"no placement fits memory: the only splits that fit put on FPGA device "
                    f"{fpgas} ops it cannot generate (e.g. {example}) or a boundary of more than "
                    f"one tensor, because device {', '.join(short)} cannot hold the rest; add "
                    f"devices with more memory or use more micro-batches")
        if partition(dataclasses.replace(roomy, blocked=None)).bottleneck < CANNOT_RUN_S:
            return (f"FPGA device {fpgas} needs a stage boundary of one float32 tensor on each "
                    f"side, and no such cut leaves it only ops it can generate; {fix}")
        if not bad:  # the FPGA takes every op and every cut: its figures make the times huge
            return too_slow
        return (f"FPGA device {fpgas} would have to run ops the FPGA backend cannot "
                f"generate (e.g. {example}); {fix}")

