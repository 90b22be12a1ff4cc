"""Bi-Partition plans in the torch backend ("ship" mode, `pipecc.techniques.bipartition.runtime_segments`): what a
compiled folder holds for them, and the plans the runtime cannot execute (refused at compile).

A plan whose stages' backward ranges (`StagePlan.backward_nodes`) differ from their forward
ranges is cut into its pieces (`Plan.bipartition_pieces`: cores and segments, graph order) with
the ordinary stage cutter (`cut_stages`, each piece a "stage", so skip values are relayed through
a segment like through any stage). Worker j's folder `stage_<j>/` holds

    stage.py, weights.safetensors   its core (class Stage<j>), as for any stage
    segment_<b>.py, segment_<b>.safetensors
                                    each adjacent segment (boundary b lies between workers b and
                                    b+1; class Segment<b>): the same file in the forward worker's
                                    folder (a replica) and the backward worker's (the owner)
    ports.json                      `receives`/`sends` = the worker's FORWARD boundary values
                                    (what its forward messages carry), and `bipartition`: the
                                    core's ports, the segments (boundary, fp_worker, bp_worker,
                                    file, class, weights, receives, sends, nodes), `grad_sends`
                                    (values crossing c_{j-1}, whose gradients it sends upstream)
                                    and `grad_receives` (crossing c_j)

and `pipecc.json` says `"bipartition": "ship"`. Inference plans ignore the backward ranges
(their folders run the forward ranges). At run time both workers trace each segment's
forward/backward graphs (`pipecc.techniques.bipartition.runtime_segments.trace_segment`, AOTAutograd).

Compile traces them too (`trace_segments`, called by `write_workers` on the folder it just wrote):
every segment module as the runtime loads it (`pipecc.runtime.stagefile.load_stage` of its owner's
folder), once per micro-batch shape of the plan, through the runtime's own `SegmentRunner.graphs`,
on CPU and inside `torch.random.fork_rng` (the user's model is never touched: the modules are
the generated files' own copies). A segment AOTAutograd cannot split (an in-place op on a value
it receives, an op AOTAutograd cannot trace, graphs of an unexpected form) is refused in one line
naming it and its nodes, so the compile writes nothing. The saved-tensor bytes that travel per micro-batch of
batch // m samples go into the segment's entry in `ports.json` (`saved_bytes`); `payload_notes`
compares them with the plan's `extra_send_bytes` (a note beyond ±25 %, never a refusal). The cost:
about a second for the first segment (torch's AOTAutograd import), well under a second for each
further segment and shape on CPU, and the segment's weights copied once more in memory.

The torch backend asks this module through its hooks (`marker_fields`, `check`, `write_stages`,
`notes`). Where Bi-Partition can run is one rule (`pipecc.techniques.bipartition.requires`, and the
graph's part `techniques.bipartition.plan.graph_requires`: the loss, BatchNorm or a non-tensor value
in a segment, tied weights), asked by the driver before compile. Refused here in one line,
nothing written, is what only the generated code shows (`cut_pieces`, `trace_segments`): tied
weights among the cut pieces, a non-tensor or tuple boundary, a segment AOTAutograd cannot split.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch

from pipecc.backends.torch.codegen import generate_stage, save_weights
from pipecc.backends.torch.stages import Stage, cut_stages, port_json, ports_json
from pipecc.errors import PipeccError
from pipecc.ir.graph import AnnotatedGraph, TensorInfo
from pipecc.ir.plan import Plan
from pipecc.techniques import bipartition

FIX = "plan with --bipartition off"
PAYLOAD_TOLERANCE = 0.25  # |traced - planned| / planned beyond which `payload_notes` says so


def uses_bipartition(plan: Plan) -> bool:
    """True when the compiled folder needs Bi-Partition workers (`pipecc.techniques.bipartition.uses`:
    a training plan whose backward ranges differ from its forward ranges)."""
    return bipartition.uses(plan)


def pieces_of(plan: Plan) -> list[tuple[str, int, int, list[str]]]:
    """The plan's pieces (`Plan.bipartition_pieces`), [] for a plan without Bi-Partition. The
    scope was asked before (`pipecc.techniques.bipartition.requires`, and the graph's part,
    `techniques.bipartition.plan.graph_requires`); what remains here is the generated code's."""
    return plan.bipartition_pieces() if uses_bipartition(plan) else []


