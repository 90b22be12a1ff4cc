"""`pipecc inspect OUT`: what a compile made, read back from the folder alone.

Compile time writes OUT/graph.json and OUT/timeline.json (see `artifacts`). Inspect reads those
with `schedule.txt` (the action list the runtime executes: the timeline is drawn from it,
`timeline_of`), `plan.json`, `pipecc.json` and each `stage_<i>/ports.json` (and an FPGA stage's
`estimates.json`) through the folder's one reader, `pipecc.runtime.folder.CompiledFolder.show`
(`Compiled` is the views' name for it); it never imports the model or the stage code. A folder compiled before
graph.json (or schedule.txt) existed still inspects, without the per-node details (with the
plan's own schedule).

Renderers: `summary_json` / `stage_json` (`--format json`; the keys listed there are stable),
`summary_text` / `stage_text` (the default); `--format dot` is `dot.dot_text`.

Units: the plan's figures (FLOPs, seconds, traffic) are per micro-batch, as the planner saw
them; node costs are given both at the compile batch (like `pipecc cost`) and per micro-batch.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from pipecc.errors import PipeccError
from pipecc.ir.plan import Plan, cost_basis
from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.text import format as schedule_text
from pipecc.report.artifacts import FORMAT_VERSION, MODEL_INPUT, timeline_for, timeline_json
from pipecc.report.figures import bottleneck_note, bottleneck_stage, device_capacities, first_last, memory_kind
from pipecc.report.formatting import (WIDTH, count, fit_table, human, seconds, seconds_in_text, shapes_text,
                                     text_table, wrap)
from pipecc.report.text import ratio_note, replica_group, replica_rows, technique_answer, technique_lines
from pipecc.runtime.folder import CompiledFolder
from pipecc.runtime.folder_data import plan_problem, read_typed_plan

__all__ = ["INSPECT_FORMAT", "Compiled", "damaged", "load_compiled", "plan_problem", "read_plan", "stage_json",
           "stage_text", "summary_json", "summary_text", "timeline_of"]

INSPECT_FORMAT = "pipecc-inspect"


# ----------------------------------------------------------------------------- reading OUT
@dataclass(frozen=True)
class Compiled:
    """A compiled folder as the views draw it: its ``CompiledFolder`` (``CompiledFolder.show``:
    every file read and checked there, once) under the names the views use."""

    folder: CompiledFolder

    @property
    def path(self) -> Path:
        return self.folder.path

    @property
    def marker(self) -> dict[str, Any]:
        return self.folder.marker

    @property
    def plan(self) -> Plan:
        """plan.json, typed and checked (``CompiledFolder.typed_plan``)."""
        return self.folder.typed_plan

    @property
    def microbatches(self) -> int:
        """The folder's micro-batches (pipecc.json's; plan.json's and schedule.txt's agree with it)."""
        return self.folder.microbatches

    @property
    def ports(self) -> list[dict[str, Any]]:
        return self.folder.stage_ports

    @property
    def graph(self) -> dict[str, Any] | None:
        """graph.json, when the compile wrote one."""
        return self.folder.graph

    @property
    def timeline(self) -> dict[str, Any] | None:
        """timeline.json, likewise."""
        return self.folder.timeline

    @property
    def schedule(self) -> Schedule | None:
        """schedule.txt (parsed and validated), likewise."""
        return self.folder.saved_schedule

    @property
    def estimates(self) -> dict[int, dict[str, Any]]:
        """The FPGA stages' estimates, by stage."""
        return self.folder.estimates

    def nodes_of(self, stage: int) -> list[dict[str, Any]]:
        return [n for n in (self.graph or {}).get("nodes", []) if n["stage"] == stage]


def load_compiled(out: str | Path) -> Compiled:
    """Read OUT (``CompiledFolder.show``); a missing folder, one `pipecc compile` did not write or
    a damaged file of it is a PipeccError."""
    return Compiled(CompiledFolder.show(out))


def read_plan(out: str | Path) -> Plan:
    """OUT/plan.json as a Plan (as ``CompiledFolder.typed_plan`` reads it; its figures unchecked: see
    ``plan_problem``)."""
    return read_typed_plan(out)


