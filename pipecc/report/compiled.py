"""`pipecc inspect OUT`: what a compile made, read back from the folder alone.

Compile time writes (through `write_output(..., extra_files=...)`):

    OUT/graph.json      graph_json(graph, plan): every node with op, kind, shapes, cost, stage,
                        where its inputs come from and where its outputs go
    OUT/timeline.json   timeline_json(timeline): the simulator's events for one iteration

Inspect reads those with `plan.json`, `pipecc.json` and each `stage_<i>/ports.json` (and an FPGA
stage's `estimates.json`); it never imports the model or the stage code. A folder compiled before
graph.json existed still inspects, without the per-node details.

Renderers: `summary_json` / `stage_json` (`--format json`; the keys listed there are stable),
`summary_text` / `stage_text` (the default), `dot_text` (`--format dot`, Graphviz).

Units: the plan's figures (FLOPs, seconds, traffic) are per micro-batch, as the planner saw
them; node costs are given both at the compile batch (like `pipecc cost`) and per micro-batch.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipecc.report.tables import human
from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan
from pipecc.report.text import _seconds

GRAPH_FORMAT = "pipecc-graph"
INSPECT_FORMAT = "pipecc-inspect"
FORMAT_VERSION = 1
MODEL_INPUT = -1  # the "stage" of model inputs, as in ports.json


# ----------------------------------------------------------------------------- compile time
def graph_json(graph: Any, plan: Plan) -> dict[str, Any]:
    """Per-node facts for OUT/graph.json, from the (possibly layer-split) graph the plan names.

    Node keys: name (human), id (fx name = tensor/port name in stage.py and ports.json), op,
    kind, stage (-1 model input, null for a parameter read), stages (for parameters: every
    stage that reads it), shapes, shapes_at (ints at the compile batch), forward_flops,
    backward_flops, param_bytes, output_bytes (compile batch), *_mb (one micro-batch),
    forward_flops_expr, inputs [{name, id, stage}], users [{name, id, stage}] (the model's
    output is {"name": "output", "id": "output", "stage": num_stages}), split_of (shards).
    """
    import sympy

    from pipecc.backends.torch.stages import normalise_stage_of
    from pipecc.ir.graph import META_COST, META_KIND, META_NAME, META_OP, META_VALUE, ScalarInfo, tensors_in

    placed = normalise_stage_of(graph, plan.stage_of())
    nodes = [n for n in graph.gm.graph.nodes if n.op != "output"]
    num_stages = len(plan.stages)
    mb = max(plan.batch_size // max(plan.microbatches, 1), 1)
    at_mb = dict(graph.point)
    if "B" in graph.symbols:
        at_mb[graph.symbols["B"]] = mb
    shard_of = {sh: sl.node for sl in plan.split_layers for sh in sl.shards}

    def stage(n: Any) -> int | None:
        if n.op == "output":
            return num_stages
        if n.op == "placeholder":
            return MODEL_INPUT
        return placed.get(n.meta[META_NAME])

    def ref(n: Any) -> dict[str, Any]:
        if n.op == "output":
            return {"name": "output", "id": "output", "stage": num_stages}
        return {"name": n.meta[META_NAME], "id": n.name, "stage": stage(n)}

    def number(expr: Any, point: dict) -> int:
        return int(sympy.sympify(expr).subs(point)) if not isinstance(expr, int) else expr

    out = []
    for n in nodes:
        cost = n.meta.get(META_COST)
        value = n.meta.get(META_VALUE)
        tensors = list(tensors_in(value))
        if isinstance(value, ScalarInfo):
            shapes = ["scalar" if value.value is None else f"scalar({value.value})"]
        else:
            shapes = [t.describe() for t in tensors]
        entry: dict[str, Any] = {
            "name": n.meta[META_NAME], "id": n.name, "op": n.meta.get(META_OP, n.op),
            "kind": n.meta.get(META_KIND, "?"), "stage": stage(n),
            "shapes": shapes,
            "shapes_at": [[number(d, graph.point) for d in t.shape] for t in tensors],
            "inputs": [ref(i) for i in n.all_input_nodes],
            "users": [ref(u) for u in n.users],
        }
        if n.op == "get_attr":
            entry["stage"] = None
            entry["stages"] = sorted({placed[u.meta[META_NAME]] for u in n.users
                                      if u.op != "output" and u.meta[META_NAME] in placed})
        for f in ("forward_flops", "backward_flops", "param_bytes", "output_bytes"):
            entry[f] = cost.value(f) if cost is not None else 0
        for f in ("forward_flops", "backward_flops", "output_bytes"):
            entry[f + "_mb"] = number(getattr(cost, f), at_mb) if cost is not None else 0
        entry["forward_flops_expr"] = str(cost.forward_flops) if cost is not None else "0"
        if entry["name"] in shard_of:
            entry["split_of"] = shard_of[entry["name"]]
        out.append(entry)
    return {"format": GRAPH_FORMAT, "version": FORMAT_VERSION, "model": graph.model_name,
            "batch_size": plan.batch_size, "microbatch_size": mb, "num_stages": num_stages,
            "symbols": {k: int(graph.point[s]) for k, s in graph.symbols.items()}, "nodes": out}


def timeline_json(timeline: Any) -> dict[str, Any]:
    """The simulator's Timeline as OUT/timeline.json: events (rank, kind, stage, microbatch,
    start, end, peer), iteration_s, bubble_fraction, busy_s and peak_memory_bytes per rank."""
    return {"num_ranks": timeline.num_ranks, "iteration_s": timeline.iteration_s,
            "bubble_fraction": timeline.bubble_fraction, "busy_s": list(timeline.busy_s),
            "peak_memory_bytes": list(timeline.peak_memory_bytes),
            "events": [{"rank": e.rank, "kind": e.kind.value, "stage": e.stage,
                        "microbatch": e.microbatch, "start": e.start, "end": e.end,
                        "peer": e.peer} for e in timeline.events]}


# ----------------------------------------------------------------------------- reading OUT
@dataclass
class Compiled:
    """A compiled folder, read back."""

    path: Path
    marker: dict[str, Any]
    plan: Plan
    ports: list[dict[str, Any]]
    graph: dict[str, Any] | None = None          # graph.json, when the compile wrote one
    timeline: dict[str, Any] | None = None       # timeline.json, likewise
    estimates: dict[int, dict[str, Any]] = field(default_factory=dict)  # FPGA stages

    def nodes_of(self, stage: int) -> list[dict[str, Any]]:
        return [n for n in (self.graph or {}).get("nodes", []) if n["stage"] == stage]


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise PipeccError(f"{path}: cannot read the {what} ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise PipeccError(f"{path}: the {what} is not valid JSON ({exc})") from None


def load_compiled(out: str | Path) -> Compiled:
    """Read OUT; a missing folder or one `pipecc compile` did not write is a PipeccError."""
    path = Path(out)
    if not path.exists():
        raise PipeccError(f"{path}: no such folder (compile one with `pipecc compile MODEL -o {path}`)")
    if not path.is_dir() or not (path / "pipecc.json").is_file():
        raise PipeccError(f"{path} is not a folder written by `pipecc compile` (no pipecc.json)")
    marker = _read_json(path / "pipecc.json", "compile marker")
    if not isinstance(marker, dict) or marker.get("format") != "pipecc-compile":
        raise PipeccError(f"{path}/pipecc.json is not a pipecc compile marker")
    try:
        plan = Plan.from_json(_read_json(path / "plan.json", "plan"))
    except (TypeError, KeyError) as exc:
        raise PipeccError(f"{path}/plan.json does not match this pipecc's plan format ({exc})") from None
    ports = [_read_json(path / f"stage_{i}" / "ports.json", "stage ports")
             if (path / f"stage_{i}" / "ports.json").is_file() else {}
             for i in range(len(plan.stages))]
    compiled = Compiled(path, marker, plan, ports)
    if (path / "graph.json").is_file():
        compiled.graph = _read_json(path / "graph.json", "graph")
    if (path / "timeline.json").is_file():
        compiled.timeline = _read_json(path / "timeline.json", "timeline")
    for i in range(len(plan.stages)):
        est = path / f"stage_{i}" / "estimates.json"
        if est.is_file():
            compiled.estimates[i] = _read_json(est, "FPGA estimates")
    return compiled


# ----------------------------------------------------------------------------- shared figures
def bottleneck_stage(plan: Plan) -> int:
    """The stage with the most fwd + bwd + comm per micro-batch (as `pipecc plan` marks it)."""
    return max(range(len(plan.stages)),
               key=lambda i: plan.stages[i].forward_s + plan.stages[i].backward_s + plan.stages[i].comm_s)


def device_capacities(plan: Plan, cluster: Any = None) -> list[float | None]:
    """Memory bytes of each plan device: from `cluster` if given, else the built-in catalog by
    name (None for a device the catalog does not know, e.g. one defined in a cluster file)."""
    if cluster is not None:
        return [float(cluster.devices[d.get("given_index", i)].memory_bytes)
                for i, d in enumerate(plan.devices)]
    from pipecc.targets.devices import load_catalog
    catalog = load_catalog()
    return [float(catalog.devices[d["name"]]["memory_bytes"]) if d.get("name") in catalog.devices
            else None for d in plan.devices]


def _split_shards(plan: Plan, stage: int) -> list[str]:
    """'lm_head 1/2' for every split layer with a shard in `stage`."""
    names = set(plan.stages[stage].nodes)
    return [f"{sl.node} {k + 1}/{sl.parts}" for sl in plan.split_layers
            for k, sh in enumerate(sl.shards) if sh in names]


def _table(headers: list[str], rows: list[list[str]], left: int = 2, right_from: int = 0) -> str:
    """A plain-text table: the first `left` columns and those from `right_from` on (when
    set) align left, the numbers between align right."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def is_left(i: int) -> bool:
        return i < left or (right_from > 0 and i >= right_from)

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if is_left(i) else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(headers), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _first_last(nodes: list[str]) -> tuple[str, str]:
    return (nodes[0], nodes[-1]) if nodes else ("-", "-")