def marker_fields(plan: Plan) -> dict[str, Any]:
    """The technique's entries of the compiled folder's marker (the torch backend's hook):
    "bipartition", "ship" when the workers hold Bi-Partition segments, else ""."""
    return {"bipartition": "ship" if pieces_of(plan) else ""}


def check(graph: AnnotatedGraph, plan: Plan) -> None:
    """What only the pieces' generated code shows, refused in one line (the torch backend's
    hook, before anything is written): tied weights, non-tensor or tuple boundaries (`cut_pieces`)."""
    pieces = pieces_of(plan)
    if pieces:
        cut_pieces(graph, pieces)


def write_stages(tmp: Path, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Stage], device_desc: Any) -> bool:
    """Every worker's folder when the plan has pieces (`write_workers`; the torch backend's hook):
    True, else False (nothing written: the backend writes each stage's folder)."""
    pieces = pieces_of(plan)
    if not pieces:
        return False
    write_workers(tmp, graph, plan, stages, pieces, device_desc)
    return True


def notes(plan: Plan, out: str | Path) -> list[str]:
    """The compiled folder `out`'s notes (the torch backend's hook): `payload_notes`."""
    return payload_notes(plan, out)


def cut_pieces(graph: AnnotatedGraph, pieces: Sequence[tuple[str, int, int, list[str]]]) -> list[Stage]:
    """One `Stage` per piece (graph order), cut like stages: relays included."""
    piece_of = {n: i for i, (_, _, _, nodes) in enumerate(pieces) for n in nodes}
    cut = cut_stages(graph, piece_of)
    if len(cut) != len(pieces):
        raise PipeccError(f"the Bi-Partition pieces cut into {len(cut)} parts, not {len(pieces)}; {FIX}")
    tied = sorted({t for s in cut for t in s.tied})
    if tied:
        raise PipeccError(f"a Bi-Partition plan cannot run with tied weights ({tied[0]}); {FIX}")
    for stage in cut:  # a port's producer: the worker running its forward, not the piece
        stage.receives = [replace(p, stage=pieces[p.stage][1]) if p.stage >= 0 else p for p in stage.receives]
        stage.sends = [replace(p, stage=pieces[p.stage][1]) if p.stage >= 0 else p for p in stage.sends]
    for (kind, fp, bp, nodes), stage in zip(pieces, cut):
        if kind == "segment":
            bad = [p for p in (*stage.receives, *stage.sends) if not isinstance(p.value, TensorInfo)]
            if bad:
                raise PipeccError(f"the segment from {nodes[0]!r} (forward on stage {fp}, backward on stage {bp}) "
                                  f"has the non-tensor value {bad[0].producer!r} at its boundary; {FIX}")
    for stage in cut:
        if any(not isinstance(p.value, TensorInfo) and isinstance(p.value, (tuple, list))
               for p in (*stage.receives, *stage.sends)):
            raise PipeccError(f"a Bi-Partition plan cannot pass a tuple value between its pieces; {FIX}")
    return cut


