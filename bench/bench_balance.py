"""Balance benchmark: pipecc's partitions against the ones other pipeline tools would pick,
and the predicted speedup and memory of pipecc's pipeline against data parallelism.

Every number here comes from pipecc's cost model (roofline times per `Device.compute_time`,
link latency + bytes/bandwidth, the memory model of `passes.plan_problem`): these are predictions
for the listed devices, not measurements.

What runs
---------
Models (zoo defaults = full size; batch is the global batch of one training iteration):
    vgg16, resnet50   batch 32, 224x224 images
    gnmt              batch 64, source and target length 50
    gpt (gpt2)        GPT-2 small, batch 32, seq 1024
    gpt (gpt1-14)     batch 32, seq 512
    gpt (gpt2-xl)     batch 32, seq 1024
    bert              BERT-base, batch 32, seq 512
    tiny_cnn, mlp     the zoo's test models at their defaults, batch 32
Each model is traced and costed ONCE; the analysis is reused for every device configuration
(`driver.plan` never consumes it; layer splitting rewrites a copy).

Devices, for p in {2, 4, 8, 16}:
    homogeneous   {p}xa100
    mixed GPUs    {p/2}xa100,{p/2}xv100
    GPU+FPGA      {p-1}xa100,1xu250 (the FPGA takes only what its backend can build: ops it
                  generates, one float32 tensor in and out, weights and frame buffers in BRAM;
                  models with none of that, e.g. GPT, are recorded as infeasible)
Device order: `choose_order=True` when the distinct orders of the device types number at most
MAX_ORDERS (GPU+FPGA always; mixed up to 8 devices); otherwise the given order is kept (the
16-device mixed cluster has 12,870 orders, one exact partition each).

The plan for a row: `schedule="1f1b"`, m = 2p micro-batches (the largest divisor of the batch
≤ 2p if 2p does not divide it), fp32, training with Adam. Baselines (`Plan.baselines`,
`compare=True`) are scored by the planner on the plan's graph, in the device order pipecc
chose (`passes.partition.evaluate`, full cost model: compute, links, memory); the bench adds
one of its own, *equal-layers* (torchtitan-style: an equal number of top-level layers per
stage — a "layer" is the first parameterised unit of each top-level module instance such as
`blocks.3`, `features.7`, `encoder.layer.5`), scored the same way on the analysed graph.

Balance ratio = stage bottleneck / LB, LB = max(the planner's `lower_bound` on the analysed
graph, which is `Plan.lower_bound_s`; the exact fluid bound). The exact fluid bound solves the
planner's fluid relaxation (every splittable node divisible across devices at no cost, no
communication) exactly for ≤ 2 device types, as a 1-D concave maximisation over its
breakpoints; the planner approximates the same relaxation by 200 mirror-ascent steps (exact
for identical devices; before commit 6aead83 it was far too low with an FPGA, whose "cannot
run" stand-in time of 1e9 s skewed its starting prices). Both are valid lower bounds, so is
their maximum; the bound is taken on the analysed graph, not the split one (split shards add
a little work no bound may assume). With an FPGA both bounds cost its units at the FPGA
model's MAC floor (`CostTables.bound_problem`, passes.plan_costs: MACs at the card's whole usable DSP budget, which
no stage holding them can beat) and leave out units whose BRAM alone exceeds the card; the
planner's own stage times on the FPGA are the model's full dataflow estimate, so GPU+FPGA
ratios are looser than the others by construction.
`Plan.balance_ratio` itself is kept in the JSON rows (`planner_ratio`).

Data parallelism (DP), for the speedup/memory table. Each participating device runs the whole
model on batch/n samples (n participants, equal split). Device time = Σ over units of forward +
backward time on that device at batch/n, from the same `CostTables.times` the planner uses;
heterogeneous DP is bounded by the slowest device. Gradients are all-reduced with a ring:
    t_ar = 2(n−1)/n · param_bytes / min ring-link bandwidth
           + 2(n−1) · (max ring-link latency + both hosts' message_s)
(times on the one cost model, `passes.plan_costs.CostTables`: fwd and bwd with their fixed costs
per call and per micro-batch, and each device's per-iteration step_s after it.)
over the cluster's links between consecutive participants (a100↔a100 nvlink3, a100↔v100 the
slower PCIe, ...). Reported: serial (fwd + bwd + t_ar) and overlapped (fwd + max(bwd, t_ar),
as DDP's bucketed all-reduce at best). Memory per device = 4 × param bytes (weights, grads,
two Adam moments) + activations stashed for backward at batch/n; DP is infeasible when that
exceeds 90% of a participant's memory (the planner's headroom). With an FPGA in the cluster
(its times from `pipecc.targets.fpga_model`, as the planner uses), DP runs on the GPUs alone if the
FPGA cannot run some op, else on the faster of {all devices, GPUs alone}. Speedup = DP
iteration time / pipecc `predicted_iteration_s` (which includes the pipeline bubble and
stage-to-stage traffic).

The "auto" column is the plain pipeline (`replicas=1`: schedule, m and cuts chosen by pipecc).
PP x DP (hybrid column): `driver.plan(..., replicas="auto")`, pipecc's default since replica
groups (schedule, m, replication degree d and cuts searched together; `pipecc.techniques.replicas.search`). Its d = n, one-stage, m = 1 candidate
is the DP model above exactly: units at batch/n, the slowest device's fwd + max(bwd, t_ar) with
the same ring formula over the same links (the planner's all-reduce overlaps the last
backward, as the "overlapped" DP column does), memory 4 × param bytes + activations at batch/n
against 90% of the smallest device (tests/test_hybrid_plan.py checks the equality). Where the
two still differ: (1) with an FPGA in the cluster the planner never replicates (FPGA stages are
never replicated and every device gets a stage), while DP here may leave the FPGA out and run
on the GPUs alone; (2) DP splits the batch as batch/n even when n does not divide it, the
planner only uses d with (batch/m) % d == 0; (3) heterogeneous groups: the planner takes the
slowest member per unit (Σ max), DP the slowest device's total (max Σ), equal when one device
type is slower on every unit.

The 20k-node graph: a synthetic chain of 5000 blocks x → x + LayerNorm(ReLU(Linear(x))),
width 128, input [32, 512, 128] (4 graph nodes per block); `driver.plan` on 16xa100 is timed
end to end (fixed 1f1b, m = 32; unit construction included).

Run:  .venv/bin/python bench/bench_balance.py            # full, rewrites bench/RESULTS.md
      .venv/bin/python bench/bench_balance.py --quick    # a few models/configs, no write
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import replace_section  # noqa: E402

from pipecc import driver  # noqa: E402
from pipecc.targets.devices import Cluster, parse_devices  # noqa: E402
from pipecc.errors import PipeccError  # noqa: E402
from pipecc.passes import baselines as baseline_rules  # noqa: E402
from pipecc.techniques.replicas import search as rep  # noqa: E402
from pipecc.passes import split_search  # noqa: E402
from pipecc.passes.plan_options import PlanOptions
from pipecc.passes.plan_search import Planner  # noqa: E402
from pipecc.passes import plan_emit  # noqa: E402
from pipecc.passes.bound import lower_bound  # noqa: E402
from pipecc.passes.partition import evaluate  # noqa: E402
from pipecc.targets.timing import CANNOT_RUN_S, MEMORY_HEADROOM  # noqa: E402

BEGIN, END = "<!-- balance:begin -->", "<!-- balance:end -->"
RESULTS = ROOT / "bench" / "RESULTS.md"
MAX_ORDERS = 100
KINDS = ("homogeneous", "mixed", "gpu+fpga")
BASELINES = ("equal-count", "equal-layers", "equal-params", "block-partition")
GB = 1e9


@dataclass(frozen=True)
class ModelCase:
    label: str
    file: str
    batch: int
    args: dict[str, Any] = field(default_factory=dict)


MODELS = (
    ModelCase("vgg16", "vgg16", 32),
    ModelCase("resnet50", "resnet50", 32),
    ModelCase("gnmt", "gnmt", 64, {"src_len": 50, "tgt_len": 50}),
    ModelCase("gpt2", "gpt", 32, {"preset": "gpt2", "seq_len": 1024}),
    ModelCase("gpt1-14", "gpt", 32, {"preset": "gpt1-14", "seq_len": 512}),
    ModelCase("gpt2-xl", "gpt", 32, {"preset": "gpt2-xl", "seq_len": 1024}),
    ModelCase("bert", "bert", 32, {"seq_len": 512}),
    ModelCase("tiny_cnn", "tiny_cnn", 32),
    ModelCase("mlp", "mlp", 32),
)
QUICK_MODELS = ("vgg16", "gnmt", "gpt2")
TEST_MODELS = ("tiny_cnn", "mlp")


# ---------------------------------------------------------------------------- configurations
def device_spec(kind: str, p: int) -> str:
    if kind == "homogeneous":
        return f"{p}xa100"
    if kind == "mixed":
        return f"{p // 2}xa100,{p - p // 2}xv100"
    return f"{p - 1}xa100,1xu250" if p > 1 else "1xu250"


def distinct_orders(cluster: Cluster) -> int:
    names = [d.name for d in cluster.devices]
    return math.factorial(len(names)) // math.prod(math.factorial(names.count(t)) for t in set(names))


def microbatches(batch: int, p: int) -> int:
    return max(m for m in range(1, min(2 * p, batch) + 1) if batch % m == 0)


# ---------------------------------------------------------------------------- bounds, baselines
def fluid_bound(cost: np.ndarray, types: Sequence[str]) -> float:
    """Exact optimum of the fluid relaxation (every node divisible across devices, no comm):
    max over prices λ ≥ 0, Σλ = 1 of Σ_i min_d λ_d c[d][i] (LP duality). By concavity and
    symmetry the optimum prices are equal within a device type, so for two types A, B (counts
    mA, mB) it is max over s ∈ [0, 1] of f(s) = Σ_i min(s·a_i, (1−s)·b_i), a = c_A/mA,
    b = c_B/mB — concave and piecewise linear, maximal at a breakpoint s_i = b_i/(a_i + b_i).
    Returns 0.0 (no claim) for more than two types."""
    kinds = sorted(set(types))
    rows = {t: [d for d, x in enumerate(types) if x == t] for t in kinds}
    if len(kinds) == 1:
        return float(cost[0].sum() / len(types))
    if len(kinds) > 2:
        return 0.0
    ia, ib = rows[kinds[0]], rows[kinds[1]]
    a, b = cost[ia[0]] / len(ia), cost[ib[0]] / len(ib)
    tot = a + b
    s = np.where(tot > 0, b / np.where(tot > 0, tot, 1.0), 0.0)
    order = np.argsort(s, kind="stable")
    s, a, b = s[order], a[order], b[order]
    a_suffix = np.concatenate((np.cumsum(a[::-1])[::-1], [0.0]))
    b_prefix = np.concatenate(([0.0], np.cumsum(b)))
    cand = np.concatenate((s, [0.0, 1.0]))
    k = np.searchsorted(s, cand, side="left")  # nodes k.. have s_i >= s: they pay s·a_i
    return float(np.max(cand * a_suffix[k] + (1 - cand) * b_prefix[k]))


def _layer_key(name: str) -> str:
    """`blocks.3.attn.proj` -> `blocks.3`; `encoder.layer.5.x` -> `encoder.layer.5`; `wte` -> `wte`."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


