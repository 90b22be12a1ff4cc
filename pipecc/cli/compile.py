"""`pipecc compile MODEL --devices SPEC -o OUT`: plan the model and write its pipeline."""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("--force", action="store_true", help="replace OUT even if pipecc did not write it")
    p.set_defaults(func=cmd_compile)
    return p


def cmd_compile(args: argparse.Namespace) -> int:
    from pipecc import progress
    from pipecc.backends.fpga import output as fpga_compile
    from pipecc.backends.torch import cut_stages, write_output
    from pipecc.report.compiled import graph_json, timeline_json
    from pipecc.report.html import render_report, timeline_for
    args.compare = True  # the report shows the baselines' figures
    analysis, plan, graph = plan_from_args(args)
    for decision in plan.decisions:
        progress.explain(decision)
    timeline = timeline_for(plan)
    stages = cut_stages(graph, plan.stage_of())
    with progress.step("writing report"):
        extra = {"graph.json": json.dumps(graph_json(graph, plan), indent=1),
                 "timeline.json": json.dumps(timeline_json(timeline)),
                 "report.html": render_report(graph, plan, timeline)}
    writers = fpga_compile.writers(graph, plan, stages,
                                   analysis.spec.example_inputs if analysis.spec else None,
                                   number=args.fpga_number)
    out = write_output(args.output, graph, plan, stages, force=args.force, extra_files=extra,
                       writers=writers)
    if not args.quiet:
        print(f"wrote {out}: {len(stages)} stages, schedule {plan.schedule}, "
              f"{plan.microbatches} micro-batches; run it with `pipecc run {args.output}`")
        for line in fpga_compile.notes(plan, args.output):
            print(line)
    return 0
