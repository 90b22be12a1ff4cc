"""`pipecc inspect OUT [--stage I] [--format text|json|dot] [--onnx DIR] [--trace FILE | --run RUN.json] [--report HTML]`.

`--trace FILE` (a trace of `pipecc run OUT --trace FILE`) compares one measured step with the
predicted schedule (`pipecc.report.measured`); `--report HTML` also writes the report page with
the measured Gantt chart under the predicted one (atomically). `--run RUN.json` (the document of
`pipecc run OUT --json`) shows the run's loss per step and its measured samples/s beside the
plan's predicted (`pipecc.report.history`); with `--report HTML` the page has the curves.

Wiring in `pipecc.cli.build_parser`: `add_parser(sub, common)`; it sets `func=cmd_inspect`.
OUT is read as untrusted data (`pipecc.runtime.folder.CompiledFolder.show` checks it): a damaged
folder is a one-line error, and names in it are escaped before they reach the terminal.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipecc.cli.args import check_output_file, stage_index, write_atomic


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "inspect", parents=[common], help="show what a compile made: stages, schedule, graphs",
        description="Read a compiled folder (pipecc compile -o OUT) and show its stages: device, "
        "nodes, FLOPs, parameters, forward/backward time, peak memory, traffic, split layers, the "
        "bottleneck against the lower bound, and the schedule. --stage I lists one stage's graph "
        "node by node. --format json is machine-readable; --format dot is Graphviz "
        "(pipecc inspect OUT --format dot | dot -Tsvg > graph.svg). --onnx DIR also writes each "
        "stage as an ONNX file and checks it with onnxruntime against the torch stage.")
    p.add_argument("out", metavar="OUT", help="a folder written by `pipecc compile`")
    p.add_argument("--stage", type=stage_index, metavar="I", help="details of stage I")
    p.add_argument("--format", choices=["text", "json", "dot"], default="text",
                   help="output format (default text)")
    p.add_argument("--trace", metavar="FILE",
                   help="a trace written by `pipecc run OUT --trace FILE`: compare one steady step as it ran "
                   "with the predicted schedule (both timelines, per-stage medians, the largest differences)")
    p.add_argument("--run", metavar="RUN.json",
                   help="a run document (`pipecc run OUT --json > RUN.json`): its loss per step (first, last, lowest, "
                   "a sparkline and every k-th step) and the measured samples/s beside the predicted")
    p.add_argument("--report", metavar="HTML",
                   help="with --trace: also write the report page to HTML, the measured Gantt chart under the "
                   "predicted one on the same time scale; with --run: the page with the loss curve and the "
                   "samples/s per step against the predicted")
    p.add_argument("--force", action="store_true",
                   help="--report: replace HTML even when pipecc did not write it (never OUT's files or the trace)")
    p.add_argument("--onnx", metavar="DIR",
                   help="write stage_<i>.onnx per stage (or only --stage I) into DIR and check it "
                   "with onnxruntime")
    p.set_defaults(func=cmd_inspect)
    return p


def cmd_inspect(args: argparse.Namespace) -> int:
    from pipecc.errors import UsageError
    from pipecc.report import compiled as insp
    from pipecc.report.dot import dot_text
    from pipecc.report.formatting import terminal_text

    if args.format == "dot" and args.stage is not None and not args.onnx:
        raise UsageError("--format dot draws the whole pipeline; leave out --stage")
    if args.report and not (args.trace or args.run):
        raise UsageError("--report draws a run: give --trace FILE (pipecc run OUT --trace FILE) or --run RUN.json "
                         "(pipecc run OUT --json > RUN.json) too")
    if args.run:
        if args.trace:
            raise UsageError("give one of --trace and --run (each draws its own view of a run)")
        if args.stage is not None or args.onnx or args.format == "dot":
            raise UsageError("--run shows the whole run; leave out --stage, --onnx and --format dot")
        return _show_run(args)
    if args.trace:
        if args.stage is not None or args.onnx or args.format == "dot":
            raise UsageError("--trace compares the whole pipeline; leave out --stage, --onnx and --format dot")
        return _compare_trace(args)
    compiled = insp.load_compiled(args.out)
    if args.onnx:
        return _export_onnx(args, compiled)
    with insp.damaged(compiled):
        if args.format == "json":
            data = (insp.stage_json(compiled, args.stage) if args.stage is not None
                    else insp.summary_json(compiled))
            text = json.dumps(data, indent=1, default=str)  # ensure_ascii: no raw control characters
        elif args.format == "dot":
            text = terminal_text(dot_text(compiled.plan, compiled.graph))
        elif args.stage is not None:
            text = terminal_text(insp.stage_text(compiled, args.stage))
        else:
            text = terminal_text(insp.summary_text(compiled, verbose=args.verbose))
            lengths = compiled.plan.options.get("lengths")
            if lengths:  # a declared length range (pipecc.varlen): the plan's times over it
                text += "\n\n" + terminal_text(lengths_text(lengths))
    print(text)
    return 0


def _compare_trace(args: argparse.Namespace) -> int:
    from pipecc.report import measured as ms
    from pipecc.report.compiled import _ascii_timeline, damaged, load_compiled, timeline_of
    from pipecc.report.formatting import terminal_text
    from pipecc.report.html import report_with_trace

    from pipecc.runtime.outfile import compiled_inputs
    inputs = [*compiled_inputs(args.out), args.trace]
    target = _report_target(args, inputs)
    compiled = load_compiled(args.out)
    with damaged(compiled):
        if target is not None:
            page, text = report_with_trace(args.out, args.trace)
            write_atomic(str(target), page, "--report", inputs, args.force)
        trace = ms.load_trace(args.trace)
        predicted = timeline_of(compiled)
        ms.check_matches(trace, compiled, predicted)
        got = ms.measured_timeline(trace, ms.steady_step(trace))
        if args.format == "json":
            text = json.dumps(ms.trace_json(trace, predicted, got), indent=1)
        else:
            text = terminal_text(ms.trace_text(trace, predicted, got, _ascii_timeline))
    print(text)
    if target is not None and args.format != "json":
        print(f"wrote {target}: the measured Gantt chart under the predicted one")
    return 0


def _report_target(args: argparse.Namespace, inputs: list[Any]) -> Any:
    """--report HTML (None without it), refused in one line where no file can be written and by
    the output-file rule (``pipecc.runtime.outfile``: never one of ``inputs``, never a file pipecc
    did not write without --force)."""
    import os
    from pathlib import Path

    from pipecc.errors import PipeccError
    report = args.report
    if not report:
        return None
    target = Path(report).expanduser()
    parent = Path(os.path.realpath(target)).parent
    if Path(os.path.realpath(target)).is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK):
        raise PipeccError(f"--report {report}: cannot write a file there; give a file in a writable folder")
    check_output_file(report, "--report", inputs, args.force)
    return target


def _show_run(args: argparse.Namespace) -> int:
    from pipecc.report import history as hs
    from pipecc.report.compiled import damaged, load_compiled
    from pipecc.report.formatting import terminal_text
    from pipecc.report.html import report_with_run

    from pipecc.runtime.outfile import compiled_inputs
    inputs = [*compiled_inputs(args.out), args.run]
    target = _report_target(args, inputs)
    compiled = load_compiled(args.out)
    run = hs.load_run(args.run)
    hs.check_folder(run, compiled.path)
    with damaged(compiled):
        if target is not None:
            page, _ = report_with_run(args.out, args.run)
            write_atomic(str(target), page, "--report", inputs, args.force)
    if args.format == "json":
        text = json.dumps(hs.history_json(run), indent=1)
    else:
        text = terminal_text(hs.history_text(run))
    print(text)
    if target is not None and args.format != "json":
        print(f"wrote {target}: the loss curve and the samples/s per step against the predicted")
    return 0


def lengths_text(data: dict[str, Any]) -> str:
    """The stage times over a folder's declared lengths (plan.json's `options["lengths"]`):
    one row per length, each stage's forward + backward seconds and the predicted step."""
    from pipecc.errors import PipeccError
    from pipecc.report.formatting import seconds, text_table
    from pipecc.runtime.lengths import Lengths
    declared = Lengths.from_json(data)
    try:
        rows = [(int(r["length"]), [float(f) + float(b) for f, b in r["stages"]], float(r["step_s"]))
                for r in data.get("table") or []]
        expected = float(data.get("expected_step_s", 0.0))
    except (KeyError, TypeError, ValueError):
        raise PipeccError("plan.json's lengths table is not pipecc's; compile again") from None
    assert declared is not None
    n = len(rows[0][1]) if rows else 0
    head = [declared.symbol] + [f"stage {k} fwd+bwd" for k in range(n)] + ["predicted step"]
    body = [[str(length)] + [seconds(t) for t in times] + [seconds(step)] for length, times, step in rows]
    weights = "equally likely" if len(set(declared.weights)) == 1 else "weighted"
    return (f"lengths --length {declared.declared()}: planned at {declared.symbol}={data.get('planned_at')} (the "
            f"maximum: memory checked there); expected step {seconds(expected)} over the {weights} lengths\n"
            + text_table(head, body, left=1))


def _export_onnx(args: argparse.Namespace, compiled: Any) -> int:
    from pipecc import progress
    from pipecc.errors import PipeccError
    from pipecc.report.formatting import terminal_text
    from pipecc.report.stage_onnx import check_destination, check_stages

    n = len(compiled.plan.stages)
    if args.stage is not None and args.stage >= n:
        raise PipeccError(f"--stage {args.stage}: {compiled.path} has stages 0..{n - 1}")
    stages = [args.stage] if args.stage is not None else list(range(n))
    # the model file's hash, before any of the folder's code runs: a changed one is refused as `run` refuses it
    compiled.folder.model_source()
    check_destination(args.onnx)
    results = []
    with progress.step("exporting stages to ONNX", total=len(stages)) as step:
        for result in check_stages(compiled.path, args.onnx, stages):
            results.append(result)
            step.advance()
    if args.format == "json":
        print(json.dumps([r.to_json() for r in results], indent=1))
    else:
        for r in results:
            print(terminal_text(r.describe()))
    bad = [r for r in results if not r.ok]
    if bad:
        raise PipeccError(f"{len(bad)} stage(s) differ from torch beyond tolerance "
                          f"(stage {', '.join(str(r.stage) for r in bad)})")
    return 0
