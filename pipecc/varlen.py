"""Variable sequence lengths at compile time: `pipecc plan/compile --symbol S=0:1 --length S=16..64`.

`declare` checks a `--length` declaration (`pipecc.runtime.lengths` reads it) against the
analysed model and moves the graph's costs to the declared maximum, so the planner chooses the
plan for the longest batch: its memory check is the binding one (activations grow with the
length) and its stage times are the slowest. What it refuses, each in one line: a length symbol
no `--symbol` declares (or B), a dim the captured graph does not keep dynamic (torch.export
specialised it, or a shape that does not follow the symbol), input makers that do not take the
length as `seq_len` or ignore it, and a maximum the model itself refuses (GPT's `block_size`:
the model's error, reported as its input maker raised it).

`length_table` evaluates the chosen plan at every declared length (a range: five evenly spaced
lengths): each stage's forward and backward seconds from the same cost tables the planner used
(`passes.plan_costs.CostTables` at that point of the symbols), and the predicted step, the
planner's `predicted_iteration_s` at the maximum scaled by the bottleneck stage's time (the
steady state of a pipeline runs at its slowest stage's pace). The table, the declaration and
the expected step over the distribution go into plan.json's `options["lengths"]`, which
`pipecc inspect` shows and the compiled folder's pipecc.json records for `pipecc run --length`.
"""

from __future__ import annotations

import dataclasses
import inspect as pyinspect
from typing import Any, Sequence

import torch

from pipecc import cost
from pipecc.errors import PipeccError, UsageError
from pipecc.frontend.modelfile import _call_with_accepted, import_model_file
from pipecc.frontend.torch_capture import SymbolSpec
from pipecc.ir.plan import Plan
from pipecc.techniques import TECHNIQUES
from pipecc.runtime.lengths import LENGTH_ARG, Lengths, parse_declaration

__all__ = ["check_options", "declare", "length_table", "parse"]


def parse(items: Sequence[str] | None, symbols: Sequence[SymbolSpec]) -> Lengths | None:
    """The one `--length` declaration (None without one), checked against the `--symbol`s."""
    if not items:
        return None
    if len(items) > 1:
        raise UsageError(f"--length is given {len(items)} times; declare one length symbol (--length S=LO..HI)")
    lengths = parse_declaration(items[0])
    if lengths.symbol == "B":
        raise UsageError(f"--length {items[0]}: B is the batch size (-b); --length declares a sequence "
                         "symbol of --symbol, e.g. --symbol S=0:1 --length S=16..64")
    if lengths.symbol not in {s.name for s in symbols}:
        raise UsageError(f"--length {items[0]}: no --symbol declares {lengths.symbol}; say which input dim "
                         f"it is, e.g. --symbol {lengths.symbol}=0:1")
    return lengths


def check_options(options: Any, cluster: Any, lengths: Lengths) -> None:
    """The plan features whose folders fix one shape, refused with a declared length."""
    where = f"--length {lengths.declared()}"
    for technique in TECHNIQUES:  # its switches that fix one shape (its `one_shape`), in TECHNIQUES order
        flag = getattr(technique, "one_shape", lambda _: None)(options)
        if flag is not None:
            raise UsageError(f"{where}: {flag} is planned for one length; leave it out with --length")
    if any(dev.kind == "fpga" for dev in cluster.devices):
        raise UsageError(f"{where}: FPGA stages are built for one shape; plan variable lengths on CPUs and GPUs")


def declare(analysis: Any, lengths: Lengths, spec: SymbolSpec, batch_size: int) -> None:
    """Check `lengths` against the analysed model (module docstring); move its costs to the maximum."""
    graph = analysis.graph
    name = lengths.symbol
    where = f"--length {lengths.declared()}"
    if name not in graph.symbols:
        raise PipeccError(f"{where}: dim {spec.dim} of input {spec.inputs[0]} is not dynamic in this model (the "
                          "captured graph only runs at the example's size there: a weight's width, or a Python "
                          f"number taken from it), so {name} cannot vary; declare a sequence dim, or drop --length")
    fixed = [w for w in graph.warnings if w.startswith("shape of ") and "not multilinear" in w]
    if fixed:
        node = fixed[0].removeprefix("shape of ").split(" ")[0]
        raise PipeccError(f"{where}: the shape of node {node} does not follow {name} (kept at its example "
                          f"value), so the graph cannot run other lengths; is dim {spec.dim} of input "
                          f"{spec.inputs[0]} a sequence dim?")
    if analysis.spec is not None:
        _check_input_makers(analysis.spec, lengths, spec, batch_size)
    cost.move_point(graph, {name: lengths.hi})