# ----------------------------------------------------------------------------- JSON
def summary_json(c: Compiled) -> dict[str, Any]:
    """`pipecc inspect OUT --format json`. Stable keys: format, version, out, model, batch_size,
    microbatches, microbatch_size, schedule, virtual_stages, devices, stages[] (index, device,
    device_name, device_kind, first_node, last_node, num_nodes, forward_flops, param_bytes,
    forward_s, backward_s, comm_s, recv_bytes, send_bytes, peak_memory_bytes,
    memory_capacity_bytes, split_layers, receives, sends, bottleneck, fpga_estimates),
    bottleneck_stage, bottleneck_s, lower_bound_s, balance_ratio, predicted_iteration_s,
    bubble_fraction, split_layers, baselines, decisions, has_graph."""
    plan = c.plan
    worst = bottleneck_stage(plan)
    caps = device_capacities(plan)
    stages = []
    for s in plan.stages:
        dev = plan.devices[s.device] if s.device < len(plan.devices) else {}
        first, last = _first_last(s.nodes)
        ports = c.ports[s.index] if s.index < len(c.ports) else {}
        stages.append({
            "index": s.index, "device": s.device, "device_name": dev.get("name"),
            "device_kind": dev.get("kind"), "first_node": first, "last_node": last,
            "num_nodes": len(s.nodes), "forward_flops": s.forward_flops, "param_bytes": s.param_bytes,
            "forward_s": s.forward_s, "backward_s": s.backward_s, "comm_s": s.comm_s,
            "recv_bytes": s.recv_bytes, "send_bytes": s.send_bytes,
            "peak_memory_bytes": s.peak_memory_bytes,
            "memory_capacity_bytes": caps[s.device] if s.device < len(caps) else None,
            "split_layers": _split_shards(plan, s.index),
            "receives": [p["name"] for p in ports.get("receives", [])],
            "sends": [p["name"] for p in ports.get("sends", [])],
            "bottleneck": s.index == worst,
            "fpga_estimates": c.estimates.get(s.index)})
    return {"format": INSPECT_FORMAT, "version": FORMAT_VERSION, "out": str(c.path),
            "model": plan.model, "batch_size": plan.batch_size, "microbatches": plan.microbatches,
            "microbatch_size": plan.batch_size // max(plan.microbatches, 1),
            "schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
            "devices": plan.devices, "stages": stages, "bottleneck_stage": worst,
            "bottleneck_s": plan.bottleneck_s, "lower_bound_s": plan.lower_bound_s,
            "balance_ratio": plan.balance_ratio if math.isfinite(plan.balance_ratio) else None,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "bubble_fraction": plan.bubble_fraction,
            "split_layers": [vars(sl) for sl in plan.split_layers], "baselines": plan.baselines,
            "decisions": plan.decisions, "has_graph": c.graph is not None}


