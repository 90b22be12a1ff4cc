"""`pipecc compile MODEL --devices SPEC -o OUT`: plan the model and write its pipeline."""

from __future__ import annotations

import argparse
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
    from pipecc import driver, progress
    args.compare = True  # the report shows the baselines' figures
    analysis, plan, graph = plan_from_args(args)
    for decision in plan.decisions:
        progress.explain(decision)
    done = driver.compile(analysis, plan, graph, args.output, force=args.force,
                          fpga_number=args.fpga_number, debug=args.debug, dump_ir=args.dump_ir)
    if not args.quiet:
        print(f"wrote {done.out}: {len(done.stages)} stages, schedule {plan.schedule}, "
              f"{plan.microbatches} micro-batches; run it with `pipecc run {args.output}`")
        for line in done.notes:
            print(line)
    return 0
