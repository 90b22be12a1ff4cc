"""`pipecc inspect OUT [--stage I] [--format text|json|dot] [--onnx DIR]`.

Wiring in `pipecc.cli.build_parser`: `add_parser(sub, common)`; it sets `func=cmd_inspect`.
OUT is read as untrusted data (`pipecc.report.compiled.load_compiled` checks it): a damaged
folder is a one-line error, and names in it are escaped before they reach the terminal.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipecc.cli.args import stage_index


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
    from pipecc.report.stage_onnx import check_destination, check_stages, trusted_model_source

    n = len(compiled.plan.stages)
    if args.stage is not None and args.stage >= n:
        raise PipeccError(f"--stage {args.stage}: {compiled.path} has stages 0..{n - 1}")
    stages = [args.stage] if args.stage is not None else list(range(n))
    trusted_model_source(compiled.path)  # before any of the folder's code runs: refused as `run` refuses it
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