def _stage_index(c: Compiled, stage: int) -> int:
    n = len(c.plan.stages)
    if not 0 <= stage < n:
        raise PipeccError(f"--stage {stage}: {c.path} has stages 0..{n - 1}")
    return stage


def _port_facts(c: Compiled, stage: int) -> tuple[list[dict], list[dict]]:
    """This stage's receives and sends, each with bytes per micro-batch and where it goes."""
    ports = c.ports[stage] if stage < len(c.ports) else {}
    mb = c.plan.batch_size // max(c.plan.microbatches, 1)
    users: dict[str, list[int]] = {}
    for n in (c.graph or {}).get("nodes", []):
        users[n["id"]] = sorted({u["stage"] for u in n["users"] if u["stage"] is not None})

    def facts(p: dict[str, Any], sending: bool) -> dict[str, Any]:
        shape = list(p.get("shape") or [])
        if p.get("batch_dim") is not None and shape:
            shape[p["batch_dim"]] = mb
        size = 1
        for d in shape:
            size *= d
        nbytes = size * _itemsize(p.get("dtype")) if p.get("kind") == "tensor" else 0
        out = {"name": p["name"], "producer": p.get("producer"), "from_stage": p.get("stage"),
               "kind": p.get("kind"), "dtype": p.get("dtype"), "shape": shape, "bytes": nbytes,
               "value": p.get("value")}
        later = [u for u in users.get(p["name"], []) if u > stage] if sending else []
        if sending:
            out["used_by_stages"] = later  # num_stages means the model's output
        return out
    return ([facts(p, False) for p in ports.get("receives", [])],
            [facts(p, True) for p in ports.get("sends", [])])


