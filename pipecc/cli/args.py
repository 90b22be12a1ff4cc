"""Argument types and argument groups shared by the `pipecc` subcommands."""

from __future__ import annotations

import argparse

from pipecc.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that reports usage errors as one `pipecc: error:` line and exit 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def microbatches(text: str) -> int | str:
    return "auto" if text == "auto" else positive_int(text)


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="a .py model file (defining build_model and example_inputs; see the "
                   "README's model-file section) or an .onnx file")
    p.add_argument("--batch-size", "-b", type=positive_int, default=1, metavar="B",
                   help="example batch size (the value of the symbol B; default 1)")
    p.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                   help="keyword argument for build_model (repeatable)")
    p.add_argument("--symbol", action="append", metavar="NAME=INPUT:DIM",
                   help="mark another symbolic dimension, e.g. S=0:1 (dim 1 of input 0)")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--devices", "-d", required=True, metavar="SPEC",
                   help="devices in pipeline order: 4xa100,2xu250 | a100@cuda:1 | @cluster.toml")
    p.add_argument("--microbatches", "-m", type=microbatches, default="auto", metavar="M|auto")
    p.add_argument("--schedule", choices=["auto", "gpipe", "1f1b", "interleaved"], default="auto")
    p.add_argument("--coarse", action="store_true", help="cut only at block boundaries")
    p.add_argument("--choose-order", action="store_true",
                   help="let pipecc order the devices (interchangeable types)")
    p.add_argument("--no-split-layers", action="store_true", help="never split a layer across devices")
    p.add_argument("--inference", action="store_true", help="plan forward passes only")
    p.add_argument("--fpga-number", default="float", metavar="FORMAT",
                   help="number format of FPGA stages: float or ap_fixed<W,I> (default float); "
                   "the plan costs FPGA stages in it")
    p.add_argument("--dump-ir", metavar="DIR",
                   help="write the IR after each compiler step to DIR/NNN_<step>.txt (the graph "
                   "with each node's name, kind and cost; the plan once planned)")


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, so a failure leaves nothing."""
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
