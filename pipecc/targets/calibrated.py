"""In-situ calibration (issue #20, item 3): `pipecc plan/compile --calibrate RUN.json` plans with
the stage times a run of an earlier plan measured on this machine.

    load_run             RUN.json read and checked: a `pipecc run OUT --json` document whose
                         `plan` names the plan that ran (`pipecc.runtime.timing.plan_identity`)
    Calibration          per device name and node: a forward and a backward factor
    use_calibration      the driver's step: load ─► same model ─► same devices ─► factors;
                         one-line PipeccErrors, raised before anything is planned or written
    CalibratedCosts      a device's cost model (`DeviceCosts`) with each unit's variable time
                         times its nodes' factor
    calibration_decisions  the plan's decision line: calibrated from RUN.json, the factors' range

The mapping. Stage s of the run held nodes N_s on device d; it was predicted to take P (forward,
per micro-batch) of which F is fixed (plan.json's `fixed_forward_s`, 0.0 where absent) and
measured M. Every node of N_s gets the factor r = (M − F) / (P − F) on device d: the variable
part of a stage scales, its fixed part (per micro-batch, per call: the cost model's) does not.
Backward alike, on the stage's `backward_nodes` where it has them (Bi-Partition), with a
zero-bubble run's I + W divided by `SPLIT_BACKWARD_COST` (the plan's backward is unsplit). The
replicas of a stage give the median of their rows. A plan that was itself calibrated (its
plan.json records the factors it used, `options.calibration`) composes: the new factor is the old
one times r, so the calibrated prediction of the very plan that ran equals its measured times,
and a second round from that plan's run moves the factors by the remaining misprediction only.

Mapping is by node name, not by cuts: a run of another plan of the same model on the same devices
is fine (the calibrated plan's cuts move; round two calibrates with round one's run). A layer the
run's plan split (`fc.shard0`, ..., `fc.combine`) maps to its split nodes' mean, and a split node
the run lacks to its layer's factor. Nodes the run
does not cover (a split layer's helpers) take their device's median factor: the same machine's
misprediction, not none at all. A unit's factor is the mean of its covered nodes' factors (within
one stage of the run they are equal, so a plan with the run's cuts is reproduced exactly).

The fixed part. Where a stage measures less than, or barely more than, its fixed part (its
variable ratio under `LOW_RATIO`), the cost model's fixed costs are too large for this machine,
and no node factor could lower them. Then the device's fixed part scales too: by
g = min(M / P) over such stages of the device (forward and backward apart), so each stage's
ratio becomes r = (M − g·F) / (P − F) (r = g at the stage that set it: the stage scales
uniformly). `Calibration.fixed_factor(device)` is g; the one cost model (`CostTables.unit_fixed`,
`stage_fixed`) multiplies the device's per-call and per-micro-batch fixed costs by it, and a
calibrated plan's own g composes like the node factors. Node factors are clamped to [1e-6, 1e6]
as a last guard. FPGA devices keep their model: their stages are simulated, not timed. Factors
hold at the run's micro-batch size; a plan with another one extrapolates them.

The host part. The stage timers cover a stage's own forward and backward only, while the step
also holds host work between them (posting sends, the engine's loop): the run document's
`host_s` per row, the rank's step less its timed actions and receive waits, per micro-batch.
`Calibration.host_s(device)` is the median of the device's rows less the plan's `step_s` per
micro-batch (the model holds the optimizer step apart); the one cost model adds it to every
stage's per-micro-batch fixed costs on the device (`CostTables.stage_host`; not on an FPGA card,
whose rank emulates it), so the search and the simulator see the rank busy for it, and
plan.json records it per stage (`host_forward_s`, `host_backward_s`). It is measured, not composed: each round's run measures it again. Where the
run's plan held a host part, the timers' M is compared with P and F less it.
`Calibration.stage_errors` keeps each stage's whole measured/predicted ratio M / P: how far the
plan that ran was off (the decision line and the convergence check read it).

Refused, one line each, before anything is planned: a file that is not JSON or not a run
document, a run document without `plan` (made before calibration existed), a stage with zero or
negative measured times, a run with other micro-batches than its plan, a run of another model
(the model file's sha256 and arguments, else its node names), on another device set, or of a plan
costed on another basis (the roofline vs a profile, or a profile of another file name: the
factors are relative to the predictions of the model that planned the run).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from pipecc.errors import PipeccError
from pipecc.ir.schedule.registry import SPLIT_BACKWARD_COST, ZERO_BUBBLE
from pipecc.targets.timing import CANNOT_RUN_S, DeviceCosts, StageMemory, UnitNumbers

__all__ = ["Calibration", "CalibratedCosts", "load_run", "use_calibration", "calibration_decisions"]

RUN_FORMAT = "pipecc-run"
FACTOR_RANGE = (1e-6, 1e6)
LOW_RATIO = 0.1  # a variable ratio under this: the fixed part is too large (module docstring)
# a split layer's nodes (`passes.split_layers`): fc.shard0, fc.shard0.in/.weight/.bias, fc.combine(.k)
_SHARD = re.compile(r"^(?P<layer>.+)\.(shard\d+(\.(in|weight|bias))?|combine(\.\d+)?)$")
MAKE = "make one with `pipecc compile MODEL ... -o OUT` then `pipecc run OUT --json > RUN.json`"


@dataclass
class Calibration:
    """Factors from one run (module docstring): `factors[device][node] = (forward, backward)`,
    `default[device]` for nodes the run does not cover."""

    source: str                      # the file's name
    run: dict[str, Any]              # the run document
    factors: dict[str, dict[str, tuple[float, float]]] = field(default_factory=dict)
    default: dict[str, tuple[float, float]] = field(default_factory=dict)
    fixed: dict[str, tuple[float, float]] = field(default_factory=dict)  # device: fixed-part factors
    host: dict[str, float] = field(default_factory=dict)  # device: host seconds per micro-batch
    stage_ratios: list[tuple[int, str, float, float]] = field(default_factory=list)  # (stage, device, r_f, r_b)
    stage_errors: list[tuple[int, str, float, float]] = field(default_factory=list)  # (stage, device, M/P f, b)
    notes: list[str] = field(default_factory=list)

    def factor(self, device: str, node: str) -> tuple[float, float] | None:
        """The node's factors on `device`; None when the run did not cover it."""
        table = self.factors.get(device, {})
        return table.get(node) or table.get(_layer(node) or "")

    def fixed_factor(self, device: str) -> tuple[float, float]:
        """The forward and backward factors of `device`'s fixed part (module docstring); (1, 1)
        where the run measured every stage of it above its fixed part."""
        return self.fixed.get(device, (1.0, 1.0))

    def host_s(self, device: str) -> float:
        """Seconds of host work per micro-batch and stage on `device` outside the stage timers
        (module docstring: the host part); 0.0 where the run did not measure it."""
        return self.host.get(device, 0.0)

    def to_json(self) -> dict[str, Any]:
        """plan.json's `options.calibration`: read back when a run of this plan calibrates again."""
        return {"source": self.source, "run_plan_sha256": (self.run.get("plan") or {}).get("sha256"),
                "factors": {d: {n: [round(f, 6), round(b, 6)] for n, (f, b) in t.items()}
                            for d, t in self.factors.items()},
                "default": {d: [round(f, 6), round(b, 6)] for d, (f, b) in self.default.items()},
                "fixed": {d: [round(f, 6), round(b, 6)] for d, (f, b) in self.fixed.items()},
                "host": {d: h for d, h in self.host.items()}}