def layer_weights(names: Sequence[Sequence[str]], param_bytes: np.ndarray) -> list[float]:
    """1 on the first parameterised unit of each top-level module instance, else 0."""
    seen: set[str] = set()
    out = []
    for unit, pb in zip(names, param_bytes):
        key = _layer_key(unit[-1])
        out.append(1.0 if pb > 0 and key not in seen else 0.0)
        if pb > 0:
            seen.add(key)
    return out


def _problem(plan, graph, cluster: Cluster, batch: int):
    """Rebuild the partition problem pipecc solved for this plan (same units, order, m)."""
    opts = PlanOptions(batch_size=batch, microbatches=plan.microbatches, schedule=plan.schedule,
                       split_layers=False)
    bal = Planner(graph, cluster, opts, splittable=split_search.splittable_names(graph))
    mb = batch // plan.microbatches
    units = bal.tables.builder.at(mb)
    order = tuple(d["given_index"] for d in plan.devices)
    return bal.evaluator.problem(units, mb, plan.schedule, plan.microbatches, order), units, order, bal


def _plan_bounds(plan, units) -> tuple[int, ...]:
    index = {name: u for u, names in enumerate(units.names) for name in names}
    return tuple(index[s.nodes[0]] for s in plan.stages) + (units.n,)


def _short(name: str) -> str:
    head = name.split(" (")[0]
    return "block-partition" if head.startswith("block-partition") else head


