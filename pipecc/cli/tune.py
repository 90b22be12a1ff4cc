"""`pipecc tune MODEL --devices SPEC -o OUT`: measure the planner's best candidates, keep the fastest.

    pipecc tune MODEL --devices SPEC -o OUT [-k K] [--steps N] [--budget-s S] [--timeout S]
                      [--json] [--force] [plan options]

The planner's top K distinct candidates (its choice first) and the baselines that fit
(equal-count, torch.distributed.pipelining's split, data parallelism) are each compiled into a
work folder and run N steps (`pipecc run --json`, `pipecc.tuning`); a table of predicted vs
measured step time goes to stdout (`--json`: one document), a counter of candidates to stderr.
The measured fastest is compiled as OUT, a normal compiled folder whose plan.json decisions start
with `tuned: ...`. A candidate that fails or hangs is a row saying so; if none could be measured,
nothing is written and the command fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipecc.cli.args import add_model_args, add_plan_args, positive_float, positive_int

DEFAULT_K, DEFAULT_STEPS, DEFAULT_TIMEOUT_S = 3, 3, 60.0


def _k(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of candidates, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"tune at least 1 candidate, got {value} (-k 1 measures the planner's choice)")
    return value


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "tune", parents=[common], help="measure the planner's best plans and keep the fastest",
        description="Compile the planner's K best distinct plans and the baselines that fit "
        "(equal-count, torch.distributed.pipelining's split, data parallelism), run each a few steps on "
        "this machine, print predicted vs measured step time, and write the measured fastest as OUT. "
        "A candidate that fails or hangs is reported and skipped.")
    add_model_args(p)
    add_plan_args(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="output folder (the fastest plan)")
    p.add_argument("-k", type=_k, default=DEFAULT_K, metavar="K",
                   help=f"planner candidates to measure, its choice first (default {DEFAULT_K}); the "
                   "baselines come on top")
    p.add_argument("--steps", type=positive_int, default=DEFAULT_STEPS, metavar="N",
                   help=f"steps each candidate runs, the first left out as warm-up (default {DEFAULT_STEPS})")
    p.add_argument("--budget-s", type=positive_float, metavar="S",
                   help="start no new candidate after S seconds (the planner's choice always runs; "
                   "default: no budget)")
    p.add_argument("--timeout", type=positive_float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"a candidate's ranks wait S seconds for a peer (default {DEFAULT_TIMEOUT_S:g}); one "
                   "with no result after 2 S + 30 s is stopped and reported as timed out")
    p.add_argument("--json", action="store_true", help="print the table as one JSON document")
    p.add_argument("--force", action="store_true",
                   help="write into OUT even if pipecc did not write it (as `pipecc compile --force`)")
    p.set_defaults(func=cmd_tune)
    return p


def cmd_tune(args: argparse.Namespace) -> int:
    from pipecc import driver, progress, tuning
    from pipecc.backends.torch.compile import check_output_folder
    from pipecc.cli.plan import check_plan_args, options_from_args
    from pipecc.errors import PipeccError
    from pipecc.frontend.modelfile import parse_model_args
    from pipecc.report.formatting import terminal_text
    check_output_folder(args.output, args.force)  # now, not after minutes of measuring
    if args.dump_ir:
        from pipecc.errors import UsageError
        raise UsageError("--dump-ir applies to `pipecc plan` and `pipecc compile`; compile the tuned "
                         "plan's options with it to see its IR")
    cluster, profile = check_plan_args(args)
    options = options_from_args(args, profile)
    analysis = driver.analyze(args.model, model_args=parse_model_args(args.model_arg),
                              batch_size=args.batch_size, symbols=driver.parse_symbols(args.symbol),
                              debug=args.debug)
    if analysis.spec is None:
        raise PipeccError("pipecc tune runs the candidates on the model file's data: give a .py model file")
    notes: list[str] = []
    with progress.step("listing candidates"):
        cands = tuning.candidates(analysis, cluster, options, args.k, debug=args.debug, note=notes.append)
    model_path = str(Path(args.model).resolve())
    for c in cands:
        c.plan.model_path, c.plan.model_args = model_path, parse_model_args(args.model_arg)
    for line in notes:
        progress.explain(line)
    work = Path(tempfile.mkdtemp(prefix="pipecc-tune-"))
    try:
        with progress.step("measuring candidates", total=len(cands)) as bar:
            def done(i: int, c: Any) -> None:
                bar.advance()
                if not args.quiet and not progress.current().enabled:
                    what = f"{c.measured_s:.4g} s" if c.measured_s is not None else f"{c.status}: {c.reason}"
                    print(terminal_text(f"candidate {i + 1}/{len(cands)} ({c.label}, {c.shape()}): {what}"),
                          file=sys.stderr)
            tuning.measure(analysis, cands, work, steps=args.steps, timeout=args.timeout,
                           budget_s=args.budget_s, on_done=done)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    best = tuning.fastest(cands)
    skipped = sum(c.status == tuning.SKIPPED for c in cands)
    if skipped:
        progress.notice(f"--budget-s {args.budget_s:g}: {skipped} of {len(cands)} candidates not started")
    if best is None:
        if not args.json:
            print(terminal_text(tuning.table(cands)))
        first = cands[0]
        raise PipeccError(f"no candidate could be measured (the planner's choice: {first.status}: {first.reason}); "
                          "nothing written")
    measured = [c for c in cands if c.status == tuning.OK]
    plan = best.plan
    plan.decisions.insert(0, f"tuned: measured fastest of {len(measured)} candidates ({best.label}: "
                          f"{best.measured_s:.4g} s per step measured, {best.predicted_s:.4g} s predicted)")
    lines = []
    for i, c in enumerate(cands, 1):
        if c is not best:
            what = (f"{c.measured_s:.4g} s measured" if c.measured_s is not None else f"{c.status}: {c.reason}")
            lines.append(f"tuned: candidate {i} ({c.label}, {c.shape()}, {c.plan.schedule}, "
                         f"m={c.plan.microbatches}): {what}, {c.predicted_s:.4g} s predicted")
    plan.decisions[1:1] = lines
    with progress.step(f"writing {args.output}"):
        driver.compile(analysis, plan, best.graph, args.output, force=args.force, debug=args.debug)
    if args.json:
        print(json.dumps({"output": str(args.output), "candidates": tuning.rows(cands),
                          "chosen": cands.index(best)}, indent=1))
    else:
        print(terminal_text(tuning.table(cands)))
        if not args.quiet:
            print(terminal_text(f"wrote {args.output}: {best.label} ({best.shape()}, {plan.schedule}, "
                                f"m={plan.microbatches}), measured fastest; run it with `pipecc run {args.output}`"))
    return 0