def _layer(node: str) -> str | None:
    m = _SHARD.match(node)
    return m["layer"] if m else None


# ----------------------------------------------------------------------------- reading
def load_run(run: str | Path | Mapping[str, Any] | Calibration) -> Calibration:
    """RUN.json (or its document) checked and turned into factors; PipeccError naming the file
    and the problem otherwise (module docstring)."""
    if isinstance(run, Calibration):
        return run
    if isinstance(run, Mapping):
        data: Any = dict(run)
        where = "run document"
    else:
        where = str(run)
        try:
            text = Path(run).read_text(encoding="utf-8")
        except OSError as exc:
            raise PipeccError(f"cannot read --calibrate {where}: {exc.strerror or exc}") from None
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            raise PipeccError(f"--calibrate {where} is not JSON ({exc}); {MAKE}") from None
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        raise PipeccError(f"--calibrate {where} is not a `pipecc run --json` document (no \"format\": "
                          f"\"{RUN_FORMAT}\"); {MAKE}")
    plan = data.get("plan")
    if not isinstance(plan, dict) or not isinstance(plan.get("stages"), list):
        raise PipeccError(f"--calibrate {where} does not say which plan ran (no \"plan\"; a run from "
                          "before calibration, or of a folder without plan.json); run the folder again "
                          "with `pipecc run OUT --json`")
    if data.get("memory_source") == "live-tensors":  # pipecc.runtime.memory: its count slows every op
        raise PipeccError(f"--calibrate {where} was measured with --memory on a CPU, whose count of live tensor "
                          "bytes makes every op slower; calibrate with a run without it (`pipecc run OUT --json`)")
    name = Path(where).name if where != "run document" else where
    cal = Calibration(name, data)
    _factors(cal, where)
    return cal


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _ratio(measured: float, predicted: float, fixed: float, g: float = 1.0) -> float:
    """(measured − g·fixed) / (predicted − fixed), clamped; 1.0 when nothing variable was predicted."""
    variable = predicted - fixed
    if variable <= 0:
        return 1.0
    low, high = FACTOR_RANGE
    return min(max((measured - g * fixed) / variable, low), high)


