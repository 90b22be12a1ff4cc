"""`pipecc cost MODEL`: the symbolic per-node cost table (or JSON) of a model."""

from __future__ import annotations

import argparse
import json
from typing import Any

from pipecc.cli.args import add_model_args


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser("cost", parents=[common], help="symbolic per-node cost of a model",
                              description="Per-node FLOPs (forward/backward), parameter and "
                              "activation bytes as expressions in the batch symbol B.")
    add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--by-module", type=int, default=0, metavar="DEPTH",
                   help="group rows by the first DEPTH components of the module path")
    p.set_defaults(func=cmd_cost)
    return p


def cmd_cost(args: argparse.Namespace) -> int:
    from pipecc import driver
    from pipecc.frontend.modelfile import parse_model_args
    from pipecc.report.formatting import terminal_text
    from pipecc.report.tables import cost_json, cost_table

    from pipecc.cli.args import model_stdout
    with model_stdout(args):  # a print in the model must not corrupt --json
        analysis = driver.analyze(args.model, model_args=parse_model_args(args.model_arg),
                                  batch_size=args.batch_size, symbols=driver.parse_symbols(args.symbol),
                                  debug=args.debug)
    if args.json:
        print(json.dumps(cost_json(analysis.graph), indent=1))
    else:
        print(terminal_text(cost_table(analysis.graph, by_module=args.by_module)))
    return 0
