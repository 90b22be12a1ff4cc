"""Bi-Partition plans in the torch backend ("ship" mode, `pipecc.runtime.segments`): what a
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
(their folders run the forward ranges). Nothing of this runs code at compile time: the segments'
forward/backward graphs are traced by the runtime on both workers (`pipecc.runtime.segments`).

Refused in one line (`check_bipartition`), nothing written: mode "recompute" (costed only: with
recomputation a misplaced segment's forward runs twice, never faster than the single cut at c_j,
spec §3.2), an empty core, a segment holding the model's last node, BatchNorm (buffers training
mutates) or a non-tensor value at its boundary; schedules other than 1f1b and gpipe, replicas,
unequal micro-batches, FPGA stages, recomputed stages, split layers and tied weights.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from pipecc.backends.torch.codegen import generate_stage
from pipecc.backends.torch.stages import Stage, cut_stages, port_json, ports_json
from pipecc.errors import PipeccError
from pipecc.ir.graph import META_NAME, AnnotatedGraph, TensorInfo
from pipecc.ir.plan import Plan

SCHEDULES = ("1f1b", "gpipe")
FIX = "plan with --bipartition off"


def uses_bipartition(plan: Plan) -> bool:
    """True when the compiled folder needs Bi-Partition workers (a training plan whose backward
    ranges differ from its forward ranges)."""
    return plan.schedule != "inference" and (plan.is_bipartition() or plan.bipartition_mode == "recompute")


def check_bipartition(graph: AnnotatedGraph, plan: Plan) -> list[tuple[str, int, int, list[str]]]:
    """The plan's pieces, or a one-line PipeccError for a Bi-Partition plan the runtime cannot
    execute (module docstring). [] for a plan without Bi-Partition."""
    if not uses_bipartition(plan):
        return []
    mode = plan.bipartition_mode
    if mode == "recompute":
        raise PipeccError("bipartition_mode 'recompute' is costed only, the runtime ships saved tensors instead "
                          "(with recomputation a misplaced segment's forward runs twice, never faster than the "
                          f"single cut); {FIX} or re-plan with mode 'ship'")
    if mode != "ship":
        raise PipeccError(f"the plan has backward ranges unlike its forward ranges but bipartition_mode {mode!r}; "
                          f"the runtime runs mode 'ship' only: {FIX}")
    pieces = plan.bipartition_pieces()  # a PipeccError for an empty core or a bad cover
    problems = [
        (plan.schedule not in SCHEDULES, f"schedule {plan.schedule!r} (Bi-Partition runs 1f1b and gpipe only)"),
        (plan.replicas != 1, f"replicas {plan.replicas}"),
        (plan.microbatch_sizes is not None and len({b for row in plan.microbatch_sizes for b in row}) > 1,
         "unequal micro-batch sizes"),
        (bool(plan.fpga_stages()), f"an FPGA stage ({next(iter(plan.fpga_stages().values()), '')})"),
        (any(s.recompute for s in plan.stages), "recomputed stages (--recompute)"),
        (bool(plan.split_layers), "split layers"),
    ]
    for bad, what in problems:
        if bad:
            raise PipeccError(f"a Bi-Partition plan cannot run with {what}; {FIX}")
    last = [n for s in plan.stages for n in s.nodes][-1]
    modules = dict(graph.gm.named_modules())
    by_name = {n.meta.get(META_NAME): n for n in graph.gm.graph.nodes if META_NAME in n.meta}
    for kind, fp, bp, nodes in pieces:
        if kind != "segment":
            continue
        where = f"the segment from {nodes[0]!r} (forward on stage {fp}, backward on stage {bp})"
        if last in nodes:
            raise PipeccError(f"{where} holds the model's last node {last!r}; {FIX}")
        for name in nodes:
            node = by_name.get(name)
            target = modules.get(str(node.target)) if node is not None and node.op == "call_module" else None
            if isinstance(target, nn.modules.batchnorm._BatchNorm) or (
                    node is not None and "batch_norm" in str(node.target)):
                raise PipeccError(f"{where} holds BatchNorm {name!r}, whose running statistics its forward "
                                  f"worker's replica would update; {FIX}")
    return pieces


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
    from safetensors.torch import save_file

    cut = cut_pieces(graph, pieces)
    n = len(stages)
    core_of = {fp: i for i, (kind, fp, _, _) in enumerate(pieces) if kind == "core"}
    segments = {min(fp, bp): i for i, (kind, fp, bp, _) in enumerate(pieces) if kind == "segment"}

    def save(path: Path, tensors: dict[str, torch.Tensor], what: str) -> None:
        save_file({k: t.detach().to("cpu").contiguous().clone() for k, t in tensors.items()}, str(path),
                  metadata={"format": "pt", "pipecc.stage": what})

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