# ---------------------------------------------------------------------------- data parallelism
def data_parallel(graph, cluster: Cluster, batch: int) -> dict[str, Any]:
    """DP on the same cost model (module docstring). Times in s, memory in bytes.

    With an FPGA in the cluster, DP runs on the GPUs alone when the FPGA cannot run some op,
    and otherwise on whichever of {all devices, GPUs alone} is faster (an equal share of the
    batch on a slow card would bound everyone)."""
    probe = Planner(graph, cluster, PlanOptions(batch_size=batch))
    fwd1, _ = probe.tables.times(probe.tables.builder.at(1), 1)
    gpus = [d for d, dev in enumerate(cluster.devices) if dev.kind != "fpga"]
    runs_all = all(bool(np.all(fwd1[d] < CANNOT_RUN_S)) for d in range(len(cluster.devices)))
    options = [list(range(len(cluster.devices)))] if runs_all else []
    if len(gpus) < len(cluster.devices) and gpus:
        options.append(gpus)
    results = [_dp_on(graph, cluster, part, batch) for part in options]
    best = min(results, key=lambda r: (not r["fits"], r["serial_s"]))
    best["fpga_excluded"] = best["n"] < len(cluster.devices)
    return best


def _dp_on(graph, cluster: Cluster, part: list[int], batch: int) -> dict[str, Any]:
    sub = Cluster(devices=tuple(cluster.devices[d] for d in part),
                  links=tuple(tuple(cluster.links[i][j] for j in part) for i in part))
    n, share = len(part), batch / len(part)
    bal = Planner(graph, sub, PlanOptions(batch_size=batch))
    units = bal.tables.builder.at(share)
    tables = bal.tables  # the one cost model: the fixed costs per call, micro-batch, step, message
    fwd, bwd = tables.times(units, share)
    fixed = np.array([tables.stage_fixed(d) for d in range(n)])
    f, b = fwd.sum(axis=1) + fixed[:, 0], bwd.sum(axis=1) + fixed[:, 1]
    step = np.array([tables.step_s(d) for d in range(n)])
    param_bytes = float(units.param_bytes.sum())
    if n > 1:
        ring = [sub.link(i, (i + 1) % n) for i in range(n)]
        host = max(tables.message_s(i, (i + 1) % n) for i in range(n))
        t_ar = rep.ring_allreduce_s(ring, param_bytes, host)
        ring_name = min(ring, key=lambda x: x.bandwidth).name
    else:
        t_ar, ring_name = 0.0, "none"
    memory = 4 * param_bytes + float(units.values["stash_bytes"].sum())
    short = [d for d, dev in enumerate(sub.devices) if memory > dev.memory_bytes * MEMORY_HEADROOM]
    return {"devices": [d.name for d in sub.devices], "n": n,
            "serial_s": float(np.max(f + b + step) + t_ar),
            "overlapped_s": float(np.max(f + np.maximum(b, t_ar) + step)), "allreduce_s": t_ar,
            "ring_link": ring_name, "memory_bytes": memory, "param_bytes": param_bytes,
            "fits": not short, "short_device": sub.devices[short[0]].name if short else None,
            "short_cap": sub.devices[short[0]].memory_bytes * MEMORY_HEADROOM if short else None}


