"""PP x DP: the balance pass's view of a plan whose stages run on replica groups.

One replication degree d for the whole plan (d divides the n devices): pipeline rank j is the
group of devices j*d .. j*d+d-1 (consecutive in the plan's device order), each replica taking
a slice of every micro-batch (torch.tensor_split order: of mb samples, the first mb % d replicas
take ceil(mb/d), the others floor(mb/d); `slice_size`), the group all-reducing the stage's
gradients once per iteration (ring, overlapped with the stage's last backward: the runtime's
hooks). d = 1 is the plain
pipeline, d = n with one stage plain data parallelism.

To the partitioner a group is one "device" (`group_problem`):
- unit time = the slowest of the group's devices at the largest slice, ceil(mb/d) samples
  (replicas run in lock step on their slices; the group is as fast as its slowest member, and
  a replica with one sample less is never slower: the partitioner's costs grow with the batch);
- memory per replica: the stage's full static memory (weights, gradients, optimizer states:
  every replica keeps a full copy) and activations at ceil(mb/d); cap = the smallest member's;
- link between ranks j and j+1 = the slowest of the d replica pairs' links (replica r sends
  to replica r of the next group; the d transfers run side by side, the slowest one ends it).
  Pairs that share one physical link are not modelled as contending (catalog links are
  point to point).

All-reduce (`ring_allreduce_s`): the ring formula of bench/bench_balance.py's data-parallel
model (Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms for clusters of
workstations", JPDC 2009: a ring moves 2(d-1)/d of the data through every link, in 2(d-1)
steps each paying the link latency):
    t_ar = 2(d-1)/d * grad_bytes / min ring-link bandwidth + 2(d-1) * max ring-link latency
over the links between consecutive members (r -> r+1 mod d); grad_bytes = the stage's
parameter bytes (fp32 gradients, the size of fp32 weights).

Allowed degrees (`allowed`): d divides n, d <= B/m (every replica gets a non-empty slice of
every micro-batch; slices may differ by one sample, as DDP's do when the batch does not divide),
no FPGA device when d > 1 (FPGA stages are never replicated). When d divides B/m every figure
is the equal-slice one, mb/d. Pure numbers over the planner's cost tables (`passes.plan_costs`);
no torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np

from pipecc.errors import UsageError
from pipecc import techniques
from pipecc.techniques import capabilities as caps
from pipecc.passes.partition import PartitionProblem
from pipecc.passes.plan_candidate import Candidate
from pipecc.passes.plan_costs import CostTables
from pipecc.passes.units import Units
from pipecc.targets.hardware import Link


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_requested(requested: int | str, n: int, devices: Sequence[Any]) -> None:
    """One-line UsageErrors for a `--replicas N` the devices cannot take (the replica groups'
    rule, `pipecc.techniques.replicas.requires`, on the groups N would make)."""
    if requested == "auto":
        return
    d = int(requested)
    if d < 1:
        raise UsageError(f"--replicas {d}: must be auto or a positive integer")
    if n % d:
        raise UsageError(f"--replicas {d} does not divide the {n} devices; use a divisor of "
                         f"{n}: {', '.join(map(str, divisors(n)))}")
    why = techniques.replicas.requires(techniques.sketch(schedule="1f1b", devices=devices, replicas=d),
                                       techniques.COMPILED)
    if why is not None:
        raise UsageError(f"--replicas {d}: {why}")


def check_slices(requested: int | str, batch: int, ms: Sequence[int]) -> None:
    """A fixed --replicas N needs some micro-batch count whose micro-batch has at least N
    samples (a non-empty slice per replica); one line naming the largest micro-batch otherwise."""
    if requested == "auto" or int(requested) <= 1:
        return
    d = int(requested)
    mb = max(batch // m for m in ms)
    if mb < d:
        raise UsageError(f"--replicas {d} leaves a replica without samples: a micro-batch of "
                         f"{mb} splits over at most {mb} replica{'s' if mb > 1 else ''}; use "
                         "fewer replicas or a larger batch")


def slice_size(mb: int, d: int) -> int:
    """Samples of the largest of d replicas' slices of a micro-batch of mb (torch.tensor_split:
    the first mb % d replicas take one more): ceil(mb/d), mb/d when d divides mb. Every figure
    of a replica group is at this slice (module docstring)."""
    return -(-mb // d)


def allowed(requested: int | str, n: int, mb: int, unreplicable: bool) -> list[int]:
    """The degrees a plan with micro-batch size mb may use (module docstring); `unreplicable`:
    some device cannot join a replica group (`caps.REPLICATE`: an FPGA card)."""
    ds = divisors(n) if requested == "auto" else [int(requested)]
    return [d for d in ds if d <= mb and not (d > 1 and unreplicable)]


def groups(order: Sequence[int], d: int) -> list[list[int]]:
    """Pipeline rank j -> the cluster devices of its replica group."""
    return [list(order[j * d:(j + 1) * d]) for j in range(len(order) // d)]


def ring_allreduce_s(ring: Sequence[Link], grad_bytes: float, message_s: float = 0.0) -> float:
    """Ring all-reduce of grad_bytes over the links between consecutive members (module
    docstring; bench/bench_balance.py `_dp_on` uses the same formula for plain DP); each of
    its 2(d-1) steps is a message, paying `message_s` of host cost besides the latency."""
    d = len(ring)
    if d < 2 or grad_bytes <= 0:
        return 0.0
    bw = min(link.bandwidth for link in ring)
    lat = max(link.latency for link in ring)
    return 2 * (d - 1) / d * grad_bytes / bw + 2 * (d - 1) * (lat + message_s)


def group_ring(tables: CostTables, group: Sequence[int]) -> list[Link]:
    d = len(group)
    return [tables.cluster.link(group[r], group[(r + 1) % d]) for r in range(d)] if d > 1 else []


def group_problem(tables: CostTables, units: Units, mbr: int, inflight: Sequence[int],
                  order: Sequence[int], d: int, v: int = 1) -> PartitionProblem:
    """The partition problem over P = n/d replica groups (module docstring); `mbr` = the
    replicas' largest slice of a micro-batch (`slice_size`: ceil(mb/d)), `units` evaluated at
    it; stage k on group k % P."""
    fwd, bwd = tables.times(units, mbr)
    grp = groups(order, d)
    p = len(grp)
    gfwd = np.stack([fwd[g].max(axis=0) for g in grp])
    gbwd = np.stack([bwd[g].max(axis=0) for g in grp])
    mems = [[tables.costs[x].memory(units, v) for x in g] for g in grp]
    static = np.stack([np.max([np.broadcast_to(m.static, (units.n,)) for m in ms], axis=0)
                       for ms in mems])
    act = np.stack([np.max([np.broadcast_to(m.act, (units.n,)) for m in ms], axis=0)
                    for ms in mems])
    caps = [min(m.cap for m in ms) for ms in mems]
    stages = [k % p for k in range(p * v)]
    pairs = [[(grp[stages[k]][r], grp[stages[k + 1]][r]) for r in range(d)]
             if stages[k] != stages[k + 1] else [] for k in range(len(stages) - 1)]

    def link_time(k: int, nbytes: float) -> float:
        if not pairs[k] or nbytes <= 0:
            return 0.0
        return max(tables.link_time(a, b, nbytes) for a, b in pairs[k])

    fixed = [[tables.stage_fixed(x) for x in g] for g in grp]  # the group's slowest member
    fixed_fwd = [max(f for f, _ in fixed[j]) for j in stages]
    fixed_bwd = [max(b for _, b in fixed[j]) for j in stages]

    names = [", ".join(tables.cluster.devices[x].name for x in g) for g in grp]
    return PartitionProblem(
        fixed_fwd=fixed_fwd, fixed_bwd=fixed_bwd,
        fwd=gfwd[stages], bwd=gbwd[stages], out_bytes=units.values["output_bytes"],
        last_use=units.last_use, static_mem=static[stages], act_mem=act[stages],
        mem_cap=[caps[j] for j in stages], inflight=list(inflight), link_time=link_time,
        training=tables.options.training,
        labels=[f"replica group {j} (devices {grp[j][0]}-{grp[j][-1]}: {names[j]})"
                for j in stages])


def stage_allreduce_s(tables: CostTables, units: Units, bounds: Sequence[int],
                      order: Sequence[int], d: int) -> list[float]:
    """[stage] seconds of its group's gradient all-reduce per iteration (0 without training
    or replication)."""
    grp = groups(order, d)
    out = []
    for k in range(len(bounds) - 1):
        if d < 2 or not tables.options.training:
            out.append(0.0)
            continue
        grad = float(units.param_bytes[bounds[k]:bounds[k + 1]].sum())
        g = grp[k % len(grp)]
        host = max(tables.message_s(g[r], g[(r + 1) % d]) for r in range(d))  # the cost model's
        out.append(ring_allreduce_s(group_ring(tables, g), grad, host))
    return out


def decisions(tables: CostTables, cand: Candidate, results: Sequence[Candidate]) -> list[str]:
    """Why this replication degree: the best plan of every other degree tried (nothing
    when --replicas is 1 and the plan is the plain pipeline)."""
    if tables.options.replicas != "auto" and cand.replicas == 1:
        return []
    d, P = cand.replicas, cand.ranks

    def shape(x: int) -> str:
        return (f"{x} replicas per stage x {tables.p // x} stage{'s' if tables.p // x > 1 else ''}"
                if x > 1 else f"no replication ({tables.p} stage{'s' if tables.p > 1 else ''})")
    order_note = ["--choose-order orders the devices of the plain pipeline (1 replica) only: "
                  "replica groups are consecutive devices in the given order"] \
        if tables.options.choose_order and tables.p > 1 else []
    if tables.options.replicas != "auto":
        return [f"{shape(d)} (--replicas {d}): predicted {cand.timeline.iteration_s:.4g} s "
                f"per iteration, all-reduce up to {max(cand.allreduce, default=0.0):.4g} s "
                "overlapped with the last backward"] + order_note
    best: dict[int, Any] = {}
    for c in results:
        best.setdefault(c.replicas, c)
    others = []
    for x in sorted(best):
        if x == d:
            continue
        what = ("the plain pipeline" if x == 1 else "pure data parallelism" if x == tables.p
                else f"{x} replicas per stage x {tables.p // x} stages")
        others.append(f"{best[x].timeline.iteration_s:.4g} s for {what}")
    out = [f"{shape(d)}: predicted {cand.timeline.iteration_s:.4g} s per iteration"
           + (" vs " + ", ".join(others[:-1]) + (" and " if len(others) > 1 else "") + others[-1]
              if others else "")]
    if d == 1 and not all(dev.can(caps.REPLICATE) for dev in tables.cluster.devices):
        out.append("replicas 1: FPGA devices are never replicated")
    return out + order_note


def without_fpgas(cluster: Any) -> tuple[Any, list[int]]:
    """The cluster of `cluster`'s devices that can train (`caps.BACKWARD`: all but FPGA cards;
    same links), and their indices."""
    from pipecc.targets.hardware import Cluster
    keep = [i for i, d in enumerate(cluster.devices) if d.can(caps.BACKWARD)]
    return (Cluster(devices=tuple(cluster.devices[i] for i in keep),
                    links=tuple(tuple(cluster.links[i][j] for j in keep) for i in keep)), keep)


def faster_of(whole: tuple[Any, Any] | None, alone: tuple[Any, Any], keep: Sequence[int],
              fpgas: Sequence[Any], why: str) -> tuple[Any, Any]:
    """The faster of a training plan over every device (`whole`; None: none fits, `why`) and one
    over the devices `keep` other than the FPGA cards (`alone`, its device indices mapped back
    into the given list), with a decision line saying which and why."""
    left = ", ".join(sorted({d.name for d in fpgas}))
    plan, graph = alone
    if whole is not None and whole[0].predicted_iteration_s <= plan.predicted_iteration_s:
        line = (f"with the FPGA ({left}): predicted {whole[0].predicted_iteration_s:.4g} s "
                f"per iteration vs {plan.predicted_iteration_s:.4g} s on the other devices alone")
        return dataclasses.replace(whole[0], decisions=[*whole[0].decisions, line]), whole[1]
    devices = [dict(dev, given_index=keep[dev["given_index"]]) for dev in plan.devices]  # into the given --devices
    line = (f"{left} left out (training: FPGA stages have no backward pass): predicted "
            f"{plan.predicted_iteration_s:.4g} s per iteration on the other devices alone"
            + (f" vs {whole[0].predicted_iteration_s:.4g} s with them" if whole is not None
               else f"; with them: {why.splitlines()[0] if why else 'no plan'}"))
    return dataclasses.replace(plan, devices=devices, decisions=[*plan.decisions, line]), graph
