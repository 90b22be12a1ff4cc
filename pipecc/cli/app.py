"""The `pipecc` command line: the parser of every subcommand and `main`.

Every command exits 0 on success, 2 on a usage error and 1 on any other error, printing one
`pipecc: error: ...` line on stderr; `--debug` shows the traceback instead. Each subcommand
lives in its own module of this package (`add_parser(sub, common)` + `cmd_<name>(args)`).
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Any, Callable, Sequence

from pipecc.cli.args import Parser
from pipecc.errors import PipeccError


def build_parser() -> argparse.ArgumentParser:
    from pipecc.cli import compile as compile_cmd
    from pipecc.cli import cost, csim, devices, inspect, plan, profile, run
    parser = Parser(prog="pipecc", description="pipecc: a pipeline-parallel compiler for "
                    "deep-learning models (cost, plan, compile, run, inspect).")
    parser.add_argument("--version", action="version", version="pipecc " + _version())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and verify the IR after each pass")
    common.add_argument("-v", "--verbose", action="store_true", help="explain decisions")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in (cost, plan, compile_cmd, devices, run, inspect, csim, profile):
        module.add_parser(sub, common)
    return parser


def _version() -> str:
    from pipecc import __version__
    return __version__


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

