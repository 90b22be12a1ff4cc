"""The driver: the passes pipecc runs, top to bottom.

    load model file ─► capture (fx → export fallback, or ONNX import) ─► shapes ─► ops/names
                    ─► costs ─► [plan: balance ─► schedule] ─► [codegen]

Each step is a plain function in its own module; this file only sequences them and runs the
IR verifier between them when `debug` is set (tests always set it).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from pipecc import cost
from pipecc.frontend import torch_capture
from pipecc.errors import PipeccError, UsageError
from pipecc.ir.graph import AnnotatedGraph, verify
from pipecc.frontend.modelfile import ModelSpec, load_model_file


@dataclass
class Analysis:
    """A costed graph and, for .py models, the model it came from."""

    graph: AnnotatedGraph
    spec: ModelSpec | None  # None for ONNX files


def parse_symbols(items: Sequence[str] | None) -> list[torch_capture.SymbolSpec]:
    """`--symbol S=0:1` marks dim 1 of input 0 as the symbol S (inputs may be a+b lists)."""
    out = []
    for item in items or []:
        name, sep, where = item.partition("=")
        inputs, sep2, dim = where.partition(":")
        try:
            assert sep and sep2 and name.isidentifier()
            spec = torch_capture.SymbolSpec(name, tuple(int(i) for i in inputs.split("+")), int(dim))
        except (AssertionError, ValueError):
            raise UsageError(f"--symbol {item!r} is not NAME=INPUT:DIM (example: --symbol S=0:1)") from None
        out.append(spec)
    return out


def analyze_module(model: torch.nn.Module, example_inputs: tuple, *, model_name: str = "model",
                   symbols: Sequence[torch_capture.SymbolSpec] = (), debug: bool = False) -> AnnotatedGraph:
    """Capture, annotate and cost an in-memory module."""
    first = next((x for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0), None)
    batch = int(first.shape[0]) if first is not None else 1
    syms = torch_capture.default_symbols(tuple(example_inputs), batch) + list(symbols)
    graph = torch_capture.from_module(model, tuple(example_inputs), symbols=syms, model_name=model_name)
    if debug:
        verify(graph)
    cost.annotate(graph)
    if debug:
        verify(graph, costed=True)
    return graph


def analyze(path: str | Path, *, model_args: dict[str, Any] | None = None, batch_size: int = 1,
            symbols: Sequence[torch_capture.SymbolSpec] = (), debug: bool = False) -> Analysis:
    """Load a model file (.py or .onnx) and return its costed graph."""
    path = Path(path)
    if batch_size < 1:
        raise UsageError(f"--batch-size must be a positive integer, got {batch_size}")
    if path.suffix == ".onnx":
        if model_args:
            raise UsageError("--model-arg applies to .py model files, not ONNX files")
        from pipecc import progress
        from pipecc.frontend import onnx_import
        with progress.step(f"importing {path.name}"):
            graph = onnx_import.from_onnx(path, batch_size=batch_size)
        if debug:
            verify(graph)
        cost.annotate(graph)
        if debug:
            verify(graph, costed=True)
        return Analysis(graph, None)
    from pipecc import progress
    with progress.step(f"building {path.name}"):
        spec = load_model_file(path, model_args, batch_size=batch_size)
    with progress.step(f"tracing {path.name}"):
        graph = analyze_module(spec.model, spec.example_inputs, model_name=path.stem,
                               symbols=symbols, debug=debug)
    if graph.batch_size != batch_size and "B" in graph.symbols:
        raise PipeccError(f"example_inputs({batch_size}) returned a batch of {graph.batch_size}")
    return Analysis(graph, spec)


def plan(analysis: Analysis | AnnotatedGraph, devices: Any, *, batch_size: int | None = None,
         microbatches: int | str = "auto", schedule: str = "auto", coarse: bool = False,
         choose_order: bool = False, split_layers: bool = True, compare: bool = False,
         training: bool = True, dtype: str = "fp32", fpga_number: str | None = None,
         debug: bool = False):
    """Balance a costed graph over devices. Returns (plan, graph) — the graph may have been
    rewritten by intra-layer splitting, and the plan's node names refer to it."""
    from pipecc.targets.devices import Cluster, DeviceSpecError, parse_devices
    from pipecc.passes.balance import PlanOptions, Balancer
    graph = analysis.graph if isinstance(analysis, Analysis) else analysis
    try:
        cluster = devices if isinstance(devices, Cluster) else parse_devices(devices)
    except DeviceSpecError as exc:
        raise UsageError(str(exc)) from exc
    if schedule not in ("auto", "gpipe", "1f1b", "interleaved"):
        raise UsageError(f"--schedule {schedule!r}: choose auto, gpipe, 1f1b or interleaved")
    if fpga_number is not None:
        from pipecc.targets.fpga_model import parse_number
        parse_number(fpga_number)  # a bad format is an error even without FPGA devices
    options = PlanOptions(batch_size=batch_size or graph.batch_size, microbatches=microbatches,
                          schedule=schedule, coarse=coarse, choose_order=choose_order,
                          split_layers=split_layers, compare=compare, training=training,
                          dtype=dtype, fpga_number=fpga_number)
    from pipecc.passes import split_search
    splittable = split_search.splittable_names(graph) if split_layers else []
    from pipecc import progress
    balancer = Balancer(graph, cluster, options, splittable=splittable)
    with progress.step(f"planning on {len(cluster.devices)} devices"):
        result, cand = balancer.run()
    if split_layers and splittable and len(cluster.devices) > 1:
        # NOTE: splitting can reorder schedules (interleaved, with twice the stages, gains
        # most: 20% on GPT-2 at 8 devices), so the best candidate of every schedule is
        # split and the fastest result kept (at most three split searches)
        tried: list[tuple[Any, AnnotatedGraph]] = []
        for cand_k in balancer.contenders():
            plan_k = result if cand_k is cand else balancer.to_plan(cand_k, balancer.alternatives(cand_k))
            notes: list[str] = []
            fixed = dict(schedule=plan_k.schedule, microbatches=plan_k.microbatches)

            def replan(g: AnnotatedGraph, keep: bool, fixed=fixed):
                opts = PlanOptions(**{**options.__dict__, **(fixed if keep else {}), "compare": False})
                return Balancer(g, cluster, opts, splittable=split_search.splittable_names(g)).run()[0]

            times = balancer.unit_times(cand_k)
            with progress.step(f"splitting layers ({plan_k.schedule}, {plan_k.microbatches} "
                               "micro-batches)"):
                plan_k, graph_k = split_search.search(graph, plan_k, replan,
                                                      lambda n, t=times: t.get(n, 0.0),
                                                      note=notes.append)
            plan_k.decisions += notes
            tried.append((plan_k, graph_k))
        tried.sort(key=lambda r: r[0].predicted_iteration_s)
        result, graph = tried[0]
        for other, _ in tried[1:]:
            result.decisions.append(
                f"after layer splitting, {other.schedule} with {other.microbatches} micro-batches "
                f"predicts {other.predicted_iteration_s:.4g} s per iteration vs "
                f"{result.predicted_iteration_s:.4g} s")
    if debug:
        verify(graph, costed=True)
    return result, graph