def _fixed_factor(stages: Sequence[tuple[float, float, float]]) -> float:
    """g of one device and direction from its stages' (measured, predicted, fixed): the least
    M / P of the stages whose variable ratio is under LOW_RATIO, 1.0 where there is none
    (module docstring: the fixed part)."""
    low = [m / p for m, p, f in stages if p > 0 and f > 0 and m < f + LOW_RATIO * (p - f)]
    return min([1.0, *low])


def _factors(cal: Calibration, where: str) -> None:
    """Fill `cal` from its run document (module docstring: the mapping)."""
    data, plan = cal.run, cal.run["plan"]
    rows = data.get("stages")
    if not isinstance(rows, list) or not rows:
        raise PipeccError(f"--calibrate {where} has no measured stages; {MAKE}")
    if plan.get("microbatches") not in (None, data.get("microbatches")):
        raise PipeccError(f"--calibrate {where} ran {data.get('microbatches')} micro-batches, its plan "
                          f"{plan.get('microbatches')}: its times are per micro-batch of another size; "
                          "run the folder with its own micro-batch count")
    planned = {st.get("index"): st for st in plan["stages"] if isinstance(st, dict)}
    split = SPLIT_BACKWARD_COST if data.get("schedule") in ZERO_BUBBLE else 1.0
    old = (plan.get("calibration") or {}) if isinstance(plan.get("calibration"), dict) else {}
    old_factors, old_default = old.get("factors") or {}, old.get("default") or {}
    groups: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("index") not in planned:
            raise PipeccError(f"--calibrate {where}: a measured stage "
                              f"{row.get('index') if isinstance(row, dict) else row!r} is not in its plan; {MAKE}")
        trained = isinstance(row.get("backward_samples"), int) and row["backward_samples"] > 0
        for key in ("forward_s", *(("backward_s",) if trained else ())):
            if not _positive(row.get(key)):
                raise PipeccError(f"--calibrate {where}: stage {row['index']} has {key} {row.get(key)!r}; "
                                  "calibration needs positive measured times (run with more --steps)")
        groups.setdefault((row["index"], str(row.get("device", ""))), []).append(row)
    forward_only = all(not r.get("backward_samples") for r in rows)
    if forward_only:
        cal.notes.append("a forward-only run: backward factors are the forward ones")
    measured = []  # (index, device, stage, (M, P, F) forward, (M, P, F) backward or None)
    for (index, device), group in sorted(groups.items()):
        st = planned[index]
        h_f, h_b = float(st.get("host_forward_s") or 0.0), float(st.get("host_backward_s") or 0.0)
        # NOTE: the timers do not cover the plan's host part: compared without it
        fwd = (statistics.median(float(r["forward_s"]) for r in group), float(st.get("forward_s") or 0.0) - h_f,
               float(st.get("fixed_forward_s") or 0.0) - h_f)
        bwd = None if forward_only else (statistics.median(float(r["backward_s"]) for r in group) / split,
                                         float(st.get("backward_s") or 0.0) - h_b,
                                         float(st.get("fixed_backward_s") or 0.0) - h_b)
        measured.append((index, device, st, fwd, bwd))
    old_fixed = old.get("fixed") or {}
    for device in dict.fromkeys(m[1] for m in measured):
        mine = [m for m in measured if m[1] == device]
        g_f = _fixed_factor([m[3] for m in mine])
        g_b = g_f if forward_only else _fixed_factor([m[4] for m in mine])
        if (g_f, g_b) != (1.0, 1.0) or device in old_fixed:
            was_f, was_b = _old_factor({}, old_fixed.get(device, [1.0, 1.0]), "the fixed part", where)
            cal.fixed[device] = (was_f * g_f, was_b * g_b)
            if (g_f, g_b) != (1.0, 1.0):
                cal.notes.append(f"{device} measured under its fixed part: fixed costs x{g_f:.3g}/{g_b:.3g}")
        for index, _, st, fwd, bwd in mine:
            r_f = _ratio(*fwd, g_f)
            r_b = r_f if bwd is None else _ratio(*bwd, g_b)
            cal.stage_ratios.append((index, device, r_f, r_b))
            e_f = fwd[0] / fwd[1] if fwd[1] > 0 else 1.0
            e_b = e_f if bwd is None else (bwd[0] / bwd[1] if bwd[1] > 0 else 1.0)
            cal.stage_errors.append((index, device, e_f, e_b))
            _node_factors(cal, st, device, r_f, r_b, old_factors, old_default, where)
    cal.stage_ratios.sort()
    _host(cal, rows, planned)
    cal.stage_errors.sort()
    for device, table in cal.factors.items():
        for node in list(table):  # a split layer's shards speak for the layer
            layer = _layer(node)
            if layer and layer not in table:
                shards = [v for k, v in table.items() if _layer(k) == layer]
                table[layer] = (statistics.fmean(v[0] for v in shards), statistics.fmean(v[1] for v in shards))
        values = list(table.values())
        cal.default[device] = (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)) \
            if values else (1.0, 1.0)


