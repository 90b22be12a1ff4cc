"""`pipecc plan MODEL --devices SPEC`: balance a model over devices and print the plan."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from pipecc.cli.args import add_model_args, add_plan_args, check_output_file, model_stdout, write_atomic


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan", parents=[common], help="split a model into pipeline stages",
        description="Balance the model over the devices: stages, schedule, micro-batches, split "
        "layers, with the bottleneck against a proven bound.")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("-o", "--output", metavar="PLAN_JSON", help="also write the plan JSON here")
    p.add_argument("--force", action="store_true",
                   help="-o: replace PLAN_JSON even when pipecc did not write it (never an input of the command)")
    p.add_argument("--compare", action="store_true",
                   help="add the baselines' partitions (equal count, equal params, torchgpipe)")
    p.set_defaults(func=cmd_plan)
    return p


def check_plan_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(cluster, profile): what needs no model, checked before the analysis (which takes
    seconds to minutes), so a misspelled device name is one line at once: the devices (names,
    counts, a cluster file), --replicas against them, --fpga-number, the --profile file and
    the devices it timed. driver.plan checks them again (the Python API has no CLI)."""
    from pipecc.errors import UsageError
    from pipecc.targets.devices import DeviceSpecError, parse_devices
    try:
        cluster = parse_devices(args.devices)  # at once: nothing here imports torch
    except DeviceSpecError as exc:
        raise UsageError(str(exc)) from exc
    from pipecc.targets.fpga_model import parse_number  # NOTE: these import torch (seconds)
    parse_number(args.fpga_number)
    if args.replicas != "auto":
        from pipecc.techniques.replicas.search import check_requested
        check_requested(args.replicas, len(cluster.devices), cluster.devices)
    profile = None
    if args.profile is not None:
        from pipecc.targets.profiled import check_devices, load_profile
        profile = load_profile(args.profile)
        check_devices(profile, cluster)
    return cluster, profile


def check_calibrate(args: argparse.Namespace, cluster: Any) -> Any:
    """--calibrate RUN.json loaded and checked against the devices and the model file, before the
    analysis (`pipecc.targets.calibrated`; driver.plan checks it again, with the graph); None
    without the flag."""
    if getattr(args, "calibrate", None) is None:
        return None
    from pipecc.frontend.modelfile import parse_model_args
    from pipecc.targets.calibrated import check_devices, check_model_file, load_run
    calibration = load_run(args.calibrate)
    check_devices(calibration, cluster)
    if Path(args.model).is_file():
        check_model_file(calibration, args.model, parse_model_args(args.model_arg))
    return calibration


def options_from_args(args: argparse.Namespace, profile: Any = None, calibrate: Any = None):
    """The command line's plan options as one `PlanOptions` (where they are checked), from the
    flags of `add_plan_args` (`pipecc plan`, `pipecc compile`); `profile` as `check_plan_args`
    loaded it, `calibrate` as `check_calibrate` did."""
    from pipecc.passes.plan_options import PlanOptions, switches
    return PlanOptions(microbatches=args.microbatches, schedule=args.schedule, coarse=args.coarse,
                       choose_order=args.choose_order, split_layers=not args.no_split_layers,
                       compare=getattr(args, "compare", False), training=not args.inference,
                       fpga_number=args.fpga_number, profile=profile, replicas=args.replicas,
                       flash_attention=args.flash_attention, calibrate=calibrate,
                       precision=getattr(args, "precision", "fp32"),
                       use_all_devices=getattr(args, "use_all_devices", False),
                       **{option.dest: getattr(args, option.dest) for option in switches()})


def plan_from_args(args: argparse.Namespace):
    """(analysis, plan, graph) for the model and plan options on the command line."""
    cluster, profile = check_plan_args(args)  # NOTE: first: importing the driver imports torch (seconds)
    calibrate = check_calibrate(args, cluster)
    from pipecc import driver, varlen
    from pipecc.frontend.modelfile import parse_model_args
    options = options_from_args(args, profile, calibrate)
    symbols = driver.parse_symbols(args.symbol)
    lengths = varlen.parse(getattr(args, "length", None), symbols)
    if lengths is not None:
        varlen.check_options(options, cluster, lengths)
    analysis = driver.analyze(args.model, model_args=parse_model_args(args.model_arg),
                              batch_size=args.batch_size, symbols=symbols,
                              debug=args.debug, dump_ir=args.dump_ir)
    if lengths is not None:  # the plan is chosen at the maximum length
        varlen.declare(analysis, lengths, next(s for s in symbols if s.name == lengths.symbol), args.batch_size)
    plan, graph = driver.plan(analysis, cluster, options, debug=args.debug, dump_ir=args.dump_ir)
    plan.model_path = str(Path(args.model).resolve())
    plan.model_args = parse_model_args(args.model_arg)
    if lengths is not None:
        resolved, planned_on = driver.resolve_options(options, analysis, cluster)
        plan.options["lengths"] = varlen.length_table(plan, graph, planned_on, resolved, lengths)
    return analysis, plan, graph


def plan_inputs(args: argparse.Namespace) -> list[Any]:
    """The files `pipecc plan` reads, which its -o never replaces."""
    return [args.model, getattr(args, "profile", None), getattr(args, "calibrate", None)]


def cmd_plan(args: argparse.Namespace) -> int:
    from pipecc import progress
    from pipecc.report.formatting import seconds_in_text, terminal_text
    from pipecc.report.text import plan_table
    if args.output:
        check_output_file(args.output, "-o", plan_inputs(args), args.force)  # now, not after minutes
    with model_stdout(args):  # a print in the model must not corrupt --json
        _, plan, _ = plan_from_args(args)
    if args.json:  # NOTE: otherwise the -v table lists the decisions: once is enough
        for decision in plan.decisions:
            progress.explain(seconds_in_text(decision))
    if args.output:
        write_atomic(args.output, plan.dumps() + "\n", "-o", plan_inputs(args), args.force)
    if args.json:
        print(plan.dumps())
    else:
        print(terminal_text(plan_table(plan, verbose=args.verbose)))
    return 0