# ---------------------------------------------------------------------------- one case
def run_case(analysis, model: str, kind: str, p: int, batch: int, auto: bool = True,
             spec: str | None = None) -> dict[str, Any]:
    """Plan one model on one cluster and score it against the baselines and DP. Never raises
    for a planning failure: the row's `status` says 'infeasible: ...' or 'error: ...'."""
    spec = spec or device_spec(kind, p)
    cluster = parse_devices(spec)
    m = microbatches(batch, p)
    choose = distinct_orders(cluster) <= MAX_ORDERS and len(set(d.name for d in cluster.devices)) > 1
    row: dict[str, Any] = {"model": model, "kind": kind, "p": p, "devices": spec, "batch": batch,
                           "microbatches": m, "choose_order": choose, "status": "ok", "notes": []}
    compare = True
    t0 = time.perf_counter()
    try:
        try:
            plan, graph = driver.plan(analysis, cluster, microbatches=m, schedule="1f1b", replicas=1,
                                      choose_order=choose, compare=True)
        except RuntimeError as exc:  # a baseline crashed inside the planner: plan without them
            row["notes"].append(f"planner bug: compare=True raised {type(exc).__name__}: {exc}")
            compare = False
            t0 = time.perf_counter()
            plan, graph = driver.plan(analysis, cluster, microbatches=m, schedule="1f1b", replicas=1,
                                      choose_order=choose, compare=False)
    except (PipeccError, ValueError) as exc:
        row["status"] = f"infeasible: {exc}"
        row["plan_s"] = time.perf_counter() - t0
        return row
    except Exception as exc:  # noqa: BLE001 — a crash is a result to report, not to hide
        row["status"] = f"error: {type(exc).__name__}: {exc}"
        row["traceback"] = traceback.format_exc(limit=4)
        return row
    row["plan_s"] = time.perf_counter() - t0
    row.update(bottleneck_s=plan.bottleneck_s, planner_lb_s=plan.lower_bound_s,
               planner_ratio=plan.balance_ratio, iteration_s=plan.predicted_iteration_s,
               bubble=plan.bubble_fraction, split_layers=len(plan.split_layers),
               order=[d["name"] for d in plan.devices],
               pipe_memory_bytes=max(s.peak_memory_bytes for s in plan.stages))
    _score(row, plan, graph, analysis.graph, cluster, batch, compare)
    dp = data_parallel(analysis.graph, cluster, batch)
    row["dp"] = dp
    if auto:
        t0 = time.perf_counter()
        try:
            ap, _ = driver.plan(analysis, cluster, choose_order=choose, replicas=1)
            row["auto"] = {"schedule": ap.schedule, "microbatches": ap.microbatches,
                           "iteration_s": ap.predicted_iteration_s,
                           "memory_bytes": max(s.peak_memory_bytes for s in ap.stages),
                           "plan_s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001
            row["auto"] = {"error": f"{type(exc).__name__}: {exc}"}
        t0 = time.perf_counter()
        try:  # PP x DP: the same, with the replication degree searched with the cuts
            hp, _ = driver.plan(analysis, cluster, choose_order=choose, replicas="auto")
            row["hybrid"] = {"schedule": hp.schedule, "microbatches": hp.microbatches,
                             "replicas": hp.replicas, "stages": len(hp.stages),
                             "iteration_s": hp.predicted_iteration_s,
                             "memory_bytes": max(s.peak_memory_bytes for s in hp.stages),
                             "plan_s": time.perf_counter() - t0}
        except Exception as exc:  # noqa: BLE001
            row["hybrid"] = {"error": f"{type(exc).__name__}: {exc}"}
    return row


def _score(row: dict[str, Any], plan, graph, original, cluster: Cluster, batch: int,
           compare: bool) -> None:
    """Lower bound, baseline ratios against it, and a consistency check of the rebuilt problem.

    `graph` is the plan's (possibly layer-split) graph, `original` the analysed one. The bound
    and the bench's own baselines use the original: split shards add a little work (concats,
    repeated input reads) that no bound may assume, and the other tools never split layers."""
    mb = batch // plan.microbatches
    prob, units, order, bal = _problem(plan, graph, cluster, batch)
    _, mine = bal.tables.recost(prob, _plan_bounds(plan, units), order, mb)
    if not math.isclose(mine.bottleneck, plan.bottleneck_s, rel_tol=1e-9):
        row["notes"].append(f"rebuilt problem disagrees with the plan: bottleneck "
                            f"{mine.bottleneck:.6g} vs {plan.bottleneck_s:.6g} s")
    base, base_units, _, base_bal = _problem(plan, original, cluster, batch) \
        if graph is not original else (prob, units, order, bal)
    bound = base_bal.tables.bound_problem(base, order, mb)  # FPGA rows: the MAC floor (see CostTables)
    cost = np.asarray(bound.fwd) + np.asarray(bound.bwd)
    types = [cluster.devices[d].name for d in order]
    planner_lb = lower_bound(bound, base_units.splittable,
                             split_bytes=plan_emit.split_floor(base_bal.evaluator, base_units),
                             split_fixed=plan_emit.piece_fixed(base_bal.evaluator, order, 1,
                                                               len(bound.mem_cap)))
    if not math.isclose(planner_lb, plan.lower_bound_s, rel_tol=1e-9):
        row["notes"].append(f"Plan.lower_bound_s {plan.lower_bound_s:.6g} s differs from the "
                            f"planner's bound on the analysed graph, {planner_lb:.6g} s")
    lb = max(planner_lb, fluid_bound(cost, types))
    row["lb_s"], row["ratio"] = lb, plan.bottleneck_s / lb
    found = {_short(b["name"]): b for b in plan.baselines} if compare else {}
    p, n = len(order), base_units.n
    rules = {"equal-layers": lambda: baseline_rules.equal_count(
        n, p, weights=layer_weights(base_units.names, base_units.param_bytes))}
    if not compare:  # the planner's baselines crashed; score the ones that still run
        rules.update({"equal-count": lambda: baseline_rules.equal_count(n, p),
                      "equal-params": lambda: baseline_rules.equal_params(base_units.param_bytes, p),
                      "block-partition": lambda: baseline_rules.block_partition(cost[0], p)})
    for name, rule in rules.items():
        try:
            _, part = base_bal.tables.recost(base, rule(), order, mb)
            found[name] = {"bottleneck_s": part.bottleneck, "fits_memory": part.fits}
        except Exception as exc:  # noqa: BLE001
            found[name] = {"error": f"{type(exc).__name__}: {exc}"}
    row["baselines"] = {}
    for name in BASELINES:
        b = found.get(name)
        if b is None or "error" in b:
            row["baselines"][name] = {"error": (b or {}).get("error", "missing")}
            continue
        unsupported = b["bottleneck_s"] >= CANNOT_RUN_S
        row["baselines"][name] = {"bottleneck_s": b["bottleneck_s"], "ratio": b["bottleneck_s"] / lb,
                                  "fits_memory": bool(b["fits_memory"]), "unsupported": unsupported,
                                  "beats_pipecc": bool(b["fits_memory"]) and not unsupported
                                  and b["bottleneck_s"] < plan.bottleneck_s * (1 - 1e-9)}


# ---------------------------------------------------------------------------- the 20k graph
def deep_chain(depth: int, width: int):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act, self.norm = nn.Linear(width, width), nn.ReLU(), nn.LayerNorm(width)

        def forward(self, x):
            return x + self.norm(self.act(self.fc(x)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(depth)])


def bench_big(depth: int = 5000, width: int = 128, devices: str = "16xa100") -> dict[str, Any]:
    """Analyse the synthetic chain, time `driver.plan` with and without the layer-split search,
    and score the planner's baseline rules on the same problem (without planning again)."""
    import torch
    from pipecc.passes.units import UnitBuilder
    model = deep_chain(depth, width)
    t0 = time.perf_counter()
    graph = driver.analyze_module(model, (torch.randn(32, 512, width),), model_name="deep_chain")
    out: dict[str, Any] = {"depth": depth, "width": width, "devices": devices,
                           "nodes": len(graph.compute_nodes()),
                           "analyze_s": time.perf_counter() - t0}
    t0 = time.perf_counter()
    plan, planned = driver.plan(graph, devices, microbatches=32, schedule="1f1b", replicas=1)
    out.update(plan_s=time.perf_counter() - t0, ratio=plan.balance_ratio,
               split_layers=len(plan.split_layers), iteration_s=plan.predicted_iteration_s)
    t0 = time.perf_counter()
    driver.plan(graph, devices, microbatches=32, schedule="1f1b", split_layers=False, replicas=1)
    out["plan_nosplit_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    UnitBuilder(graph)
    out["units_s"] = time.perf_counter() - t0
    prob, units, _, _ = _problem(plan, planned, parse_devices(devices), 32)
    cost = np.asarray(prob.fwd) + np.asarray(prob.bwd)
    p = len(prob.mem_cap)
    rules = {"equal-count": lambda: baseline_rules.equal_count(units.n, p),
             "equal-params": lambda: baseline_rules.equal_params(units.param_bytes, p),
             "block-partition": lambda: baseline_rules.block_partition(cost[0], p)}
    out["baselines"] = {}
    for name, rule in rules.items():
        try:
            out["baselines"][name] = evaluate(prob, rule()).bottleneck / plan.lower_bound_s
        except Exception as exc:  # noqa: BLE001
            out["baselines"][name] = f"{type(exc).__name__}: {exc}"
    return out


# ---------------------------------------------------------------------------- report
def _f(x: float, digits: int = 3) -> str:
    return f"{x:.{digits}f}"


def _ratio(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.3g}"


def _baseline_cell(b: dict[str, Any]) -> str:
    if "error" in b:
        return "crash"
    if b["unsupported"]:
        return "✗fpga"
    cell = _ratio(b["ratio"]) + ("" if b["fits_memory"] else "†")
    return f"**{cell} WIN**" if b["beats_pipecc"] else cell


def _fmt_median(med_count: tuple[float, int]) -> str:
    med, count = med_count
    return "—" if not count else f"{_ratio(med)} ({count})"


def _spread(rows: list[dict[str, Any]]) -> str:
    vals = [r["ratio"] for r in rows if r["model"] in TEST_MODELS]
    return f"{_ratio(min(vals))} to {_ratio(max(vals))}" if vals else "none run"


def _model_order(label: str) -> int:
    return [m.label for m in MODELS].index(label)


def _median(rows: list[dict[str, Any]], key: str, ps: Sequence[int], kinds=KINDS) -> tuple[float, int]:
    vals = [r[key] for r in rows if r["status"] == "ok" and r["p"] in ps and r["kind"] in kinds]
    return (statistics.median(vals) if vals else float("nan")), len(vals)


def render(rows: list[dict[str, Any]], big: dict[str, Any] | None, command: str,
           runtime_s: float) -> str:
    out = [f"## Balance: pipecc vs other tools' partitions, and vs data parallelism", "",
           f"Command: `{command}`  ", f"Date: {datetime.date.today().isoformat()}; "
           f"bench runtime {runtime_s:.0f} s on {platform.machine()} "
           f"({platform.python_implementation()} {platform.python_version()}).  ",
           "**Costs are modelled, not measured: these are predictions of pipecc's cost model "
           "for the listed devices.** Definitions (models, batches, DP model, the lower bound) "
           "are in the docstring of `bench/bench_balance.py`.", ""]
    ok = [r for r in rows if r["status"] == "ok"]
    full = [r for r in ok if r["model"] not in TEST_MODELS]
    wins = [(r, n) for r in ok for n, b in r["baselines"].items() if b.get("beats_pipecc")]
    out += ["### Summary", "",
            f"Median balance ratio (1.000 = the lower bound) over the full-size models "
            f"({', '.join(sorted({r['model'] for r in full}, key=_model_order))}); the test models "
            f"{' and '.join(TEST_MODELS)} are listed below but left out of the medians: their "
            "nodes take microseconds, so link latency, which the bound ignores, dominates and "
            f"their ratios ({_spread(ok)}) say nothing about balancing. In each cell: median "
            "(number of cases); a baseline's median counts only the cases where it can run at "
            "all (no ✗fpga).", "",
            "| p | pipecc: homogeneous | mixed | GPU+FPGA | all | "
            + " | ".join(BASELINES) + " |", "|--:|" + "--:|" * (4 + len(BASELINES))]
    for ps in ((2,), (4,), (8,), (16,), (4, 8)):
        cells = [_fmt_median(_median(full, "ratio", ps, (k,))) for k in KINDS]
        cells.append("**" + _fmt_median(_median(full, "ratio", ps)) + "**")
        for name in BASELINES:
            vals = [r["baselines"][name]["ratio"] for r in full if r["p"] in ps
                    and "ratio" in r["baselines"][name] and not r["baselines"][name]["unsupported"]]
            cells.append(_fmt_median((statistics.median(vals), len(vals)) if vals else (math.nan, 0)))
        out.append(f"| {'/'.join(map(str, ps))} | " + " | ".join(cells) + " |")
    out.append("")
    out.append(f"- cases where a baseline beats pipecc (fits memory, lower bottleneck): "
               f"**{len(wins)}** of {sum(len(r['baselines']) for r in ok)} baseline placements"
               + ("" if not wins else ": " + "; ".join(
                   f"{r['model']} on {r['devices']}: {n} {r['baselines'][n]['bottleneck_s']:.6g} s "
                   f"vs pipecc {r['bottleneck_s']:.6g} s" for r, n in wins)))
    over = [r for r in full if r["p"] in (4, 8)]
    high = sorted(over, key=lambda r: -r["ratio"])[:3]
    out.append(f"- full-size cases at p = 4/8 with a ratio ≤ 1.05: "
               f"{sum(r['ratio'] <= 1.05 for r in over)} of {len(over)}; highest: "
               + ", ".join(f"{r['model']} on {r['devices']} {_ratio(r['ratio'])}" for r in high))
    bad = [r for r in rows if r["status"] != "ok"]
    out.append(f"- cases planned: {len(ok)} of {len(rows)}"
               + ("" if not bad else "; not planned (recorded, not raised): " + "; ".join(
                   f"{r['model']} on {r['devices']} ({r['status'][:110]})" for r in bad)))
    worse = [r for r in ok if r.get("auto", {}).get("iteration_s", 0) > r["iteration_s"] * (1 + 1e-9)]
    if worse:
        out.append("- pipecc's auto choice predicted slower than the fixed 1F1B plan (auto splits "
                   "layers for the best micro-batch count of each schedule only, chosen before "
                   "splitting; the 1F1B row's m may be another): " + "; ".join(
                       f"{r['model']} on {r['devices']}: auto {r['auto']['schedule']} "
                       f"m={r['auto']['microbatches']} {r['auto']['iteration_s']:.4g} s vs 1f1b "
                       f"m={r['microbatches']} {r['iteration_s']:.4g} s" for r in worse))
    notes = [f"{r['model']} on {r['devices']}: {n}" for r in rows for n in r.get("notes", [])]
    if notes:
        out.append("- notes: " + "; ".join(notes))
    loose = [r for r in ok if r["planner_ratio"] > r["ratio"] * 1.01]
    if loose:
        out.append(f"- `Plan.balance_ratio` (the planner's mirror-ascent bound) is > 1% above the "
                   f"ratio against the exact fluid bound in {len(loose)} cases"
                   + (", all GPU+FPGA" if all(r["kind"] == "gpu+fpga" for r in loose) else "")
                   + "; e.g. " + ", ".join(
                       f"{r['model']} on {r['devices']} {r['planner_ratio']:.3g} vs {_ratio(r['ratio'])}"
                       for r in loose[:4]))
    out += _dp_summary(full)
    if big:
        out.append(f"- plan time on the {big['nodes']:,}-node graph ({big['devices']}): "
                   f"**{big['plan_s']:.1f} s** (details at the end)")
    out += ["", "### Balance ratio (bottleneck / lower bound; 1.000 is optimal)", "",
            "Baseline marks: † exceeds some device's memory; ✗fpga puts on the FPGA what its "
            "backend cannot build — an op it cannot generate or a stage boundary of more than "
            "one float32 tensor (the tool has no notion of either); **WIN** a baseline beats "
            "pipecc. FPGA stage times are the FPGA model's time of the whole stage (as in "
            "estimates.json), for pipecc and the baselines alike; an FPGA's memory is its on-chip "
            "BRAM. "
            "Order: ✓ pipecc chose the device order (baselines use that order too). "
            "s/iter: predicted seconds per training iteration; auto: pipecc's own choice of "
            "schedule and micro-batches.", "",
            "| model | devices | order | m | pipecc | equal-count | equal-layers | equal-params "
            "| block-part. | splits | s/iter (1f1b) | auto: sched m s/iter | plan s |",
            "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        head = f"| {r['model']} | {r['devices']} | {'✓' if r['choose_order'] else ''} | {r['microbatches']} |"
        if r["status"] != "ok":
            out.append(f"{head} {r['status'][:120]} |||||||||")
            continue
        a = r.get("auto", {})
        auto = ("—" if not a else a.get("error", "")[:40] if "error" in a else
                f"{a['schedule']} {a['microbatches']} {a['iteration_s']:.4g}")
        cells = " | ".join(_baseline_cell(r["baselines"][n]) for n in BASELINES)
        out.append(f"{head} {_ratio(r['ratio'])} | {cells} | {r['split_layers']} | "
                   f"{r['iteration_s']:.4g} | {auto} | {r['plan_s']:.2f} |")
    out += ["", "### Against data parallelism", "",
            "DP: whole model per device on batch/n, ring all-reduce of fp32 gradients (serial / "
            "overlapped with backward). Speedup = DP s/iter ÷ pipecc s/iter. GB: per device "
            "(pipecc: the largest stage's peak).", "",
            "| model | devices | DP on (ring link) | DP s/iter serial / overlapped | DP GB/dev "
            "| pipecc s/iter 1f1b / auto | speedup 1f1b vs serial / overlapped | "
            "speedup auto vs overlapped | pipecc GB/dev | memory DP ÷ pipecc "
            "| hybrid (replicas=auto): d×stages sched m s/iter | speedup hybrid vs overlapped "
            "| hybrid GB/dev |",
            "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in ok:
        dp, a = r["dp"], r.get("auto", {})
        on = f"{dp['n']}× ({dp['ring_link']})" + (" GPUs only" if dp["fpga_excluded"] else "")
        auto_s = a.get("iteration_s")
        if dp["fits"]:
            dp_cell = f"{dp['serial_s']:.4g} / {dp['overlapped_s']:.4g}"
            sp = f"{dp['serial_s'] / r['iteration_s']:.2f}× / {dp['overlapped_s'] / r['iteration_s']:.2f}×"
            sp_auto = f"{dp['overlapped_s'] / auto_s:.2f}×" if auto_s else "—"
            mem = f"{dp['memory_bytes'] / GB:.1f}"
        else:
            dp_cell = "DP infeasible"
            sp, sp_auto = "pipeline vs DP infeasible", "—"
            mem = (f"{dp['memory_bytes'] / GB:.1f} > {dp['short_cap'] / GB:.1f} "
                   f"({dp['short_device']})")
        pipe = f"{r['iteration_s']:.4g} / " + (f"{auto_s:.4g}" if auto_s else "—")
        h = r.get("hybrid", {})
        if "iteration_s" in h:
            hyb = (f"{h['replicas']}×{h['stages']} {h['schedule']} {h['microbatches']} "
                   f"{h['iteration_s']:.4g}")
            sp_h = f"{dp['overlapped_s'] / h['iteration_s']:.2f}×" if dp["fits"] else "—"
            mem_h = f"{h['memory_bytes'] / GB:.1f}"
        else:
            hyb, sp_h, mem_h = (h.get("error", "—")[:40] or "—"), "—", "—"
        out.append(f"| {r['model']} | {r['devices']} | {on} | {dp_cell} | {mem} | {pipe} | {sp} | "
                   f"{sp_auto} | {r['pipe_memory_bytes'] / GB:.1f} | "
                   f"{dp['memory_bytes'] / r['pipe_memory_bytes']:.1f}× | {hyb} | {sp_h} | {mem_h} |")
    if big:
        out += ["", f"### Plan time on a {big['nodes']:,}-node graph", "",
                f"Synthetic chain of {big['depth']} blocks x + LayerNorm(ReLU(Linear(x))), width "
                f"{big['width']}, input [32, 512, {big['width']}]; {big['devices']}, 1f1b, "
                "m = 32, layer-split search on.", "",
                f"- analysis (capture, shapes, sympy costs): {big['analyze_s']:.1f} s",
                f"- `driver.plan` end to end: **{big['plan_s']:.1f} s**; balance ratio "
                f"{_f(big['ratio'])}, {big['split_layers']} split layers. Building the cost units "
                f"once (`UnitBuilder`, sympy lambdify of {big['nodes']:,} nodes) takes "
                f"{big['units_s']:.1f} s",
                f"- `driver.plan` with `split_layers=False`: {big['plan_nosplit_s']:.1f} s",
                "- baselines on the same problem (bottleneck / `Plan.lower_bound_s`): " + ", ".join(
                    f"{k} {_ratio(v)}" if isinstance(v, float) else f"{k} crashed ({v})"
                    for k, v in big["baselines"].items())]
    return "\n".join(out) + "\n"


def _dp_summary(rows: list[dict[str, Any]]) -> list[str]:
    fits = [r for r in rows if r["dp"]["fits"]]
    if not rows:
        return []
    out = [f"- data parallelism is infeasible (memory) in {len(rows) - len(fits)} of {len(rows)} "
           "full-size cases; pipecc plans them all"]
    if fits:
        sp = [r["dp"]["serial_s"] / r["iteration_s"] for r in fits]
        spo = [r["dp"]["overlapped_s"] / r["auto"]["iteration_s"] for r in fits
               if "iteration_s" in r.get("auto", {})]
        mem = [r["dp"]["memory_bytes"] / r["pipe_memory_bytes"] for r in rows]
        out.append(f"- predicted speedup over DP where DP fits: 1F1B plan vs serial DP median "
                   f"{statistics.median(sp):.2f}× (range {min(sp):.2f}–{max(sp):.2f}×, pipecc "
                   f"faster in {sum(x > 1 for x in sp)} of {len(sp)})"
                   + (f"; pipecc's auto plan vs overlapped DP median {statistics.median(spo):.2f}× "
                      f"(faster in {sum(x > 1 for x in spo)} of {len(spo)})" if spo else "")
                   + f"; per-device memory DP ÷ pipecc median {statistics.median(mem):.1f}× "
                   f"(range {min(mem):.1f}–{max(mem):.1f}×)")
        hy = [r for r in fits if "iteration_s" in r.get("hybrid", {})]
        if hy:
            sph = [r["dp"]["overlapped_s"] / r["hybrid"]["iteration_s"] for r in hy]
            memh = [r["hybrid"]["memory_bytes"] / r["dp"]["memory_bytes"] for r in hy]
            lose = [f"{r['model']} {r['devices']} {x:.2f}×" for r, x in zip(hy, sph) if x < 1 - 1e-9]
            out.append(f"- PP x DP (pipecc auto with replicas=auto) vs overlapped DP where DP fits: "
                       f"median {statistics.median(sph):.2f}×, min {min(sph):.2f}×, at least as "
                       f"fast in {sum(x >= 1 - 1e-9 for x in sph)} of {len(sph)}"
                       + (f" (slower: {', '.join(lose)})" if lose else "")
                       + f"; per-device memory hybrid ÷ DP median {statistics.median(memh):.2f}× "
                       f"(max {max(memh):.2f}×, at most DP's in "
                       f"{sum(x <= 1 + 1e-9 for x in memh)} of {len(memh)}); replication chosen "
                       f"(d > 1) in {sum(r['hybrid']['replicas'] > 1 for r in hy)} of {len(hy)}")
    return out


def write_section(path: Path, text: str) -> None:
    """Rewrite this bench's section of `path` (bench/results.py)."""
    replace_section(path, "balance", text)


# ---------------------------------------------------------------------------- main
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help=f"models {', '.join(QUICK_MODELS)}, p = 4 and 8, a 1000-node big graph; "
                         "does not write RESULTS.md unless --output is given")
    ap.add_argument("--models", nargs="*", help="labels from: " + ", ".join(m.label for m in MODELS))
    ap.add_argument("--devices", nargs="*", type=int, help="device counts (default 2 4 8 16)")
    ap.add_argument("--kinds", nargs="*", choices=KINDS)
    ap.add_argument("--no-auto", action="store_true", help="skip pipecc's auto schedule column")
    ap.add_argument("--big-depth", type=int, help="blocks in the big graph (default 5000; 0 skips)")
    ap.add_argument("--output", type=Path, help=f"results file (default {RESULTS.relative_to(ROOT)})")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--json", type=Path, help="also dump all rows as JSON here")
    ap.add_argument("--from-json", type=Path, help="re-render a --json dump instead of running")
    args = ap.parse_args(argv)
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        return _emit(saved["rows"], saved["big"], saved["command"], saved["runtime_s"], args,
                     write=not args.no_write)
    labels = args.models or (QUICK_MODELS if args.quick else [m.label for m in MODELS])
    ps = args.devices or ([4, 8] if args.quick else [2, 4, 8, 16])
    kinds = args.kinds or list(KINDS)
    depth = args.big_depth if args.big_depth is not None else (250 if args.quick else 5000)
    write = not args.no_write and (args.output is not None or not args.quick)
    command = "python bench/bench_balance.py" + ("" if argv is None and len(sys.argv) == 1
                                                 else " " + " ".join(sys.argv[1:] if argv is None else argv))
    start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    for case in (m for m in MODELS if m.label in labels):
        t0 = time.perf_counter()
        analysis = driver.analyze(ROOT / "models" / f"{case.file}.py", model_args=case.args or None,
                                  batch_size=case.batch)
        print(f"# {case.label}: {len(analysis.graph.compute_nodes())} nodes, analysed in "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        for p in ps:
            for kind in kinds:
                row = run_case(analysis, case.label, kind, p, case.batch, auto=not args.no_auto)
                rows.append(row)
                if row["status"] != "ok":
                    print(f"  {row['devices']:>16}  {row['status'][:150]}", flush=True)
                    continue
                bl = "  ".join(f"{n} {_baseline_cell(b)}" for n, b in row["baselines"].items())
                print(f"  {row['devices']:>16}  pipecc {row['ratio']:.3f} (planner "
                      f"{row['planner_ratio']:.3f})  {bl}  plan {row['plan_s']:.2f} s", flush=True)
        del analysis
    if args.json:  # the rows so far, should the big graph fail
        args.json.write_text(json.dumps({"rows": rows, "big": None, "command": command,
                                         "runtime_s": time.perf_counter() - start},
                                        indent=1, default=str))
    big = None
    if depth:
        big = bench_big(depth)
        print(f"# big graph: {big['nodes']} nodes, analyse {big['analyze_s']:.1f} s, plan "
              f"{big['plan_s']:.1f} s", flush=True)
    return _emit(rows, big, command, time.perf_counter() - start, args, write)


def _emit(rows: list[dict[str, Any]], big: dict[str, Any] | None, command: str, runtime: float,
          args: argparse.Namespace, write: bool) -> int:
    text = render(rows, big, command, runtime)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "big": big, "command": command,
                                         "runtime_s": runtime}, indent=1, default=str))
    if write:
        write_section(args.output or RESULTS, text)
        print(f"wrote {args.output or RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