def _host(cal: Calibration, rows: Sequence[Mapping[str, Any]], planned: Mapping[Any, Any]) -> None:
    """cal.host: per device, the median over its rows of the measured `host_s` less the plan's
    per-iteration `step_s` spread over the micro-batches (the cost model holds that part);
    nothing where the run document has no `host_s` (module docstring: the host part)."""
    m = cal.run.get("microbatches")
    per: dict[str, list[float]] = {}
    for row in rows:
        if "host_s" not in row:  # a run document from before host_s
            continue
        h = row["host_s"]
        if not (_positive(h) or h == 0):
            raise PipeccError(f"--calibrate {cal.source}: stage {row['index']} has host_s {h!r}, not a "
                              f"non-negative number; {MAKE}")
        step = float(planned[row["index"]].get("step_s") or 0.0)
        per.setdefault(str(row.get("device", "")), []).append(
            max(0.0, h - step / m) if isinstance(m, int) and m > 0 else h)
    cal.host = {d: statistics.median(v) for d, v in per.items()}
    cal.notes += [f"{d}: {1e6 * h:.0f} us of host work per micro-batch outside the stage timers"
                  for d, h in cal.host.items()]


def _node_factors(cal: Calibration, st: Mapping[str, Any], device: str, r_f: float, r_b: float,
                  old_factors: Mapping[str, Any], old_default: Mapping[str, Any], where: str) -> None:
    """Stage `st`'s nodes on `device` get the ratios r_f / r_b times the factors its plan was made
    with (module docstring: composition)."""
    table = cal.factors.setdefault(device, {})
    was, base = old_factors.get(device, {}), old_default.get(device, [1.0, 1.0])
    forward_nodes = st.get("nodes") or []
    backward_nodes = set(st.get("backward_nodes") or forward_nodes)
    for node in dict.fromkeys([*forward_nodes, *backward_nodes]):
        before = _old_factor(was, base, node, where)
        f, b = table.get(node, before)
        if node in forward_nodes:
            f = before[0] * r_f
        if node in backward_nodes:
            b = before[1] * r_b
        table[node] = (f, b)


def _old_factor(was: Mapping[str, Any], base: Any, node: str, where: str) -> tuple[float, float]:
    """The factors the run's plan was made with for `node` (its layer's for a split node, else the
    device's default); PipeccError when the run's `plan.calibration` is not numbers."""
    value = was.get(node) or was.get(_layer(node) or "") or base
    try:
        f, b = (float(v) for v in value)
    except (TypeError, ValueError):
        raise PipeccError(f"--calibrate {where}: its plan's calibration factors for {node!r} are {value!r}, "
                          f"not two numbers; {MAKE}") from None
    if not (_positive(f) and _positive(b)):
        raise PipeccError(f"--calibrate {where}: its plan's calibration factors for {node!r} are {value!r}, "
                          f"not positive; {MAKE}")
    return f, b