def _port_value(p: dict[str, Any]) -> str:
    if p.get("kind") == "tensor":
        return f"{p['dtype']}[{', '.join(str(d) for d in p['shape'])}]"
    return f"{p.get('kind') or 'object'} = {p.get('value')}"


def _itemsize(dtype: str | None) -> int:
    sizes = {"float64": 8, "int64": 8, "complex64": 8, "float32": 4, "int32": 4, "float16": 2,
             "bfloat16": 2, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
    return sizes.get(dtype or "", 4)


def stage_json(c: Compiled, stage: int) -> dict[str, Any]:
    """`pipecc inspect OUT --stage I --format json`: the stage's summary row, its ports and
    nodes (graph.json entries), and the FPGA estimates when it is an FPGA stage."""
    stage = _stage_index(c, stage)
    receives, sends = _port_facts(c, stage)
    params = [n for n in (c.graph or {}).get("nodes", []) if stage in n.get("stages", [])]
    return {"format": INSPECT_FORMAT, "version": FORMAT_VERSION, "out": str(c.path),
            "stage": summary_json(c)["stages"][stage], "receives": receives, "sends": sends,
            "nodes": c.nodes_of(stage), "parameters": [n["name"] for n in params],
            "fpga_estimates": c.estimates.get(stage), "has_graph": c.graph is not None}


# ----------------------------------------------------------------------------- text
def summary_text(c: Compiled, verbose: bool = False) -> str:
    """The default `pipecc inspect OUT` output: one table of stages and the figures below it."""
    data = summary_json(c)
    plan = c.plan
    rows = []
    for s in data["stages"]:
        cap = s["memory_capacity_bytes"]
        mem = human(s["peak_memory_bytes"], "B") + (f" / {human(cap, 'B')}" if cap else "")
        rows.append([f"{s['index']}{' *' if s['bottleneck'] else ''}",
                     f"{s['device']} {s['device_name']}", f"{s['first_node']} .. {s['last_node']}",
                     str(s["num_nodes"]), human(s["forward_flops"]), human(s["param_bytes"], "B"),
                     _seconds(s["forward_s"]), _seconds(s["backward_s"]), mem,
                     human(s["recv_bytes"], "B"), human(s["send_bytes"], "B"),
                     ", ".join(s["split_layers"]) or "-"])
    mb = data["microbatch_size"]
    lines = [
        f"{c.path}: {plan.model}, {len(plan.stages)} stages on {len(plan.devices)} devices",
        f"schedule {plan.schedule}" + (f" (v={plan.virtual_stages} stages per device)"
                                       if plan.virtual_stages > 1 else "")
        + f", {plan.microbatches} micro-batches of {mb} (batch {plan.batch_size}); "
        f"figures per micro-batch",
        "",
        _table(["stage", "device", "nodes", "#", "fwd FLOPs", "params", "fwd", "bwd",
                "peak mem / capacity", "in", "out", "split-layer shards"], rows, left=3,
               right_from=11),
        "",
        f"bottleneck      {_seconds(plan.bottleneck_s)} per micro-batch: stage "
        f"{data['bottleneck_stage']} (marked *)",
        f"lower bound     {_seconds(plan.lower_bound_s)}   balance ratio {plan.balance_ratio:.3f}",
        f"iteration       {_seconds(plan.predicted_iteration_s)} predicted, bubble "
        f"{plan.bubble_fraction:.1%}",
    ]
    for sl in plan.split_layers:
        lines.append(f"split layer     {sl.node} into {sl.parts} shards {sl.sizes} (dim {sl.dim})")
    for b in plan.baselines:
        ratio = b["bottleneck_s"] / plan.lower_bound_s if plan.lower_bound_s > 0 else float("inf")
        lines.append(f"baseline        {b['name']}: {_seconds(b['bottleneck_s'])}, ratio {ratio:.3f}"
                     + ("" if b.get("fits_memory", True) else " (exceeds memory)"))
    lines += ["", _ascii_timeline(_timeline(c))]
    if verbose:
        lines += ["", "decisions:"] + [f"  {d}" for d in plan.decisions]
    lines += ["", f"details of one stage: pipecc inspect {c.path} --stage I"
              + ("" if c.graph else "  (this folder has no graph.json: recompile for node details)")]
    return "\n".join(lines)


def _timeline(c: Compiled) -> dict[str, Any]:
    if c.timeline:
        return c.timeline
    from pipecc.report.html import timeline_for  # an older folder: simulate the plan again
    return timeline_json(timeline_for(c.plan))


def _ascii_timeline(t: dict[str, Any], width: int = 72) -> str:
    lines = [f"schedule: iteration {_seconds(t['iteration_s'])}, bubble {t['bubble_fraction']:.1%} "
             "(F forward, B backward, . idle)"]
    step = t["iteration_s"] / width if t["iteration_s"] > 0 else 0.0
    for r in range(t["num_ranks"]):
        cells = ["."] * width
        for e in t["events"]:
            if e["rank"] == r and e["kind"] in ("F", "B"):
                for col in range(width):
                    if e["start"] <= (col + 0.5) * step < e["end"]:
                        cells[col] = e["kind"]
        lines.append(f"device {r} |{''.join(cells)}|")
    return "\n".join(lines)


def stage_text(c: Compiled, stage: int) -> str:
    """`pipecc inspect OUT --stage I`: ports, then the stage's graph node by node."""
    data = stage_json(c, stage)
    s = data["stage"]
    lines = [f"stage {stage} (of 0..{len(c.plan.stages) - 1}) on device {s['device']} ({s['device_name']}, "
             f"{s['device_kind']}){'  — the bottleneck' if s['bottleneck'] else ''}",
             f"fwd {_seconds(s['forward_s'])}, bwd {_seconds(s['backward_s'])}, comm "
             f"{_seconds(s['comm_s'])}, peak memory {human(s['peak_memory_bytes'], 'B')}, "
             f"params {human(s['param_bytes'], 'B')} (per micro-batch of "
             f"{c.plan.batch_size // max(c.plan.microbatches, 1)})", ""]
    n = len(c.plan.stages)
    lines.append("receives:" if data["receives"] else "receives: nothing")
    for p in data["receives"]:
        src = "model input" if p["from_stage"] == MODEL_INPUT else f"stage {p['from_stage']}"
        relay = f", relayed by stage {stage - 1}" if p["from_stage"] not in (MODEL_INPUT, stage - 1) else ""
        lines.append(f"  {p['name']:<24} {_port_value(p):<24} {human(p['bytes'], 'B'):>7}  "
                     f"from {src} ({p['producer']}){relay}")
    lines.append("sends:" if data["sends"] else "sends: nothing")
    for p in data["sends"]:
        dests = [("model output" if u >= n else f"stage {u}") for u in p["used_by_stages"]]
        lines.append(f"  {p['name']:<24} {_port_value(p):<24} {human(p['bytes'], 'B'):>7}  "
                     f"to {', '.join(dests) or f'stage {stage + 1}'}"
                     + (f" (via stage {stage + 1})" if p["used_by_stages"]
                        and min(p["used_by_stages"]) > stage + 1 and min(p["used_by_stages"]) < n else ""))
    lines.append("")
    if not c.graph:
        lines.append("nodes: " + ", ".join(c.plan.stages[stage].nodes))
        lines.append("(no graph.json in this folder: recompile for op, shapes and costs per node)")
    else:
        index = {nd["id"]: k for k, nd in enumerate(data["nodes"])}
        rows = [[str(k), nd["name"], nd["op"], _shapes(nd["shapes"]), human(nd["forward_flops_mb"]),
                 human(nd["backward_flops_mb"]), human(nd["param_bytes"], "B"),
                 _refs(nd["inputs"], stage, n, index, None), _refs(nd["users"], stage, n, index, nd["id"])]
                for k, nd in enumerate(data["nodes"])]
        lines.append(_table(["#", "node", "op", "shape", "fwd FLOPs", "bwd FLOPs", "params",
                             "inputs from", "outputs to"], rows, left=4, right_from=7))
        lines.append("(FLOPs per micro-batch; shapes in the batch symbol B; #k: node k of this stage; "
                     "s<k>:<tensor>: the value from/to stage k, named as in stage.py; input:<name>, "
                     "output: the model's)")
        if data["parameters"]:
            lines.append(f"parameters read directly: {', '.join(data['parameters'])}")
    est = data["fpga_estimates"]
    if est:
        lines += ["", _estimates_text(est)]
    return "\n".join(lines)


def _shapes(shapes: list[str]) -> str:
    """'3× float32[B, 128, 768]' for repeated shapes."""
    groups: dict[str, int] = {}
    for sh in shapes:
        groups[sh] = groups.get(sh, 0) + 1
    return ", ".join(f"{k}× {sh}" if k > 1 else sh for sh, k in groups.items()) or "-"


def _refs(refs: list[dict[str, Any]], stage: int, num_stages: int, index: dict[str, int],
          sent_as: str | None) -> str:
    """Inputs (sent_as None): where each comes from. Users: which local node, or which stage
    receives this node's value (`sent_as`, its tensor name)."""
    out = []
    for r in refs:
        if r["stage"] is None:
            continue  # a parameter read: counted in the params column
        if r["stage"] == stage and r["id"] in index:
            out.append(f"#{index[r['id']]}")
        elif r["stage"] == MODEL_INPUT:
            out.append(f"input:{r['id']}")
        elif r["stage"] >= num_stages:
            out.append("output")
        else:
            out.append(f"s{r['stage']}:{sent_as or r['id']}")
    return ", ".join(dict.fromkeys(out)) or "-"


def _estimates_text(est: dict[str, Any]) -> str:
    util = est.get("utilisation", {})
    lines = [f"FPGA estimates ({est.get('source', '?')}, {est.get('card')}, {est.get('number')}): "
             f"DSP {est.get('total', {}).get('dsp')} ({util.get('dsp', 0):.0%}), BRAM18 "
             f"{est.get('total', {}).get('bram18')} ({util.get('bram18', 0):.0%}), "
             f"{'fits' if est.get('fits') else 'DOES NOT FIT'}; interval {est.get('interval_cycles')} "
             f"cycles ({_seconds(est.get('interval_s', 0.0))}), latency {est.get('latency_cycles')} cycles"]
    layers = est.get("layers") or []
    if layers:
        keys = [k for k in ("name", "kind", "pe", "simd", "dsp", "bram18", "lut", "ii_cycles",
                            "latency_cycles") if k in layers[0]]
        lines.append(_table(keys, [[str(layer.get(k, "")) for k in keys] for layer in layers]))
    return "\n".join(lines)


# ----------------------------------------------------------------------------- dot
def _q(text: Any) -> str:
    text = str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return '"' + text + '"'


def dot_text(plan: Plan, graph: dict[str, Any] | None) -> str:
    """Graphviz from the plan and graph.json: one `subgraph cluster_<i>` per stage, model inputs
    and the output outside, cross-stage edges labelled with the bytes per micro-batch, in red."""
    title = (f"{plan.model}: {len(plan.stages)} stages, schedule {plan.schedule}; "
             "edge labels: bytes per micro-batch")
    lines = [f"digraph {_q(plan.model)} {{", "  rankdir=TB;", "  compound=true;",
             '  node [shape=box, style="rounded,filled", fillcolor="#f5f7fa", '
             'fontname="Helvetica", fontsize=10];', '  edge [fontname="Helvetica", fontsize=9];',
             f"  label={_q(title)};"]
    if not graph:
        for s in plan.stages:
            dev = plan.devices[s.device]["name"] if s.device < len(plan.devices) else "?"
            lines.append(f"  subgraph cluster_{s.index} {{ label={_q(f'stage {s.index} · {dev}')}; "
                         f"s{s.index} [label={_q(f'{len(s.nodes)} nodes')}]; }}")
        for s in plan.stages[:-1]:
            lines.append(f"  s{s.index} -> s{s.index + 1} [label={_q(human(s.send_bytes, 'B'))}];")
        return "\n".join(lines + ["}"])
    nodes = [n for n in graph["nodes"] if n["stage"] is not None]
    by_id = {n["id"]: n for n in nodes}
    for n in nodes:
        if n["stage"] == MODEL_INPUT:
            lines.append(f"  {_q(n['id'])} [label={_q(n['name'] + chr(10) + ' '.join(n['shapes']))}, "
                         'shape=ellipse, fillcolor="#e8f4e8"];')
    for s in plan.stages:
        dev = plan.devices[s.device]["name"] if s.device < len(plan.devices) else "?"
        lines.append(f"  subgraph cluster_{s.index} {{")
        lines.append(f"    label={_q(f'stage {s.index} · device {s.device} {dev}')}; style=rounded; "
                     'color="#7a8ca3";')
        members = [n for n in nodes if n["stage"] == s.index]
        for n in members:
            label = f"{n['name']}\n{n['op']}  {_shapes(n['shapes'])}"
            lines.append(f"    {_q(n['id'])} [label={_q(label)}];")
        if not members:  # Graphviz drops an empty cluster; keep the stage visible
            lines.append(f'    "stage_{s.index}_empty" [label="no nodes of its own", style=dashed];')
        lines.append("  }")
    lines.append('  "output" [shape=ellipse, fillcolor="#e8f4e8"];')
    for n in nodes:
        for u in n["users"]:
            if u["id"] != "output" and u["id"] not in by_id:
                continue
            cross = u["stage"] != n["stage"]
            attrs = (f' [label={_q(human(n["output_bytes_mb"], "B"))}, penwidth=2, color="#c0392b", '
                     'fontcolor="#c0392b"]') if cross and n["stage"] != MODEL_INPUT else ""
            lines.append(f"  {_q(n['id'])} -> {_q(u['id'])}{attrs};")
    return "\n".join(lines + ["}"])
