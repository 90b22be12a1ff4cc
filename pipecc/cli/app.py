"""The `pipecc` command line: the parser of every subcommand and `main`.

Every command exits 0 on success, 2 on a usage error and 1 on any other error, printing one
`pipecc: error: ...` line on stderr; `--debug` shows the traceback as well. An OSError that
reaches `main` (a disk full, a folder that cannot be written) is the environment's, not a
bug: it gets the same one line. Everything printed here is escaped for the terminal
(`pipecc.report.formatting.terminal_text`): messages may quote hostile names. Each subcommand
lives in its own module of this package (`add_parser(sub, common)` + `cmd_<name>(args)`).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
import warnings
from typing import Any, Callable, Sequence

from pipecc.cli.args import Parser, finish_help
from pipecc.errors import PipeccError


def build_parser() -> argparse.ArgumentParser:
    from pipecc.cli import compile as compile_cmd
    from pipecc.cli import cost, csim, devices, export_checkpoint, inspect, plan, profile, run, tune
    parser = Parser(prog="pipecc", description="pipecc: a pipeline-parallel compiler for "
                    "deep-learning models (cost, plan, compile, tune, run, inspect).")
    parser.add_argument("--version", action="version", version="pipecc " + _version())
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks and verify the IR after each pass")
    common.add_argument("-v", "--verbose", action="store_true", help="explain decisions")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for module in (cost, plan, compile_cmd, tune, devices, run, export_checkpoint, inspect, csim, profile):
        module.add_parser(sub, common)
    finish_help(sub)
    return parser


def _version() -> str:
    from pipecc import __version__
    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """The `pipecc` program (argv None: sys.argv) or one command in this process (tests)."""
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    code = _main(argv)
    if as_program and (_command(argv) == "run" or _stray_threads()):
        _exit_now(code)  # NOTE: a thread the model's code started and never ends must not keep pipecc alive
    return code


def _stray_threads() -> bool:
    """A thread other than the main one, not a daemon, still running: the interpreter would wait
    for it at exit (a model file's `threading.Thread(target=forever).start()`)."""
    import threading
    main = threading.main_thread()
    return any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate())


def _command(argv: Sequence[str]) -> str | None:
    """The subcommand's name: the first argument that is not an option."""
    return next((a for a in argv if not a.startswith("-")), None)


def _exit_now(code: int) -> None:
    """End the process without the interpreter's finalisation. NOTE: `pipecc run`'s launcher
    imports torch to check the folder, and tearing torch down at exit took 0.3 s on a quiet
    2-core machine and 2.8 s under load (measured, torch 2.13): time past --timeout a run
    that failed must not spend. Its work is done here: the ranks are stopped, the checkpoint
    lock released, files closed; only stdout and stderr need flushing."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`): nothing more to say there
            pass
    os._exit(code)


def _main(argv: list[str]) -> int:
    parser = build_parser()
    debug = "--debug" in argv
    formatwarning, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        args = parser.parse_args(argv)
        from pipecc import progress
        progress.configure(quiet=getattr(args, "quiet", False), verbose=getattr(args, "verbose", False))
        if not getattr(args, "func", None):
            sys.stderr.write(parser.format_usage())
            return _error("no command given; try `pipecc --help`", 2)
        func: Callable[[argparse.Namespace], Any] = args.func
        return int(func(args) or 0)
    except PipeccError as exc:
        if debug:
            _traceback()
        return _error(_first_line(exc), exc.exit_code)
    except BrokenPipeError:  # `pipecc ... | head`
        sys.stderr.close()
        return 0
    except OSError as exc:  # the environment's: a full disk, a folder that cannot be written
        if debug:
            _traceback()
        where = f"{exc.filename}: " if exc.filename else ""
        return _error(f"{where}{exc.strerror or _first_line(exc)}", 1)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except RecursionError as exc:  # a hand-edited file nested past the parser's stack (json, tomllib)
        if debug:
            _traceback()
        return _error(f"an input nests too deeply to read ({_first_line(exc)}); a file pipecc reads "
                      "was damaged or made by hand", 1)
    except MemoryError as exc:
        if debug:
            _traceback()
        return _error(f"out of memory ({_first_line(exc)}); give smaller sizes (-b, --model-arg) or use a machine "
                      "with more memory", 1)
    except Exception as exc:  # noqa: BLE001 - the last resort: one line, the traceback with --debug
        if debug:
            _traceback()
        return _error(f"{type(exc).__name__}: {_first_line(exc)} (unexpected; rerun with --debug for the "
                      "traceback)", 1)
    finally:
        warnings.formatwarning = formatwarning


def _first_line(exc: BaseException) -> str:
    # NOTE: split on "\n" only: str.splitlines would also cut at a "\r" inside a quoted name
    try:
        text = str(exc).strip()
    except Exception:  # noqa: BLE001 - an exception class whose __str__ raises
        text = ""
    return text.split("\n")[0].strip() if text else type(exc).__name__


def _traceback() -> None:
    from pipecc.report.formatting import terminal_text
    sys.stderr.write(terminal_text(traceback.format_exc()))


def _error(message: str, code: int) -> int:
    from pipecc.report.formatting import printable
    print(f"pipecc: error: {printable(message)}", file=sys.stderr)
    return code


def _format_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                    line: str | None = None) -> str:
    """Python warnings on stderr, escaped like everything else pipecc prints."""
    from pipecc.report.formatting import terminal_text
    return f"{filename}:{lineno}: {category.__name__}: {terminal_text(message)}\n"