# ----------------------------------------------------------------------------- checks
def check_devices(cal: Calibration, cluster: Any) -> None:
    """Raise when the run's plan ran on another device set (names, order aside: --choose-order)."""
    ran = [str(d) for d in cal.run["plan"].get("devices") or []]
    given = [d.name for d in cluster.devices]
    if sorted(ran) != sorted(given):
        raise PipeccError(f"--calibrate {cal.source} ran on devices {', '.join(ran) or 'none'}, not --devices "
                          f"{', '.join(given)}: calibrate with a run on the same devices")


def check_model_file(cal: Calibration, path: str | Path, model_args: Mapping[str, Any]) -> None:
    """Raise when the run's model file (sha256) or model arguments are not these."""
    from pipecc.profile.cache import file_sha256
    plan = cal.run["plan"]
    sha = plan.get("model_sha256")
    mine = file_sha256(path)
    if sha is not None and sha != mine:
        raise PipeccError(f"--calibrate {cal.source} is a run of {plan.get('model')} with sha256 {str(sha)[:12]}, "
                          f"not of {Path(path).name} (sha256 {mine[:12]}): calibrate with a run of this model")
    args = json.loads(json.dumps(dict(model_args), default=repr))
    ran = plan.get("model_args") or {}
    if sha is not None and args != ran:
        raise PipeccError(f"--calibrate {cal.source} ran {plan.get('model')} with model arguments {_args(ran)}, "
                          f"not {_args(args)}: calibrate with a run of the same --model-arg values")