@contextlib.contextmanager
def damaged(c: Compiled) -> Iterator[None]:
    """Rendering OUT: a file of it that does not have the shape this pipecc wrote (graph.json,
    ports.json, timeline.json edited or from another version) is a one-line error, not a
    traceback. NOTE: the folder is data from disk, like a model file; `--debug` shows where."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, ZeroDivisionError) as exc:
        raise PipeccError(f"{c.path} is damaged or from another pipecc version "
                          f"({type(exc).__name__}: {exc}); recompile it") from exc


def _split_shards(plan: Plan, stage: int) -> list[str]:
    """'lm_head 1/2' for every split layer with a shard in `stage`."""
    names = set(plan.stages[stage].nodes)
    return [f"{sl.node} {k + 1}/{sl.parts}" for sl in plan.split_layers
            for k, sh in enumerate(sl.shards) if sh in names]


# ----------------------------------------------------------------------------- JSON
def summary_json(c: Compiled) -> dict[str, Any]:
    """`pipecc inspect OUT --format json`. Stable keys: format, version, out, model, batch_size,
    microbatches, microbatch_size, schedule, virtual_stages, devices, stages[] (index, device,
    device_name, device_kind, first_node, last_node, num_nodes, forward_flops, param_bytes,
    forward_s, backward_s, comm_s, recv_bytes, send_bytes, peak_memory_bytes,
    memory_capacity_bytes, memory_kind, split_layers, receives, sends, bottleneck, fpga_estimates,
    recompute: whether the stage recomputes its activations in backward),
    bottleneck_stage, bottleneck_s, lower_bound_s, balance_ratio, predicted_iteration_s,
    bubble_fraction, split_layers, baselines, decisions, has_graph, schedule_text (schedule.txt,
    the action list the runtime executes; None for a folder compiled before it); PP x DP: replicas, and per
    stage replica_devices (its group; [device] without replication) and allreduce_s;
    Bi-Partition: bipartition_mode, weight_sync_bytes, bipartition (the planner's cut pair and
    figures, or None) and per stage backward_nodes (its backward range) and extra_send_bytes;
    variable lengths: lengths (the declaration, planned_at, expected_step_s and a table of
    per-length stage [forward_s, backward_s] and step_s; None without --length). An FPGA
    stage's memory and
    its capacity are on-chip BRAM (BPipe: activation_balancing, the plan's pairs, and estimate) (memory_kind "BRAM"; else "DRAM")."""
    plan = c.plan
    worst = bottleneck_stage(plan)
    caps = device_capacities(plan)
    stages = []
    for s in plan.stages:
        dev = plan.devices[s.device] if s.device < len(plan.devices) else {}
        first, last = first_last(s.nodes)
        ports = c.ports[s.index] if s.index < len(c.ports) else {}
        stages.append({
            "index": s.index, "device": s.device, "device_name": dev.get("name"),
            "device_kind": dev.get("kind"), "first_node": first, "last_node": last,
            "num_nodes": len(s.nodes), "forward_flops": s.forward_flops, "param_bytes": s.param_bytes,
            "forward_s": s.forward_s, "backward_s": s.backward_s, "comm_s": s.comm_s,
            "recv_bytes": s.recv_bytes, "send_bytes": s.send_bytes,
            "peak_memory_bytes": s.peak_memory_bytes,
            "memory_capacity_bytes": caps[s.device] if s.device < len(caps) else None,
            "memory_kind": memory_kind(dev),
            "split_layers": _split_shards(plan, s.index),
            "receives": [p["name"] for p in ports.get("receives", [])],
            "sends": [p["name"] for p in ports.get("sends", [])],
            "bottleneck": s.index == worst,
            "fpga_estimates": c.estimates.get(s.index), "recompute": s.recompute,
            "replica_devices": plan.stage_devices(s), "allreduce_s": s.allreduce_s,
            "backward_nodes": list(s.backward_nodes or s.nodes),
            "extra_send_bytes": s.extra_send_bytes})
    return {"format": INSPECT_FORMAT, "version": FORMAT_VERSION, "out": str(c.path),
            "model": plan.model, "batch_size": plan.batch_size, "microbatches": c.microbatches,
            "microbatch_size": plan.batch_size // max(c.microbatches, 1),
            "schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
            "replicas": plan.replicas, "microbatch_sizes": plan.microbatch_sizes,
            "devices": plan.devices, "stages": stages, "bottleneck_stage": worst,
            "bottleneck_s": plan.bottleneck_s, "lower_bound_s": plan.lower_bound_s,
            "balance_ratio": plan.balance_ratio if math.isfinite(plan.balance_ratio) else None,
            "predicted_iteration_s": plan.predicted_iteration_s,
            "bubble_fraction": plan.bubble_fraction,
            "split_layers": [vars(sl) for sl in plan.split_layers], "baselines": plan.baselines,
            "decisions": plan.decisions, "has_graph": c.graph is not None,
            "bipartition_mode": plan.bipartition_mode, "weight_sync_bytes": plan.weight_sync_bytes,
            "bipartition": _data_json(plan, "bipartition"),
            "lengths": plan.options.get("lengths"),
            "activation_balancing": plan.activation_balancing, "estimate": plan.estimate,
            "schedule_text": None if c.schedule is None else schedule_text(c.schedule)}


def _data_json(plan: Plan, key: str) -> Any:
    """The JSON of the plan's technique data under `key` (`pipecc.ir.plan_data`), or None."""
    value = plan.technique_data.get(key)
    return value.to_json() if value is not None else None


def _stage_index(c: Compiled, stage: int) -> int:
    n = len(c.plan.stages)
    if not 0 <= stage < n:
        raise PipeccError(f"--stage {stage}: {c.path} has stages 0..{n - 1}")
    return stage


def _port_facts(c: Compiled, stage: int) -> tuple[list[dict], list[dict]]:
    """This stage's receives and sends, each with bytes per micro-batch and where it goes."""
    ports = c.ports[stage] if stage < len(c.ports) else {}
    mb = c.plan.batch_size // max(c.microbatches, 1)
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
        mem = human(s["peak_memory_bytes"], "B") + (f" / {human(cap, 'B')}" if cap else "") \
            + (" BRAM" if s["memory_kind"] == "BRAM" else "")
        rows.append([f"{s['index']}{' *' if s['bottleneck'] else ''}",
                     replica_group(plan, plan.stages[s['index']]) if plan.replicas > 1
                     else f"{s['device']} {s['device_name']}", f"{s['first_node']} .. {s['last_node']}",
                     str(s["num_nodes"]), human(s["forward_flops"]), human(s["param_bytes"], "B"),
                     seconds(s["forward_s"]), seconds(s["backward_s"]), seconds(s["comm_s"]), mem,
                     human(s["recv_bytes"], "B"), human(s["send_bytes"], "B"),
                     ", ".join(s["split_layers"]) or "-"])
    mb = data["microbatch_size"]
    split = technique_answer("batch_split", plan, "inspect")  # UMPIPE's unequal micro-batches
    lines = [
        f"{c.path}: {plan.model}, {count(len(plan.stages), 'stage')} on {count(len(plan.devices), 'device')}",
        f"schedule {plan.schedule}" + (f" (v={plan.virtual_stages} stages per device)"
                                       if plan.virtual_stages > 1 else "")
        + (split if split is not None else
           f", {count(c.microbatches, 'micro-batch')} of {mb} (batch {plan.batch_size}); ")
        + (f"{plan.replicas} replicas per stage, each on {replica_rows(mb, plan.replicas)} samples of "
           "every micro-batch; figures per replica and micro-batch"
           + (" (the largest slice)" if mb % plan.replicas else "") if plan.replicas > 1
           else "" if split is not None else "figures per micro-batch"),
        "",
        fit_table(["stage", "device", "nodes", "#", "fwd FLOPs", "params", "fwd", "bwd", "comm",
                   "peak mem / capacity", "in", "out", "split-layer shards"], rows, moved=[2, 10, 11, 12],
                  left=3, right_from=12),
        "",
        f"bottleneck      {seconds(plan.bottleneck_s)} per micro-batch: stage "
        f"{data['bottleneck_stage']} (marked *; {bottleneck_note(plan)})",
        f"lower bound     {seconds(plan.lower_bound_s)}   balance ratio {plan.balance_ratio:.3f}{ratio_note(plan)}",
        f"iteration       {seconds(plan.predicted_iteration_s)} predicted, bubble "
        f"{plan.bubble_fraction:.1%}",
        f"times           predicted from {cost_basis(plan)}",
    ]
    if plan.replicas > 1:
        lines.append(f"all-reduce      {seconds(max(s.allreduce_s for s in plan.stages))} per "
                     "iteration at most (each stage's gradients in its replica group)")
    for sl in plan.split_layers:
        lines.append(f"split layer     {sl.node} into {sl.parts} shards {sl.sizes} (dim {sl.dim})")
    shown, said = technique_lines(plan, verbose)
    lines += shown
    for b in plan.baselines:
        ratio = b["bottleneck_s"] / plan.lower_bound_s if plan.lower_bound_s > 0 else float("inf")
        lines.append(f"baseline        {b['name']}: {seconds(b['bottleneck_s'])}, ratio {ratio:.3f}"
                     + ("" if b.get("fits_memory", True) else " (exceeds memory)"))
    lines = lines[:1] + [part for line in lines[1:]  # the folder's line stays whole; a table is many lines
                         for part in (wrap(line, indent=16) if "\n" not in line and len(line) > WIDTH else [line])]
    lines += ["", _ascii_timeline(timeline_of(c))]
    if verbose:
        decisions = [d for d in plan.decisions if not d.startswith(said)]  # said above
        lines += ["", "decisions:"] + [part for d in decisions for part in wrap(f"  {seconds_in_text(d)}")]
    lines += ["", f"details of one stage: pipecc inspect {c.path} --stage I"
              + ("" if c.graph else "  (this folder has no graph.json: recompile for node details)")]
    return "\n".join(lines)


def timeline_of(c: Compiled) -> dict[str, Any]:
    """The folder's timeline: its schedule.txt simulated with the plan's figures (what the
    runtime executes, also after an edit); an older folder's timeline.json, or its plan's own
    schedule simulated again."""
    if c.schedule is not None:
        return timeline_json(timeline_for(c.plan, c.schedule))
    if c.timeline:
        return c.timeline
    return timeline_json(timeline_for(c.plan))


def _ascii_timeline(t: dict[str, Any], width: int = 72) -> str:
    split = any(e["kind"] in ("I", "W") for e in t["events"])
    keys = "F forward, I backward for the input, W for the weights" if split else "F forward, B backward"
    lines = [f"schedule: iteration {seconds(t['iteration_s'])}, bubble {t['bubble_fraction']:.1%} "
             f"({keys}, . idle)"]
    step = t["iteration_s"] / width if t["iteration_s"] > 0 else 0.0
    for r in range(t["num_ranks"]):
        cells = ["."] * width
        for e in t["events"]:
            if e["rank"] == r and e["kind"] in ("F", "B", "I", "W"):
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
             f"fwd {seconds(s['forward_s'])}, bwd {seconds(s['backward_s'])}, comm "
             f"{seconds(s['comm_s'])}, peak memory {human(s['peak_memory_bytes'], 'B')}, "
             f"params {human(s['param_bytes'], 'B')} (per micro-batch of "
             f"{c.plan.batch_size // max(c.microbatches, 1)})", ""]
    if s.get("recompute"):
        lines[1:1] = ["recomputes its activations in backward (bwd includes one more forward)"]
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
        rows = [[str(k), nd["name"], nd["op"], shapes_text(nd["shapes"]), human(nd["forward_flops_mb"]),
                 human(nd["backward_flops_mb"]), human(nd["param_bytes"], "B"),
                 _refs(nd["inputs"], stage, n, index, None), _refs(nd["users"], stage, n, index, nd["id"])]
                for k, nd in enumerate(data["nodes"])]
        lines.append(text_table(["#", "node", "op", "shape", "fwd FLOPs", "bwd FLOPs", "params",
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
             f"cycles ({seconds(est.get('interval_s', 0.0))}), latency {est.get('latency_cycles')} cycles"]
    layers = est.get("layers") or []
    if layers:
        keys = [k for k in ("name", "kind", "pe", "simd", "dsp", "bram18", "lut", "ii_cycles",
                            "latency_cycles") if k in layers[0]]
        lines.append(text_table(keys, [[str(layer.get(k, "")) for k in keys] for layer in layers]))
    return "\n".join(lines)