def _check_input_makers(model_spec: Any, lengths: Lengths, spec: SymbolSpec, batch_size: int) -> None:
    """The model file's example_inputs takes `seq_len` and returns inputs of that length at the
    declared minimum and maximum (what `pipecc run --length` will call)."""
    path = model_spec.path
    module = import_model_file(path)
    maker = module.example_inputs
    params = pyinspect.signature(maker).parameters
    if LENGTH_ARG not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise PipeccError(f"--length {lengths.declared()}: example_inputs in {path.name} takes no {LENGTH_ARG} "
                          f"argument; a run builds each batch with example_inputs(batch_size, {LENGTH_ARG}=L) "
                          f"(and example_target likewise): add {LENGTH_ARG} to them")
    for length in (lengths.lo, lengths.hi):
        args = {**model_spec.model_args, LENGTH_ARG: length}
        try:
            raw = _call_with_accepted(maker, batch_size, **args)
        except Exception as e:
            raise PipeccError(f"--length {lengths.declared()}: example_inputs in {path.name} failed at "
                              f"{LENGTH_ARG}={length}: {type(e).__name__}: {e}") from None
        values = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
        for i in spec.inputs:
            x = values[i] if i < len(values) else None
            got = x.shape[spec.dim] if isinstance(x, torch.Tensor) and x.dim() > spec.dim else None
            if got != length:
                raise PipeccError(f"--length {lengths.declared()}: example_inputs in {path.name} at "
                                  f"{LENGTH_ARG}={length} gives input {i} a dim {spec.dim} of {got}, not "
                                  f"{length}; is {lengths.symbol} dim {spec.dim} of input {i}?")


def length_table(plan: Plan, graph: Any, cluster: Any, options: Any, lengths: Lengths) -> dict[str, Any]:
    """plan.json's `options["lengths"]`: the declaration and the plan's times at each length."""
    from pipecc.techniques.replicas import search as rep
    from pipecc.passes import split_search
    from pipecc.passes.plan_costs import CostTables
    from pipecc.passes.plan_options import PlanOptions
    opts = PlanOptions.of(options, batch_size=plan.batch_size)
    d = plan.replicas if isinstance(plan.replicas, int) else 1
    mb = rep.slice_size(plan.batch_size // plan.microbatches, d)
    symbol = graph.symbols[lengths.symbol]
    planned = int(graph.point[symbol])
    rows = []
    for length in sorted({*lengths.values, planned}):
        at = dataclasses.replace(graph, point={**graph.point, symbol: length})
        tables = CostTables(at, cluster, opts, splittable=split_search.splittable_names(at))
        units = tables.builder.at(mb)
        fwd, bwd = tables.times(units, mb)
        unit_of = {names[-1]: u for u, names in enumerate(units.names)}
        stages = []
        for stage in plan.stages:
            us = sorted({unit_of[n] for n in stage.nodes if n in unit_of})
            dev = stage.device
            per_f, per_b = tables.stage_fixed(dev)  # the stage's per-micro-batch fixed part, as plan_emit adds
            stages.append([float(fwd[dev, us].sum()) + per_f, float(bwd[dev, us].sum()) + per_b])
        rows.append({"length": length, "stages": stages})
    top = next(r for r in rows if r["length"] == planned)
    slowest = max(sum(s) for s in top["stages"]) or 1.0
    for row in rows:  # the planner's figure at the maximum, scaled by the bottleneck's time
        row["step_s"] = plan.predicted_iteration_s * max(sum(s) for s in row["stages"]) / slowest
    steps = {r["length"]: r["step_s"] for r in rows}
    expected = sum(w * steps[v] for v, w in zip(lengths.values, lengths.weights))
    return {**lengths.to_json(), "planned_at": planned, "expected_step_s": expected, "table": rows}