def _args(args: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + "}" if args else "none"


def check_nodes(cal: Calibration, names: Sequence[str], model: str) -> None:
    """Raise when the run's plan has a node the graph lacks (a split layer's shard counts as its
    layer): a run of another model."""
    have = set(names)
    for st in cal.run["plan"]["stages"]:
        for node in [*(st.get("nodes") or []), *(st.get("backward_nodes") or [])]:
            if node not in have and (_layer(node) or "") not in have:
                raise PipeccError(f"--calibrate {cal.source} ran node {node!r}, which {model} lacks: it is a run "
                                  "of another model; calibrate with a run of this model")


def check_basis(cal: Calibration, profile: Any) -> None:
    """Raise when the run's plan was costed on another basis than this plan (the roofline, or a
    profile of another name): its factors are relative to that model's predictions."""
    ran = cal.run["plan"].get("profile")
    mine = getattr(profile, "source", None) if profile is not None else None
    if ran != mine:
        what = lambda p: f"profile {p}" if p else "the roofline (no --profile)"  # noqa: E731
        raise PipeccError(f"--calibrate {cal.source} ran a plan costed with {what(ran)}, not with {what(mine)}: "
                          "its factors are relative to that cost model; plan with the same --profile (or none)")


def use_calibration(run: Any, model: Any, cluster: Any, profile: Any = None) -> Calibration:
    """The driver's step: the run loaded and checked against the model (a driver Analysis or a
    costed graph), the devices and the cost basis (`profile`, loaded, or None). Raises
    PipeccError before anything is planned."""
    from pipecc.ir.graph import META_NAME, AnnotatedGraph
    cal = load_run(run)
    check_devices(cal, cluster)
    check_basis(cal, profile)
    spec = None if isinstance(model, AnnotatedGraph) else model.spec
    graph = model if isinstance(model, AnnotatedGraph) else model.graph
    if spec is not None and getattr(spec, "path", None) is not None:
        check_model_file(cal, spec.path, spec.model_args)
    check_nodes(cal, [n.meta[META_NAME] for n in graph.gm.graph.nodes if META_NAME in n.meta],
                graph.model_name)
    return cal


# ----------------------------------------------------------------------------- costs
class CalibratedCosts(DeviceCosts):
    """`base` (a device's cost model) with each unit's variable time scaled by the mean factor
    of its covered nodes (module docstring). A base whose unit times include fixed parts says so
    with `fixed_unit_times(units, mb) -> (fwd, bwd)`: those are added unscaled."""

    def __init__(self, base: DeviceCosts, calibration: Calibration) -> None:
        super().__init__(base.device)
        self.base, self.calibration = base, calibration
        self.one_tensor_boundaries = base.one_tensor_boundaries

    @property
    def curves(self) -> Mapping[str, Any]:
        """The base's measured nodes (`ProfiledCosts.curves`; none on the roofline): the cost
        model adds no per-call fixed cost to those, calibrated or not."""
        return getattr(self.base, "curves", {})

    def unit_factors(self, names: Sequence[Sequence[str]]) -> tuple[np.ndarray, np.ndarray]:
        """[unit] forward and backward factors."""
        default = self.calibration.default.get(self.device.name, (1.0, 1.0))
        fwd, bwd = np.full(len(names), default[0]), np.full(len(names), default[1])
        for u, unit in enumerate(names):
            got = [f for f in (self.calibration.factor(self.device.name, n) for n in unit) if f is not None]
            if got:  # NOTE: else the device's median (module docstring)
                fwd[u], bwd[u] = statistics.fmean(g[0] for g in got), statistics.fmean(g[1] for g in got)
        return fwd, bwd

    def unit_times(self, units: UnitNumbers, mb: int) -> tuple[np.ndarray, np.ndarray]:
        fwd, bwd = self.base.unit_times(units, mb)
        fixed = getattr(self.base, "fixed_unit_times", None)
        fix_f, fix_b = fixed(units, mb) if fixed is not None else (np.zeros_like(fwd), np.zeros_like(bwd))
        f_f, f_b = self.unit_factors(units.names)  # type: ignore[attr-defined]
        runnable = fwd < CANNOT_RUN_S
        out_f = np.where(runnable, fix_f + (fwd - fix_f) * f_f, fwd)
        out_b = np.where(runnable & (bwd < CANNOT_RUN_S), fix_b + (bwd - fix_b) * f_b, bwd)
        return out_f, out_b

    def memory(self, units: UnitNumbers, stages_per_device: int) -> StageMemory:
        return self.base.memory(units, stages_per_device)

    def weight_share(self, units: UnitNumbers, mb: int) -> np.ndarray:
        return self.base.weight_share(units, mb)

    def floor_times(self, mb: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.base.floor_times(mb)

    def stage_times(self, units: range, fwd: np.ndarray, mb: int) -> tuple[np.ndarray, np.ndarray] | None:
        return self.base.stage_times(units, fwd, mb)

    def unsupported_nodes(self) -> list[Any]:
        return self.base.unsupported_nodes()

    def plan_options(self) -> dict[str, Any]:
        return {**self.base.plan_options(), "calibration": self.calibration.to_json()}


def calibration_decisions(costs: Sequence[DeviceCosts], mb: int | None = None) -> list[str]:
    """The plan's line on its calibration: the run, the stages' measured/predicted ratios and the
    range of the factors used, and whether the plan's micro-batches of `mb` samples extrapolate the
    run's; [] when not calibrated."""
    cal = next((c.calibration for c in costs if isinstance(c, CalibratedCosts)), None)
    if cal is None:
        return []
    used = [f for c in costs if isinstance(c, CalibratedCosts) for f in cal.factors.get(c.device.name, {}).values()]
    if not used:
        return []
    fwd, bwd = [f for f, _ in used], [b for _, b in used]
    ratios = ", ".join(f"{e_f:.3g}/{e_b:.3g}" for _, _, e_f, e_b in cal.stage_errors)
    plan_sha = str(cal.run["plan"].get("sha256") or "")[:12]
    line = (f"costs: calibrated from {cal.source} (a run of plan {plan_sha or '?'}; measured/predicted "
            f"forward/backward per stage {ratios}): forward factors {min(fwd):.3g}..{max(fwd):.3g}, backward "
            f"factors {min(bwd):.3g}..{max(bwd):.3g}; nodes the run did not cover take their device's median")
    notes = list(cal.notes)
    ran = str(cal.run.get("precision") or "fp32")  # NOTE: runs before the field was written: fp32
    base = next(c.base for c in costs if isinstance(c, CalibratedCosts))
    planned = getattr(getattr(base, "roofline", base), "dtype", "fp32")  # a profile's curves: its roofline's
    if planned in ("fp32", "bf16", "fp16") and planned != ran:
        notes.append(f"the run computed in {ran}, this plan in {planned}: its factors carry {ran}'s speed")
    batch, count = cal.run.get("batch_size"), cal.run.get("microbatches")
    if mb is not None and isinstance(batch, int) and isinstance(count, int) and count > 0 and batch // count != mb:
        notes.append(f"the run's micro-batches were of {batch // count} samples, this plan's of {mb}: the "
                     "factors extrapolate")
    return [line + "".join(f"; {n}" for n in notes)]