def write_workers(tmp: Path, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Stage],
                  pieces: Sequence[tuple[str, int, int, list[str]]], device_desc: Any) -> None:
    """Every worker's folder (module docstring); `stages` are the forward-range stages (their
    ports are the forward messages'), `device_desc(index)` a device's description."""
    cut = cut_pieces(graph, pieces)
    n = len(stages)
    core_of = {fp: i for i, (kind, fp, _, _) in enumerate(pieces) if kind == "core"}
    segments = {min(fp, bp): i for i, (kind, fp, bp, _) in enumerate(pieces) if kind == "segment"}

    def save(path: Path, tensors: dict[str, torch.Tensor], what: str) -> None:
        save_weights({k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}, path,
                     {"format": "pt", "pipecc.stage": what})

    for j, planned in enumerate(plan.stages):
        folder = tmp / f"stage_{j}"
        folder.mkdir(parents=True, exist_ok=True)
        core = cut[core_of[j]]
        gen = generate_stage(core, graph.model_name, j, device_desc(planned.device), n)
        (folder / "stage.py").write_text(gen.source, encoding="utf-8")
        save(folder / "weights.safetensors", gen.tensors, str(j))
        infos = []
        for b in (j - 1, j):
            if b not in segments:
                continue
            kind, fp, bp, nodes = pieces[segments[b]]
            seg = cut[segments[b]]
            cls = f"Segment{b}"
            where = f"forward on stage {fp}, backward on stage {bp} (owner)"
            sgen = generate_stage(seg, graph.model_name, b, where, n, class_name=cls)
            source = sgen.source.replace("Weights: weights.safetensors beside", f"Weights: segment_{b}.safetensors beside")
            (folder / f"segment_{b}.py").write_text(source, encoding="utf-8")
            save(folder / f"segment_{b}.safetensors", sgen.tensors, f"segment {b}")
            infos.append({"boundary": b, "fp_worker": fp, "bp_worker": bp, "file": f"segment_{b}.py",
                          "class": cls, "weights": f"segment_{b}.safetensors", "nodes": list(nodes),
                          "receives": [port_json(p, seg.point) for p in seg.receives],
                          "sends": [port_json(p, seg.point) for p in seg.sends]})
        left = next((i for i in infos if i["boundary"] == j - 1 and i["bp_worker"] == j), None)
        right = next((i for i in infos if i["boundary"] == j and i["bp_worker"] == j), None)
        core_ports = {"receives": [port_json(p, core.point) for p in core.receives],
                      "sends": [port_json(p, core.point) for p in core.sends]}
        section = {"mode": "ship", "worker": j, "core": core_ports, "segments": infos,
                   "grad_sends": [] if j == 0 else (left or core_ports)["receives"],
                   "grad_receives": [] if j == n - 1 else (right or core_ports)["sends"]}
        ports = dict(ports_json(stages[j], n), **{"class": gen.class_name, "bipartition": section})
        (folder / "ports.json").write_text(json.dumps(ports, indent=1), encoding="utf-8")
    saved = trace_segments(tmp, plan, pieces)
    for j in range(n):  # the traced payload beside each segment's entry, in both workers' folders
        path = tmp / f"stage_{j}" / "ports.json"
        ports = json.loads(path.read_text(encoding="utf-8"))
        for info in ports["bipartition"]["segments"]:
            info["saved_bytes"] = saved[int(info["boundary"])]
        path.write_text(json.dumps(ports, indent=1), encoding="utf-8")


def _names(nodes: Sequence[str], most: int = 6) -> str:
    shown = ", ".join(nodes[:most])
    return f"{shown}, ... ({len(nodes)} nodes)" if len(nodes) > most else shown


