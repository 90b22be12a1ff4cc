"""`pipecc export-checkpoint CKPT model.safetensors`: a run checkpoint as the original model's state dict.

Reads the newest complete checkpoint in CKPT (``latest.json``; ``--step S`` for another kept
one), every rank's files checked against their sha256, gathers them under the original model's
tensor names (``pipecc.runtime.ckpt_remap``: split layers' slices joined, a tied weight under
each of its names, buffers such as BatchNorm's running statistics included) and writes one
safetensors file that ``model.load_state_dict(safetensors.torch.load_file(PATH))`` loads into
the model the model file builds, strict, without pipecc. Optimizer and RNG state are not
exported (they belong to a pipecc run; resume the checkpoint for them).

The file is written under a temporary name beside OUT and renamed: a failure leaves nothing. An
existing OUT is refused unless ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError

__all__ = ["add_parser", "cmd_export_checkpoint", "export_checkpoint"]


def add_parser(subparsers: Any, common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "export-checkpoint", parents=[common], help="write a run checkpoint as the model's state dict",
        description="Write the newest checkpoint in CKPT (a `pipecc run --checkpoint-dir`) as one safetensors "
        "file holding the whole model's state dict under its original names (weights and buffers; split "
        "layers joined, tied weights under each name), loadable by model.load_state_dict without pipecc.")
    p.add_argument("checkpoint_dir", metavar="CKPT", help="a folder written by `pipecc run --checkpoint-dir`")
    p.add_argument("output", metavar="OUT", help="the .safetensors file to write")
    p.add_argument("--step", type=int, metavar="S",
                   help="export the checkpoint of step S (one of the two kept; default: the newest)")
    p.add_argument("--force", action="store_true", help="replace OUT when it exists (default: refuse)")
    p.set_defaults(func=cmd_export_checkpoint)
    return p


def cmd_export_checkpoint(args: argparse.Namespace) -> int:
    from pipecc.report.formatting import terminal_text
    count, step, out = export_checkpoint(Path(args.checkpoint_dir), Path(args.output), args.step, args.force)
    if not args.quiet:
        print(terminal_text(f"wrote {out}: {count} tensors of the model after step {step}"))
    return 0


def export_checkpoint(directory: Path, output: Path, step: int | None = None,
                      force: bool = False) -> tuple[int, int, Path]:
    """(tensors written, step, OUT): see the module docstring."""
    from safetensors.torch import save_file

    from pipecc.runtime import ckpt_remap
    from pipecc.runtime.checkpoints import (LATEST, OLD_FORMAT, check_rank_sums, check_steps, old_format_refusal,
                                             read_latest)

    if not directory.is_dir():
        raise PipeccError(f"{directory} is not a folder; give the --checkpoint-dir of a `pipecc run`")
    from pipecc.runtime import outfile
    if output.is_dir():
        raise PipeccError(f"{output} is a folder; give a file name such as model.safetensors")
    if not Path(os.path.realpath(output)).parent.is_dir():
        raise PipeccError(f"{output.parent} is not a folder; create it first or give another OUT")
    if output.is_file() and not force:  # even one pipecc wrote: a model state is worth keeping
        raise PipeccError(f"{output} exists; give --force to replace it, or another OUT")
    outfile.check(output, "", [directory], True)  # a device written into; never an input
    latest = read_latest(directory)
    if latest is None:
        raise PipeccError(f"{directory} holds no checkpoint (no {LATEST}); give the --checkpoint-dir of a "
                          "`pipecc run`")
    world = latest.get("world")
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise PipeccError(f"{directory / LATEST} says world {world!r}; it is damaged")
    step = int(latest["step"]) if step is None else step
    folder = directory / f"step_{step}"
    if not folder.is_dir():
        kept = sorted(p.name for p in directory.glob("step_*") if p.is_dir())
        raise PipeccError(f"{directory} holds no checkpoint of step {step} (it holds {', '.join(kept) or 'none'})")
    if latest.get("format") == OLD_FORMAT:
        raise PipeccError(old_format_refusal(directory).removeprefix("--resume: ").replace("resume it", "export it"))
    found = ckpt_remap.gather(folder, world, check_rank_sums)
    check_steps(folder, world, step)  # each rank's files its own; all of one step
    state = ckpt_remap.model_state(found)
    def save(path: str) -> None:
        save_file(state, path, metadata={"format": "pipecc-model-state/1", "step": str(step),
                                         "checkpoint": json.dumps(str(directory.resolve()))})
    save.wants_path = True  # type: ignore[attr-defined]
    outfile.write_with(output, save, "", [directory], True)  # never over a device or an input
    return len(state), step, output
