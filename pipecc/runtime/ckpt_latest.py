"""A checkpoint folder's ``latest.json`` and what a resume refuses, without torch: `pipecc run`'s
launcher checks ``--checkpoint-dir``/``--resume`` with them before any process starts
(`pipecc.runtime.launch_checks.check_options`); the checkpoints themselves are
`pipecc.runtime.checkpoints` (which re-exports these names).

Imports ``pipecc.errors`` and ``pipecc.runtime.folder_sums`` only."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipecc.errors import PipeccError

__all__ = ["DEFAULT_LR", "FORMAT", "LATEST", "OLD_FORMAT", "check_resume", "old_format_refusal", "read_latest",
           "run_options"]

LATEST = "latest.json"
FORMAT = "pipecc-run-checkpoint/2"
OLD_FORMAT = "pipecc-run-checkpoint/1"  # an older pipecc's: no checksums, no recorded options
DEFAULT_LR = 1e-3


def read_latest(directory: Path) -> dict[str, Any] | None:
    """``DIR/latest.json`` as a dict; None when there is none; PipeccError when it is not ours."""
    path = directory / LATEST
    if not path.exists():
        return None
    from pipecc.runtime.folder_sums import read_regular
    try:  # a regular file of at most 1 MiB: a FIFO or /dev/zero linked there would hang the read
        latest = json.loads(read_regular(path, 1 << 20).decode("utf-8"))
    except PipeccError as e:
        raise PipeccError(f"{path} is unreadable ({str(e).split('; ')[0]}); give another --checkpoint-dir") from None
    except (OSError, ValueError, RecursionError) as e:
        raise PipeccError(f"{path} is unreadable ({e}); give another --checkpoint-dir") from None
    if not isinstance(latest, dict) or latest.get("format") not in (FORMAT, OLD_FORMAT) \
            or not isinstance(latest.get("step"), int):
        raise PipeccError(f"{path} is not a pipecc run checkpoint; give another --checkpoint-dir")
    return latest


def run_options(optimizer: str | None, lr: float | None, seed: int, microbatches: int) -> dict[str, Any]:
    """What a checkpoint records of the run that wrote it (and a resume compares)."""
    return {"optimizer": optimizer or "sgd", "lr": DEFAULT_LR if lr is None else float(lr), "seed": int(seed),
            "microbatches": int(microbatches)}


def check_resume(latest: dict[str, Any], run: dict[str, Any], steps: int | None, directory: Path) -> list[str]:
    """Refuse (PipeccError) a resume whose result would not be what was asked; the notes on what
    changed otherwise (see the module docstring for which is which)."""
    step = int(latest["step"])
    if steps is not None and steps <= step:
        raise PipeccError(f"--resume: the checkpoint in {directory} is at step {step}, already past --steps {steps}"
                          f"{'' if steps < step else ' (nothing left to train)'}; give --steps {step + 1} or more")
    if latest.get("format") == OLD_FORMAT:
        raise PipeccError(old_format_refusal(directory))
    was = latest.get("run") if isinstance(latest.get("run"), dict) else {}
    for key, flag in (("optimizer", "--optimizer"), ("seed", "--seed")):
        if key in was and was[key] != run[key]:
            raise PipeccError(f"--resume: the checkpoint in {directory} was trained with {flag} {was[key]}, this run "
                              f"asks {flag} {run[key]}; give {flag} {was[key]} to continue it, or another "
                              "--checkpoint-dir to start over")
    notes = []
    for key, flag in (("lr", "--lr"), ("microbatches", "--microbatches")):
        if key in was and was[key] != run[key]:
            rounding = "; not bit-identical to an uninterrupted run" if key == "microbatches" else ""
            notes.append(f"note: resuming with {flag} {run[key]}; the checkpoint was trained with {flag} {was[key]} "
                         f"(the steps from {step} on use {run[key]}{rounding})")
    return notes


def old_format_refusal(directory: Path) -> str:
    """An older pipecc's checkpoint (``pipecc-run-checkpoint/1``) records no checksums: it cannot
    be told from a newer one whose ``latest.json`` was edited back to format 1 and its sha256
    files deleted, so it is refused, not loaded unchecked."""
    return (f"--resume: the checkpoint in {directory} is of the old format {OLD_FORMAT} (no checksums), so a damaged "
            "or edited one cannot be told from a good one; resume it with the pipecc that wrote it, or give another "
            "--checkpoint-dir to start over")