def trace_segments(folder: Path, plan: Plan, pieces: Sequence[tuple[str, int, int, list[str]]]) -> dict[int, int]:
    """Trace every segment of the compiled `folder` as the runtime will (module docstring):
    {boundary: saved-tensor bytes that travel per micro-batch of batch // m samples}, or a
    one-line PipeccError naming the segment that AOTAutograd cannot split."""
    from pipecc.runtime.ports import StagePorts
    from pipecc.runtime.stagefile import load_stage

    m = plan.microbatches
    workers: dict[int, tuple[Any, dict[str, Any]]] = {}
    saved: dict[int, int] = {}
    # NOTE: building the generated modules and running the traces on dummy values must not move
    # the caller's random state (a dropout in a segment, a module's initialisation)
    with torch.random.fork_rng(devices=[]):
        for kind, fp, bp, nodes in pieces:
            if kind != "segment":
                continue
            b = min(fp, bp)
            if bp not in workers:  # the owner's folder: the runtime loads the segment from there
                workers[bp] = load_stage(folder / f"stage_{bp}")
            module, ports = workers[bp]
            runner = next(r for r in module.runners if r.boundary == b)
            batch = StagePorts.from_json(ports).batch_size
            shapes = [tuple(p.microbatch_shape(mb, batch, m) for p in runner.ports.receives) for mb in range(m)]
            for shape in dict.fromkeys(shapes):  # each distinct micro-batch shape once, in order
                try:
                    runner.graphs(list(shape))
                except Exception as exc:  # AOTAutograd raises many types; ours say what is wrong
                    raise PipeccError(
                        f"the segment at boundary {b} (nodes {_names(nodes)}; forward on stage {fp}, backward on "
                        f"stage {bp}) cannot be split into forward and backward graphs by AOTAutograd "
                        f"({_why(exc, runner, shape)}); re-{FIX}") from exc
            graphs = runner.graphs(list(shapes[-1]))  # the last micro-batch: batch // m samples
            saved[b] = sum(torch.Size(graphs.saved[i][0]).numel() * graphs.saved[i][1].itemsize
                           for i in graphs.sent)
    return saved


def _why(exc: Exception, runner: Any, shape: Sequence[tuple[int, ...]]) -> str:
    """What went wrong, in a few words: an input the segment changes in place (AOTAutograd then
    returns it as an extra output, `trace_segment`'s "unexpected form"), else the error's gist."""
    text = str(exc).strip()
    why = text.splitlines()[0].removeprefix("Bi-Partition: ").split("; compile without")[0][:200] if text else ""
    if not isinstance(exc, PipeccError):
        why = f"{type(exc).__name__}: {why}" if why else type(exc).__name__
    try:  # NOTE: an eager run on dummy inputs: an in-place op on an input bumps its version counter
        xs = [torch.full(s, 0.5, dtype=p.dtype) if p.dtype.is_floating_point else torch.zeros(s, dtype=p.dtype)
              for s, p in zip(shape, runner.ports.receives)]
        before = [x._version for x in xs]
        with torch.no_grad():
            runner.module(*xs)
        changed = [name for name, x, v in zip(runner.receives, xs, before) if x._version != v]
    except Exception:  # the eager run fails too: the error's gist says enough
        changed = []
    if changed:
        return (f"its forward changes the value {changed[0]!r} it receives in place: make that op out-of-place in the "
                f"model, or keep it out of a segment")
    return why


def payload_notes(plan: Plan, out: str | Path) -> list[str]:
    """A note per forward worker whose traced saved-tensor payload (`saved_bytes` of the segments
    it runs forward, in its `ports.json`) differs from the plan's `extra_send_bytes` by more than
    `PAYLOAD_TOLERANCE`; [] without Bi-Partition or when they agree."""
    if not uses_bipartition(plan) or plan.bipartition_mode != "ship":
        return []
    notes = []
    for stage in plan.stages:
        try:
            ports = json.loads((Path(out) / f"stage_{stage.index}" / "ports.json").read_text(encoding="utf-8"))
            segments = ports["bipartition"]["segments"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        mine = [s for s in segments if int(s["fp_worker"]) == stage.index and "saved_bytes" in s]
        if not mine:
            continue
        traced, planned = sum(int(s["saved_bytes"]) for s in mine), stage.extra_send_bytes
        if abs(traced - planned) > PAYLOAD_TOLERANCE * planned:
            notes.append(f"note: Bi-Partition stage {stage.index} sends {traced} B of saved tensors per micro-batch "
                         f"(traced), the plan costs {planned} B (extra_send_bytes): the planner's figures for its "
                         f"segment(s) are off by more than {PAYLOAD_TOLERANCE:.0%}")
    return notes
