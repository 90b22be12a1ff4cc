"""`pipecc compile MODEL --devices SPEC -o OUT`: plan the model and write its pipeline."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pipecc.cli.args import add_model_args, add_plan_args
from pipecc.cli.plan import plan_from_args


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "compile", parents=[common], help="plan and write the pipeline's code",
        description="Plan the model and write OUT: plan.json, one readable stage.py (+ "
        "safetensors weights) per stage, and run_stage.py for torchrun.")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder")
    p.add_argument("--force", action="store_true",
                   help="write into OUT even if pipecc did not write it, replacing the files in the "
                   "way (named on stderr); files pipecc did not write are never deleted otherwise")
    p.add_argument("--strict-batchnorm", action="store_true",
                   help="refuse BatchNorm in training mode over several micro-batches (each "
                   "micro-batch is normalised with its own statistics) instead of warning")
    p.set_defaults(func=cmd_compile)
    return p


def _check_dumps_outside(args: argparse.Namespace) -> None:
    """--dump-ir inside OUT would write files pipecc's manifest does not list into OUT before it
    is replaced: the next compile would take OUT for a foreign folder. Refused as a usage error."""
    if not getattr(args, "dump_ir", None):
        return
    from pathlib import Path

    from pipecc.errors import UsageError
    out, dumps = Path(os.path.abspath(args.output)), Path(os.path.abspath(args.dump_ir))
    if dumps == out or out in dumps.parents:
        raise UsageError(f"--dump-ir {args.dump_ir} is inside -o {args.output}, which pipecc replaces as a "
                         "whole; give a folder outside it")


def cmd_compile(args: argparse.Namespace) -> int:
    from pipecc import driver, progress
    from pipecc.backends.torch.compile import check_output_folder
    from pipecc.report.figures import cost_basis
    from pipecc.report.formatting import count, seconds, seconds_in_text, terminal_text, wrap
    from pipecc.techniques import parts as technique_parts
    check_output_folder(args.output, args.force)  # now, not after minutes of analysis
    _check_dumps_outside(args)
    args.compare = True  # the report shows the baselines' figures
    analysis, plan, graph = plan_from_args(args)
    for decision in plan.decisions:
        progress.explain(seconds_in_text(decision))
    done = driver.compile(analysis, plan, graph, args.output, force=args.force,
                          fpga_number=args.fpga_number, strict_batchnorm=args.strict_batchnorm,
                          debug=args.debug, dump_ir=args.dump_ir)
    for line in done.notes:  # warnings reach stderr even with -q
        if line.startswith("warning:"):
            print(terminal_text(f"pipecc: {line}"), file=sys.stderr)
    if not args.quiet:
        groups = f" x {plan.replicas} replicas" if plan.replicas > 1 else ""
        given = int(plan.options.get("devices_given") or len(plan.devices))
        lines = [f"wrote {done.out}: {count(len(done.stages), 'stage')}{groups}, schedule {plan.schedule}, "
                 f"{count(plan.microbatches, 'micro-batch')}; run it with `pipecc run {args.output}`"]
        if len(plan.devices) < given:
            lines.append(f"uses {len(plan.devices)} of the {given} devices given: more would not pay, the "
                         "planner found (`pipecc plan -v` says why; --use-all-devices uses every one)")
        lines.append(f"predicted {seconds(plan.predicted_iteration_s)} per iteration, from {cost_basis(plan)}")
        print(terminal_text(lines[0]))  # NOTE: one line whatever its length (scripts read it); the rest wrap
        for line in lines[1:]:
            print(terminal_text("\n".join(wrap(line))))
        report = Path(done.out) / "report.html"
        if report.is_file():
            opener = "open" if sys.platform == "darwin" else "xdg-open"  # NOTE: `open` on Linux is openvt
            print(terminal_text(f"report: {report} (`{opener} {report}` or any browser)"))
        for part in technique_parts("report"):  # a technique's words on what it shipped (Bi-Partition's segments)
            for line in part.compiled_lines(plan) if hasattr(part, "compiled_lines") else []:
                print(terminal_text(line))
        for line in done.notes:
            if not line.startswith("warning:"):
                print(terminal_text(line))
    return 0
