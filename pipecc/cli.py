"""The `pipecc` command line (CONTRACT §4).

Every command exits 0 on success, 2 on a usage error and 1 on any other error, printing one
`pipecc: error: ...` line on stderr; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

from pipecc.errors import PipeccError, UsageError


class _Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one `pipecc: error:` line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help="a .py model file (CONTRACT §2) or an .onnx file")
    p.add_argument("--batch-size", "-b", type=_positive_int, default=1, metavar="B",
                   help="example batch size (the value of the symbol B; default 1)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword argument for build_model (repeatable)")
    p.add_argument("--symbol", action="append", metavar="NAME=INPUT:DIM",
                   help="mark another symbolic dimension, e.g. S=0:1 (dim 1 of input 0)")


def _microbatches(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", "-d", required=True, metavar="SPEC",
                   help="devices in pipeline order: 4xa100,2xu250 | a100@cuda:1 | @cluster.toml")
    p.add_argument("--microbatches", "-m", type=_microbatches, default="auto", metavar="M|auto")
    p.add_argument("--schedule", choices=["auto", "gpipe", "1f1b", "interleaved"], default="auto")
    p.add_argument("--coarse", action="store_true", help="cut only at block boundaries")
    p.add_argument("--choose-order", action="store_true",
                   help="let pipecc order the devices (interchangeable types)")
    p.add_argument("--no-split-layers", action="store_true", help="never split a layer across devices")
    p.add_argument("--inference", action="store_true", help="plan forward passes only")
    p.add_argument("--fpga-number", default="float", metavar="FORMAT",
                   help="number format of FPGA stages: float or ap_fixed<W,I> (default float); "
                   "the plan costs FPGA stages in it")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="pipecc", description="pipecc: a pipeline-parallel compiler for "
                     "deep-learning models (cost, plan, compile, run, inspect).")
    parser.add_argument("--version", action="version", version="pipecc " + _version())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and verify the IR after each pass")
    common.add_argument("-v", "--verbose", action="store_true", help="explain decisions")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p = sub.add_parser("cost", parents=[common], help="symbolic per-node cost of a model",
                       description="Per-node FLOPs (forward/backward), parameter and activation "
                       "bytes as expressions in the batch symbol B.")
    _add_model_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON document (CONTRACT §5)")
    p.add_argument("--by-module", type=int, default=0, metavar="DEPTH",
                   help="group rows by the first DEPTH components of the module path")
    p.set_defaults(func=cmd_cost)

    p = sub.add_parser("plan", parents=[common], help="split a model into pipeline stages",
                       description="Balance the model over the devices: stages, schedule, "
                       "micro-batches, split layers, with the bottleneck against a proven bound.")
    _add_model_args(p)
    _add_plan_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (CONTRACT §5)")
    p.add_argument("-o", "--output", metavar="PLAN_JSON", help="also write the plan JSON here")
    p.add_argument("--compare", action="store_true",
                   help="add the baselines' partitions (equal count, equal params, torchgpipe)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("compile", parents=[common], help="plan and write the pipeline's code",
                       description="Plan the model and write OUT: plan.json, one readable "
                       "stage.py (+ safetensors weights) per stage, and run_stage.py for torchrun.")
    _add_model_args(p)
    _add_plan_args(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder")
    p.add_argument("--force", action="store_true", help="replace OUT even if pipecc did not write it")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("devices", parents=[common], help="list the device and link catalog",
                       description="The device and link catalog with every figure's source.")
    p.add_argument("--json", action="store_true", help="print the catalog as JSON")
    p.set_defaults(func=cmd_devices)

    from pipecc import csim_cmd, inspect_cmd, run_cmd
    run_cmd.add_parser(sub, common)
    inspect_cmd.add_parser(sub, common)
    csim_cmd.add_parser(sub, common)
    return parser


def _version() -> str:
    from pipecc import __version__
    return __version__


def cmd_cost(args: argparse.Namespace) -> int:
    from pipecc import driver
    from pipecc.cost_report import cost_json, cost_table
    from pipecc.modelfile import parse_model_args

    analysis = driver.analyze(args.model, model_args=parse_model_args(args.model_arg),
                              batch_size=args.batch_size, symbols=driver.parse_symbols(args.symbol),
                              debug=args.debug)
    if args.json:
        print(json.dumps(cost_json(analysis.graph), indent=1))
    else:
        print(cost_table(analysis.graph, by_module=args.by_module))
    return 0


def _plan_from_args(args: argparse.Namespace):
    from pipecc import driver
    from pipecc.modelfile import parse_model_args
    analysis = driver.analyze(args.model, model_args=parse_model_args(args.model_arg),
                              batch_size=args.batch_size, symbols=driver.parse_symbols(args.symbol),
                              debug=args.debug)
    plan, graph = driver.plan(analysis, args.devices, microbatches=args.microbatches,
                              schedule=args.schedule, coarse=args.coarse,
                              choose_order=args.choose_order,
                              split_layers=not args.no_split_layers,
                              compare=getattr(args, "compare", False),
                              training=not args.inference,
                              fpga_number=args.fpga_number, debug=args.debug)
    plan.model_path = str(Path(args.model).resolve())
    plan.model_args = parse_model_args(args.model_arg)
    return analysis, plan, graph


def cmd_plan(args: argparse.Namespace) -> int:
    from pipecc import progress
    from pipecc.plan_report import plan_table
    _, plan, _ = _plan_from_args(args)
    for decision in plan.decisions:
        progress.explain(decision)
    if args.output:
        _write_atomic(args.output, plan.dumps() + "\n")
    if args.json:
        print(plan.dumps())
    else:
        print(plan_table(plan, verbose=args.verbose))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from pipecc import fpga_compile, progress
    from pipecc.backends.torch import cut_stages, write_output
    from pipecc.inspect import graph_json, timeline_json
    from pipecc.report import render_report, timeline_for
    args.compare = True  # the report shows the baselines' figures
    analysis, plan, graph = _plan_from_args(args)
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


def _write_atomic(path: str, text: str) -> None:
    import os
    import tempfile
    from pathlib import Path
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=".pipecc-", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cmd_devices(args: argparse.Namespace) -> int:
    from pipecc import devices
    if args.json:
        print(json.dumps(devices.catalog_json(), indent=1))
    else:
        print(devices.format_catalog())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    try:
        args = parser.parse_args(argv)
        from pipecc import progress
        progress.configure(quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False))
        if not getattr(args, "func", None):
            parser.print_help(sys.stderr)
            return 2
        func: Callable[[argparse.Namespace], Any] = args.func
        return int(func(args) or 0)
    except PipeccError as exc:
        if debug:
            traceback.print_exc()
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"pipecc: error: {message}", file=sys.stderr)
        return exc.exit_code
    except BrokenPipeError:  # `pipecc ... | head`
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("pipecc: error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
