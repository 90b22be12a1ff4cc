"""Argument types and argument groups shared by the `pipecc` subcommands."""

from __future__ import annotations

import argparse

from pipecc.errors import UsageError
from pipecc.ir.schedule.registry import TRAINING_SCHEDULES


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


def microbatch_sizes(text: str) -> str | list[int]:
    """auto | equal | S1,S2,... (each > 0; the sum is checked against the batch size later)."""
    if text in ("auto", "equal"):
        return text
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, equal or sizes like 3,5, got {text!r}") from None
    return sizes


def replicas(text: str) -> int | str:
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
    p.add_argument("--schedule", choices=["auto", *TRAINING_SCHEDULES], default="auto")
    p.add_argument("--replicas", type=replicas, default="auto", metavar="auto|N",
                   help="run every stage on a group of N devices that split each micro-batch "
                   "(data parallel inside the stage, gradients all-reduced in the group); N must "
                   "divide the device count; auto (default): pipecc chooses N with the cuts; 1: the "
                   "plain pipeline; N = the device count: plain data parallelism")
    p.add_argument("--microbatch-sizes", type=microbatch_sizes, default="equal",
                   metavar="auto|equal|S1,S2,...",
                   help="UMPIPE: per-stage micro-batch sizes. equal (default): every stage splits "
                   "the batch into equal micro-batches; auto: when the chosen plan runs gpipe or "
                   "1f1b, search each stage's own sizes (genetic search, at most 10 s) and keep them "
                   "if faster; S1,S2,...: these sizes (summing to the batch size) on every stage, "
                   "under gpipe (or --schedule 1f1b) with replicas 1")
    p.add_argument("--bipartition", choices=["off", "auto"], default="off",
                   help="Bi-Partition: separate forward and backward cuts (a layer's forward on "
                   "one device, its backward on the next; its saved tensors and weights travel). "
                   "off (default); auto: search them around the chosen cuts (training, 1f1b or "
                   "gpipe, replicas 1) and keep them only if the simulated iteration is faster")
    p.add_argument("--coarse", action="store_true", help="cut only at block boundaries")
    p.add_argument("--choose-order", action="store_true",
                   help="let pipecc order the devices (interchangeable types)")
    p.add_argument("--no-split-layers", action="store_true", help="never split a layer across devices")
    p.add_argument("--inference", action="store_true", help="plan forward passes only")
    p.add_argument("--recompute", choices=["none", "full", "auto"], default="none",
                   help="activation recomputation (torch.utils.checkpoint per stage): none (default), "
                   "full (every stage) or auto (only the stages that need it to fit memory)")
    p.add_argument("--activation-balancing", choices=["auto", "on", "off"], default="auto",
                   help="BPipe: under 1F1B, stage s sends stashed activations to stage p-1-s and "
                   "takes them back before their backward, to spend the freed memory on a larger "
                   "micro-batch or no recomputation. auto (default): only where pipecc's estimate "
                   "predicts a speed-up; on: always (1f1b, replicas 1); off: never")
    p.add_argument("--flash-attention", action="store_true",
                   help="cost fused attention as flash attention runs it: no stashed scores, "
                   "recomputed in backward (default: the math path, which keeps them)")
    p.add_argument("--fpga-number", default="float", metavar="FORMAT",
                   help="number format of FPGA stages: float or ap_fixed<W,I> (default float); "
                   "the plan costs FPGA stages in it")
    p.add_argument("--profile", metavar="PROFILE_JSON",
                   help="measured costs from `pipecc profile`: the plan uses its curves for the "
                   "devices it timed, the roofline elsewhere")
    p.add_argument("--dump-ir", metavar="DIR",
                   help="write the IR after each compiler step to DIR/NNN_<step>.txt (the graph "
                   "with each node's name, kind and cost; the plan once planned)")


def check_output_file(path: str) -> None:
    """A one-line PipeccError now, before minutes of analysis, unless `path` can be written:
    not a folder, a name within the file system's limit, in a folder that can be written."""
    from pathlib import Path

    from pipecc.backends.torch.compile import check_writable_target
    from pipecc.errors import PipeccError
    check_writable_target(path)
    if Path(path).is_dir():
        raise PipeccError(f"{path} is a folder; give a file name (e.g. {Path(path) / 'plan.json'})")


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file beside it, so a failure leaves nothing
    (not even the parent folders it created); an OSError becomes a one-line PipeccError. The
    temporary's name records its writer, so a later write removes one a kill left behind."""
    import contextlib
    import os
    import tempfile
    from pathlib import Path

    from pipecc.backends.torch.compile import clean_stale_temps, temp_prefix
    from pipecc.errors import PipeccError
    target = Path(path)
    check_output_file(path)
    clean_stale_temps(target)
    missing = [p for p in target.parents if not p.exists()]
    tmp: str | None = None
    try:
        for folder in reversed(missing):
            folder.mkdir()
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(target, "file"), dir=target.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, target)
    except BaseException as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        for folder in missing:
            with contextlib.suppress(OSError):
                folder.rmdir()
        if isinstance(exc, OSError):
            where = f"{exc.filename}: " if exc.filename else ""
            raise PipeccError(f"cannot write {path}: {where}{exc.strerror or exc}") from exc
        raise
