"""Argument types and argument groups shared by the `pipecc` subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from pipecc.errors import UsageError
from pipecc.ir.precision import PRECISIONS
from pipecc.ir.schedule.registry import TRAINING_SCHEDULES
from pipecc.techniques import TECHNIQUES
from pipecc.techniques.options import Option


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one `pipecc: error:` line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {value}")
    return value


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def nonnegative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def stage_index(text: str) -> int:
    return _int_at_least(text, 0, "a stage index (>= 0)")


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def endpoint(text: str) -> str:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (e.g. 10.0.0.1:29500), got {text!r}")
    return text


def microbatches(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def replicas(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def technique_switch(option: Option) -> Any:
    """The argparse `type` of a technique's switch (`pipecc.techniques.options.Option`): a CLI
    word, an old spelling or free text -> the planner's value."""
    def parse(text: str) -> Any:
        try:
            return option.value(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    parse.__name__ = option.dest
    return parse


class _SplitLayers(argparse.Action):
    """`--split-layers auto|off` and the old flag `--no-split-layers` set one field,
    `no_split_layers`, which cli/plan.py hands to the planner as `split_layers=not ...`."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if option_string == "--no-split-layers":
            setattr(namespace, self.dest, True)
        elif values in ("auto", "off"):
            setattr(namespace, self.dest, values == "off")
        else:
            parser.error(f"argument --split-layers: invalid choice: {values!r} (choose from auto, off)")


# ----------------------------------------------------------------------------- help
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Examples keep their lines; every option whose help does not name its default gets
    "(default: X)" appended, so `--help` shows each default without repeating it by hand."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        unset = default is None or default is False or default is True or default is argparse.SUPPRESS
        if action.option_strings and "default" not in text and not unset and text is not argparse.SUPPRESS:
            text += " (default: %(default)s)"
        return text


def group(p: argparse.ArgumentParser, title: str) -> Any:
    """The argument group of `p` called `title` (made on first use), so several helpers can
    add to one group: `basic`, `schedule`, `techniques`; the rest land in the parser's own
    options, which plan and compile title "output"."""
    for g in p._action_groups:  # NOTE: argparse has no public lookup of a group by title
        if g.title == title:
            return g
    return p.add_argument_group(title)


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = group(p, "basic")
    g.add_argument("model", metavar="MODEL",
                   help="a .py model file (defining build_model and example_inputs; see "
                   "docs/model-files.md) or an .onnx file")
    g.add_argument("--batch-size", "-b", type=positive_int, default=1, metavar="B",
                   help="example batch size (the value of the symbol B; default 1)")
    g.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword argument for build_model (repeatable; default: none)")
    g.add_argument("--symbol", action="append", metavar="NAME=INPUT:DIM",
                   help="mark another symbolic dimension, e.g. S=0:1 (dim 1 of input 0; default: "
                   "only the batch B)")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p._optionals.title = "output"  # NOTE: -h, -v, -q, --debug, --json, -o, ... (argparse's own group)
    basic = group(p, "basic")
    basic.add_argument("--length", action="append", metavar="S=LO..HI",
                       help="variable lengths: the symbol S of --symbol takes any length in LO..HI "
                       "(or S=16,32,64, or weighted S=16:0.5,32:0.3,64:0.2); the plan is chosen at the "
                       "maximum and the folder runs every length (`pipecc run --length S=L`; default: "
                       "the example's length only)")
    basic.add_argument("--devices", "-d", required=True, metavar="SPEC",
                       help="devices in pipeline order: 4xa100,2xu250 | a100@cuda:1 | @cluster.toml "
                       "(`pipecc devices` lists the names; required)")
    basic.add_argument("--profile", metavar="PROFILE_JSON",
                       help="measured costs from `pipecc profile`: the plan uses its curves for the "
                       "devices it timed, the roofline elsewhere (default: the roofline only; on a "
                       "CPU, profile first)")
    basic.add_argument("--calibrate", metavar="RUN_JSON",
                       help="plan with the stage times a run measured: the document `pipecc run OUT "
                       "--json` printed for a plan of this model on these devices; each stage's measured "
                       "over predicted time scales its nodes' costs (default: no calibration; see "
                       "docs/profiling.md)")
    sched = group(p, "schedule")
    sched.add_argument("--microbatches", "-m", type=microbatches, default="auto", metavar="auto|M",
                       help="micro-batches per iteration: auto (default) lets the planner choose, "
                       "M a fixed count (it must divide the batch)")
    sched.add_argument("--schedule", choices=["auto", *TRAINING_SCHEDULES], default="auto",
                       help=f"pipeline schedule: auto (default) tries {', '.join(TRAINING_SCHEDULES)} "
                       "and keeps the fastest that fits")
    sched.add_argument("--replicas", type=replicas, default="auto", metavar="auto|N",
                       help="run every stage on a group of N devices that split each micro-batch "
                       "(data parallel inside the stage, gradients all-reduced in the group); N must "
                       "divide the device count; auto (default): pipecc chooses N with the cuts, and "
                       "may choose plain data parallelism; 1: the plain pipeline (stages); N = the "
                       "device count: plain data parallelism")
    sched.add_argument("--use-all-devices", action="store_true",
                       help="give every device a stage (or a replica); default: the planner may use "
                       "fewer devices (one, when pipelining does not pay) when that is predicted faster, "
                       "and says so in the plan's decisions")
    sched.add_argument("--inference", action="store_true",
                       help="plan forward passes only (default: training)")
    sched.add_argument("--precision", choices=PRECISIONS, default="fp32",
                       help="the run's precision: fp32 (default); bf16 or fp16 plan (and `pipecc run`, "
                       "`pipecc.distributed.load` run) every stage's forward and loss under torch.autocast "
                       "with float32 messages sent in that dtype: the plan counts the bytes autocast holds "
                       "and sends and the devices' peak for that dtype; weights, gradients and optimizer "
                       "state stay float32")
    tech = group(p, "techniques (auto|on|off)")
    tech.add_argument("--split-layers", dest="no_split_layers", action=_SplitLayers, default=False,
                      metavar="auto|off",
                      help="split a layer too heavy for one device across devices: auto (default) "
                      "where it pays, off never (old spelling: --no-split-layers)")
    tech.add_argument("--no-split-layers", dest="no_split_layers", action=_SplitLayers, nargs=0,
                      default=False, help=argparse.SUPPRESS)
    for technique in TECHNIQUES:  # each technique's switches (its package's OPTIONS)
        for option in getattr(technique, "OPTIONS", ()):
            tech.add_argument(option.flag, dest=option.dest, type=technique_switch(option), default=option.default,
                              metavar=option.metavar, help=option.help)
    tech.add_argument("--flash-attention", action="store_true",
                      help="cost fused attention as flash attention runs it: no stashed scores, "
                      "recomputed in backward (default: the math path, which keeps them)")
    tech.add_argument("--coarse", action="store_true",
                      help="cut only at block boundaries (default: at any node)")
    tech.add_argument("--choose-order", action="store_true",
                      help="let pipecc order the devices (interchangeable types; default: stage i "
                      "on device i)")
    tech.add_argument("--fpga-number", default="float", metavar="FORMAT",
                      help="number format of FPGA stages: float or ap_fixed<W,I> (default float); "
                      "the plan costs FPGA stages in it")
    p.add_argument("--dump-ir", metavar="DIR",
                   help="write the IR after each compiler step to DIR/NNN_<step>.txt (the graph "
                   "with each node's name, kind and cost; the plan once planned; default: not written)")


# ----------------------------------------------------------------------------- examples
EXAMPLES: dict[str, tuple[str, ...]] = {
    "cost": ("pipecc cost models/gpt.py -b 8 --by-module 2",
             "pipecc cost models/mlp.py -b 32 --model-arg depth=8 --json"),
    "devices": ("pipecc devices", "pipecc devices --json"),
    "plan": ("pipecc plan models/mlp.py -b 32 --devices 2xcpu --replicas 1 -m 4 -v",
             "pipecc plan models/gpt.py -b 8 --devices 4xa100 --compare --recompute auto -o plan.json"),
    "compile": ("pipecc compile models/mlp.py -b 32 --devices 2xcpu --replicas 1 -o out",
                "pipecc compile models/gpt.py -b 8 --devices 2xcpu --schedule zb-h1 --profile prof.json -o gpt_out"),
    "tune": ("pipecc tune models/mlp.py -b 32 --devices 2xcpu -o out",
             "pipecc tune models/gpt.py -b 8 --devices 2xcpu -k 4 --steps 5 --budget-s 300 -o gpt_out"),
    "run": ("pipecc run out --steps 100 --verify",
            "pipecc run out --steps 1000 --checkpoint-dir ckpt --checkpoint-every 100 --resume"),
    "export-checkpoint": ("pipecc export-checkpoint ckpt model.safetensors",
                          "pipecc export-checkpoint ckpt model.safetensors --step 100 --force"),
    "inspect": ("pipecc inspect out", "pipecc inspect out --stage 1 --format json"),
    "csim": ("pipecc csim fpga_out", "pipecc csim fpga_out --stage 1 --threaded --fifo-depth 4"),
    "profile": ("pipecc profile models/mlp.py -b 32 --devices 2xcpu -o prof.json",
                "pipecc profile models/gpt.py -b 8 --devices cpu --no-cache --json"),
}


def finish_help(sub: Any) -> None:
    """Give every subcommand the shared help formatter and its examples (its epilog)."""
    import textwrap
    for name, p in sub.choices.items():
        p.formatter_class = HelpFormatter
        if p.description and "\n" not in p.description:  # the raw formatter keeps lines as given
            p.description = textwrap.fill(p.description, 88)
        p._action_groups.remove(p._optionals)  # NOTE: the options without a group last, after
        p._action_groups.append(p._optionals)  # basic/schedule/techniques: output and diagnostics
        lines = EXAMPLES.get(name, ())
        if lines:
            p.epilog = "examples:\n" + "\n".join(f"  {line}" for line in lines) + \
                "\n\nmore: docs/cli.md (every option, the CLI and Python API defaults)"


def check_output_file(path: str, flag: str = "-o", inputs: Any = (), force: bool = False) -> None:
    """A one-line PipeccError now, before minutes of analysis, unless `path` can be written by
    the one output-file rule (pipecc.runtime.outfile): not a folder, nor an input of the command,
    nor a file pipecc did not write (without --force); a name within the file system's limit,
    in a folder that can be written."""
    from pipecc.backends.torch.compile import check_writable_target
    from pipecc.runtime import outfile
    target = outfile.check(path, flag, inputs, force)
    if target.kind in ("new", "file"):
        check_writable_target(target.real)


def write_atomic(path: str, text: str, flag: str = "-o", inputs: Any = (), force: bool = False) -> None:
    """Write `text` to `path` by the one output-file rule (pipecc.runtime.outfile): a regular
    file through a temporary file beside it, so a failure leaves nothing (not even the parent
    folders it created); a character device or a read pipe written into, never renamed over.
    The temporary's name records its writer, so a later write removes one a kill left behind."""
    from pipecc.backends.torch.compile import clean_stale_temps
    from pipecc.runtime import outfile
    check_output_file(path, flag, inputs, force)
    target = outfile.check(path, flag, inputs, force)
    if target.kind in ("new", "file"):
        clean_stale_temps(target.real)
    outfile.write(path, text, flag, inputs, force)  # temporary: pipecc.runtime.atomic.temp_prefix


def model_stdout(args: Any) -> Any:
    """Where model code's prints go while it runs: stderr under --json (stdout carries the one
    JSON document and nothing else), stdout otherwise. A context manager."""
    import contextlib
    import sys
    return contextlib.redirect_stdout(sys.stderr) if getattr(args, "json", False) else contextlib.nullcontext()
