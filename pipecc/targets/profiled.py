"""Measured costs in the planner: a `pipecc profile` document behind the `DeviceCosts`
interface of `pipecc.targets.timing` (the format is documented in `pipecc.profile`).

    use_profile        the driver's one step: load ─► check the model ─► check the devices
                       ─► measured links; raises one-line PipeccErrors, so nothing is written
    ProfiledCosts      a device the profile timed: a unit costs the sum of its nodes' fitted
                       curves a + c·mb, the roofline for nodes the profile lacks
    time_source        where a stage's time came from: profile, roofline, mixed, fpga-model
    profile_decisions  the plan's decision lines: what was measured, what was extrapolated

Nodes the profile lacks: the shards `fc.shard<i>` of an intra-layer split (`passes.split_layers`)
cost the original node's curve scaled by the shard's share of the shards' forward FLOPs; the
split's helpers and combine, and any node the profile did not time, cost the roofline of that
node alone. A unit's time is a sum over its nodes, so the per-unit arrays stay additive (the
exact partitioner sums them). Memory stays the roofline model's: the profile times, it does
not measure memory.

A device is covered when the profile timed a device of its name (`cpu`, `a100`); a link is
replaced by the measured one when both its ends are covered and run on the torch device types
the link was measured between (gloo: cpu and cpu; NCCL: two GPUs), all on this host.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import sympy
import torch.fx as fx

from pipecc.errors import PipeccError
from pipecc.ir.graph import META_COST, META_NAME, AnnotatedGraph
from pipecc.profile.cache import file_sha256
from pipecc.profile.fit import AffineFit
from pipecc.targets.fpga_timing import FpgaCosts
from pipecc.targets.hardware import Cluster, Device, Link
from pipecc.targets.timing import DeviceCosts, RooflineCosts, StageMemory, UnitNumbers

__all__ = ["Profile", "ProfiledCosts", "load_profile", "use_profile", "time_source",
           "profile_decisions"]

# NOTE: the profile package's own names (pipecc.profile.profiler) are not imported: the
# profiler runs the driver, which runs this module's checks, and the layering forbids cycles
FORMAT, VERSION = "pipecc.profile", 1
TIMED_OPS = ("call_module", "call_function", "call_method")
_SHARD = re.compile(r"^(?P<layer>.+)\.shard\d+$")


@dataclass
class Profile:
    """A checked profile document and where it came from (a file name, or "profile dict")."""

    data: dict[str, Any]
    source: str

    @property
    def microbatch_range(self) -> tuple[int, int]:
        """The smallest and largest micro-batch size timed."""
        sizes = [int(b) for b in self.data["microbatch_sizes"]]
        return min(sizes), max(sizes)

    def target_for(self, device: Device) -> dict[str, Any] | None:
        """The timing of `device`: a target that lists its name, the one on its placement
        first; None when the profile did not time such a device."""
        hits = [t for t in self.data["targets"] if device.name in t.get("devices", ())]
        place = device.placement or ("cuda" if device.kind == "gpu" else "cpu")
        return next((t for t in hits if str(t.get("torch_device", "")).startswith(place)),
                    hits[0] if hits else None)

    def measured_link(self) -> Link | None:
        link = self.data.get("link")
        if not link:
            return None
        return Link(f"measured {link['backend']}", float(link["bandwidth_Bps"]),
                    float(link["latency_s"]), f"measured: {self.source} ({link['backend']}, "
                    f"{' <-> '.join(link['devices'])})")


# ----------------------------------------------------------------------------- checks
MAX_FIT_S = 1e5  # a fitted per-call or per-sample time above this (28 hours) is no measurement


def load_profile(profile: str | Path | Mapping[str, Any] | Profile) -> Profile:
    """A profile file (or an already loaded document) checked for the fields the planner
    reads. Raises PipeccError naming the file and what is wrong with it."""
    if isinstance(profile, Profile):
        return profile
    if isinstance(profile, Mapping):
        data, where = dict(profile), "profile dict"
    else:
        where = str(profile)
        try:
            text = Path(profile).read_text(encoding="utf-8")
        except OSError as exc:
            raise PipeccError(f"cannot read profile {where}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise PipeccError(f"profile {where} is not JSON ({exc}); make one with "
                              "`pipecc profile MODEL --devices SPEC -o profile.json`") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PipeccError(f"{where} is not a pipecc profile (no \"format\": \"{FORMAT}\"); make "
                          "one with `pipecc profile MODEL --devices SPEC -o profile.json`")
    if data.get("version") != VERSION:
        raise PipeccError(f"{where} is a version {data.get('version')!r} pipecc profile; this "
                          f"pipecc reads version {VERSION}: profile the model again")
    problem = _malformed(data)
    if problem:
        raise PipeccError(f"{where} is not a valid pipecc profile: {problem}")
    return Profile(data, Path(where).name if where != "profile dict" else where)


def _malformed(data: dict[str, Any]) -> str | None:
    """What the planner needs and `data` lacks, or None."""
    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("args", {}), dict):
        return "no \"model\" object"
    sizes = data.get("microbatch_sizes")
    if not isinstance(sizes, list) or not sizes or not all(isinstance(b, int) and b > 0
                                                           for b in sizes):
        return "\"microbatch_sizes\" is not a list of positive integers"
    targets = data.get("targets")
    if not isinstance(targets, list) or not targets:
        return "no timed \"targets\""
    for t in targets:
        if not isinstance(t, dict) or not isinstance(t.get("devices"), list) \
                or not isinstance(t.get("nodes"), list):
            return "a target without \"devices\" and \"nodes\" lists"
        for n in t["nodes"]:
            try:
                fits = [n["fit"][k][p] for k in ("fwd", "bwd") for p in ("a", "c")]
                ok = isinstance(n["name"], str) and all(
                    isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in fits)
            except (KeyError, TypeError):
                ok = False
            if not ok:
                return f"node {n.get('name', '?') if isinstance(n, dict) else n!r} has no " \
                       "fit {fwd, bwd: {a >= 0, c >= 0}}"
            big = max(fits)
            if big > MAX_FIT_S:  # a damaged or hand-made figure: the search would spin on it for minutes
                return f"node {n['name']} has a fit of {big:g} s, beyond any measurement (over {MAX_FIT_S:g} s a " \
                       "call or a sample)"
    fixed = data.get("fixed_costs")
    if fixed is not None:  # NOTE: absent in older profiles (pipecc.targets.fixed_costs reads it)
        from pipecc.targets.fixed_costs import from_json
        if not isinstance(fixed, dict) or not all(isinstance(v, dict) for v in fixed.values()):
            return "\"fixed_costs\" is not {device name: {field: seconds}}"
        for name, entry in fixed.items():
            try:
                from_json(entry, "profile")
            except ValueError as exc:
                return f"fixed_costs of {name}: {exc}"
    link = data.get("link")
    if link is not None:
        try:
            assert float(link["bandwidth_Bps"]) > 0 and float(link["latency_s"]) >= 0
            assert len(link["devices"]) == 2 and isinstance(link["backend"], str)
        except (AssertionError, KeyError, TypeError, ValueError):
            return "\"link\" needs backend, devices, latency_s >= 0 and bandwidth_Bps > 0"
    return None


def _call_names(graph: AnnotatedGraph) -> list[str]:
    return [n.meta[META_NAME] for n in graph.gm.graph.nodes if n.op in TIMED_OPS]


def check_model(profile: Profile, model: Any) -> None:
    """Raise when `profile` is stale or foreign for `model` (a driver Analysis or a costed
    graph): for a .py model file, the file's sha256 and the model arguments must be the
    profiled ones; for an in-memory model (or an ONNX file), the timed node names must be
    the graph's call nodes."""
    spec = None if isinstance(model, AnnotatedGraph) else model.spec
    graph: AnnotatedGraph = model if isinstance(model, AnnotatedGraph) else model.graph
    prof = profile.data["model"]
    if spec is not None and getattr(spec, "path", None) is not None:
        name = Path(spec.path).name
        sha = file_sha256(spec.path)
        if sha != prof.get("sha256"):
            raise PipeccError(f"profile {profile.source} is stale or foreign: it timed "
                              f"{Path(str(prof.get('path', '?'))).name} with sha256 "
                              f"{str(prof.get('sha256'))[:12]}, but {name} now hashes to "
                              f"{sha[:12]}; profile it again with "
                              f"`pipecc profile {spec.path} ...`")
        args = json.loads(json.dumps(dict(spec.model_args), default=repr))
        if args != prof.get("args", {}):
            raise PipeccError(f"profile {profile.source} timed {name} with model arguments "
                              f"{_args(prof.get('args', {}))}, not {_args(args)}; profile it "
                              "with the same --model-arg values")
        return
    timed = {n["name"] for n in profile.data["targets"][0]["nodes"]}
    have = _call_names(graph)
    extra, missing = sorted(timed - set(have)), [n for n in have if n not in timed]
    if extra or missing:
        what = (f"it timed node {extra[0]!r}, which the model lacks" if extra else
                f"the model has node {missing[0]!r}, which it did not time")
        raise PipeccError(f"profile {profile.source} is stale or foreign for "
                          f"{graph.model_name}: {what} ({len(extra)} timed nodes not in the "
                          f"model, {len(missing)} model nodes not timed)")


def _args(args: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + "}" if args else "none"


def check_devices(profile: Profile, cluster: Cluster) -> None:
    """Raise when the profile timed none of the cluster's devices."""
    if any(profile.target_for(d) for d in cluster.devices):
        return
    timed = sorted({f"{d} ({t.get('torch_device', '?')})" for t in profile.data["targets"]
                    for d in t["devices"]})
    given = sorted({f"{d.name} ({d.kind})" for d in cluster.devices})
    raise PipeccError(f"profile {profile.source} timed {', '.join(timed)}, none of --devices "
                      f"{', '.join(given)}; profile on these devices or leave out --profile")


def measured_links(cluster: Cluster, profile: Profile) -> Cluster:
    """`cluster` with the profile's measured link between every two covered devices whose
    torch device types are the ones the link was measured between (NOTE: the hook through
    which the profile's link reaches the planner: `passes.plan_problem.problem` reads `Cluster.link`)."""
    link = profile.measured_link()
    if link is None:
        return cluster
    pair = sorted(str(d).split(":")[0] for d in profile.data["link"]["devices"])

    def kind(d: Device) -> str | None:
        if profile.target_for(d) is None:
            return None
        return (d.placement or ("cuda" if d.kind == "gpu" else "cpu")).split(":")[0]
    kinds = [kind(d) for d in cluster.devices]
    links = [[link if i != j and None not in (kinds[i], kinds[j])
              and sorted((kinds[i], kinds[j])) == pair else cluster.links[i][j]
              for j in range(len(kinds))] for i in range(len(kinds))]
    return dataclasses.replace(cluster, links=tuple(tuple(row) for row in links))


def use_profile(profile: Any, model: Any, cluster: Cluster) -> tuple[Profile, Cluster]:
    """The driver's step: the profile loaded and checked against the model and the devices,
    and the cluster with its measured links. Raises PipeccError before anything is planned."""
    loaded = load_profile(profile)
    check_model(loaded, model)
    check_devices(loaded, cluster)
    return loaded, measured_links(cluster, loaded)


# ----------------------------------------------------------------------------- costs
class ProfiledCosts(DeviceCosts):
    """A device the profile timed (`target`): measured curves per node, the roofline model
    `roofline` for nodes without one and for memory (module docstring)."""

    def __init__(self, roofline: RooflineCosts, graph: AnnotatedGraph,
                 groups: Sequence[Sequence[fx.Node]], profile: Profile,
                 target: Mapping[str, Any]) -> None:
        super().__init__(roofline.device)
        self.roofline, self.graph, self.groups = roofline, graph, groups
        self.profile, self.target = profile, target
        fits = {n["name"]: (AffineFit(n["fit"]["fwd"]["a"], n["fit"]["fwd"]["c"], 0.0),
                            AffineFit(n["fit"]["bwd"]["a"], n["fit"]["bwd"]["c"], 0.0))
                for n in target["nodes"]}
        work = [n for g in groups for n in g if n.op != "get_attr"]
        self.curves: dict[str, tuple[AffineFit, AffineFit, float]] = {
            n.meta[META_NAME]: (*fits[n.meta[META_NAME]], 1.0)
            for n in work if n.meta[META_NAME] in fits}
        self.scaled = self._shard_curves(work, fits)
        self.curves.update(self.scaled)
        self.work = [n.meta[META_NAME] for n in work]
        self._node_roofline: dict[tuple[str, int], tuple[float, float]] = {}

    def _shard_curves(self, work: list[fx.Node], fits: Mapping[str, tuple[AffineFit, AffineFit]]
                      ) -> dict[str, tuple[AffineFit, AffineFit, float]]:
        """A split layer's shards: the layer's curve times the shard's share of the forward
        FLOPs of all its shards (at the example point; a shard's FLOPs scale with B alike)."""
        shards: dict[str, list[fx.Node]] = {}
        for n in work:
            m = _SHARD.match(n.meta[META_NAME])
            if m and m["layer"] in fits and n.meta[META_NAME] not in fits:
                shards.setdefault(m["layer"], []).append(n)
        out = {}
        for layer, nodes in shards.items():
            flops = [float((n.meta[META_COST].values or {}).get("forward_flops", 0)) for n in nodes]
            total = sum(flops)
            for n, f in zip(nodes, flops):
                out[n.meta[META_NAME]] = (*fits[layer], f / total if total > 0 else 1 / len(nodes))
        return out

    def unit_times(self, units: UnitNumbers, mb: int) -> tuple[np.ndarray, np.ndarray]:
        """Per unit the sum over its nodes of a + c·mb (scaled for shards), the roofline of
        the nodes without a curve; units without any curve keep the roofline's unit time."""
        fwd, bwd = self.roofline.unit_times(units, mb)
        assert len(fwd) == len(self.groups), "units from another grouping of the graph"
        training = self.roofline.training
        for u, group in enumerate(self.groups):
            work = [n for n in group if n.op != "get_attr"]
            if not any(n.meta[META_NAME] in self.curves for n in work):
                continue
            f = b = 0.0
            for n in work:
                curve = self.curves.get(n.meta[META_NAME])
                if curve is None:
                    nf, nb = self.node_roofline(n, mb)
                else:
                    nf, nb = curve[2] * curve[0](mb), curve[2] * curve[1](mb)
                f, b = f + nf, b + (nb if training else 0.0)
            fwd[u], bwd[u] = f, b
        return fwd, bwd

    def weight_share(self, units: UnitNumbers, mb: int) -> np.ndarray:
        """Per unit, the weight-gradient share of its backward seconds. NOTE: the profile
        times each node's backward as a whole (input and weight gradients together), so a
        node's measured backward is split by the cost model's FLOP fraction
        (`backward_weight_flops / backward_flops`, `pipecc.cost`), then summed over the unit;
        units without any curve keep the roofline's share."""
        share = self.roofline.weight_share(units, mb)
        for u, group in enumerate(self.groups):
            work = [n for n in group if n.op != "get_attr"]
            if not any(n.meta[META_NAME] in self.curves for n in work):
                continue
            total = weight = 0.0
            for n in work:
                curve = self.curves.get(n.meta[META_NAME])
                nb = self.node_roofline(n, mb)[1] if curve is None else curve[2] * curve[1](mb)
                values = n.meta[META_COST].values or {}
                whole = float(values.get("backward_flops", 0))
                part = float(values.get("backward_weight_flops", 0))
                total += nb
                weight += nb * min(part / whole, 1.0) if whole > 0 else 0.0
            share[u] = weight / total if total > 0 else 0.0
        return share

    def node_roofline(self, node: fx.Node, mb: int) -> tuple[float, float]:
        """The roofline forward and backward seconds of one node at micro-batch size mb."""
        key = (node.meta[META_NAME], mb)
        if key not in self._node_roofline:
            point = dict(self.graph.point)
            if "B" in self.graph.symbols:
                point[self.graph.symbols["B"]] = mb
            cost = node.meta[META_COST]

            def at(name: str) -> float:
                return float(sympy.sympify(getattr(cost, name)).subs(point))
            dev, dtype = self.device, self.roofline.dtype
            f = dev.compute_time(at("forward_flops"), at("forward_flops_matmul"),
                                 at("bytes_moved"), dtype)
            b = dev.compute_time(at("backward_flops"), at("backward_flops_matmul"),
                                 2 * at("bytes_moved"), dtype)
            self._node_roofline[key] = (f, b)
        return self._node_roofline[key]

    def memory(self, units: UnitNumbers, stages_per_device: int) -> StageMemory:
        return self.roofline.memory(units, stages_per_device)

    def source(self, names: Sequence[str]) -> str:
        """"profile", "roofline" or "mixed": whether the nodes `names` have curves."""
        work = set(self.work)
        nodes = [n for n in names if n in work]
        timed = sum(1 for n in nodes if n in self.curves)
        return "profile" if nodes and timed == len(nodes) else "roofline" if not timed else "mixed"

    def plan_options(self) -> dict[str, Any]:
        return {"profile": self.profile.source}


def time_source(costs: DeviceCosts, names: Sequence[str]) -> str:
    """Where a stage's time came from: its device's cost model, and for a profiled device
    whether every node of the stage had a measured curve."""
    costs = getattr(costs, "base", costs)  # NOTE: under --calibrate's wrapper (targets.calibrated)
    if isinstance(costs, ProfiledCosts):
        return costs.source(names)
    return "fpga-model" if isinstance(costs, FpgaCosts) else "roofline"


def profile_decisions(costs: Sequence[DeviceCosts], cluster: Cluster, mb: int) -> list[str]:
    """The plan's lines on measured costs: per profiled device type how many nodes had a
    curve, whether the micro-batch size extrapolates the curves, and the measured links."""
    out: list[str] = []
    seen: list[ProfiledCosts] = []
    for c in (getattr(c, "base", c) for c in costs):  # NOTE: unwraps --calibrate's CalibratedCosts
        if not isinstance(c, ProfiledCosts) or any(c is s for s in seen):
            continue
        seen.append(c)
        n, total = sum(1 for w in c.work if w in c.curves), len(c.work)
        scaled = f"; {len(c.scaled)} split-layer shards scaled from their layer's curve" \
            if c.scaled else ""
        where = f"{c.device.name} ({c.profile.source}{scaled})"
        line = (f"costs: measured for all {total} nodes on {where}" if n == total else
                f"costs: measured for {n} of {total} nodes on {where}, roofline elsewhere")
        if c.roofline.dtype in ("bf16", "fp16"):  # NOTE: `pipecc profile` times float32 nodes
            line += f"; the curves are float32 times, used as they are for this {c.roofline.dtype} plan"
        low, high = c.profile.microbatch_range
        if not low <= mb <= high:
            line += (f"; micro-batches of {mb} extrapolate the curves beyond the profiled sizes "
                     f"({low}..{high})")
        out.append(line)
    measured = {(i, j) for i, row in enumerate(cluster.links) for j, link in enumerate(row)
                if link is not None and link.name.startswith("measured ")}
    if measured and seen:
        link = cluster.links[min(measured)[0]][min(measured)[1]]
        assert link is not None
        out.append(f"links: measured {link.name.removeprefix('measured ')} between "
                   f"{len(measured) // 2} device pair(s) ({link.latency * 1e6:.3g} us latency, "
                   f"{link.bandwidth / 1e9:.3g} GB/s; {seen[0].profile.source})")
    return out
