"""Checkpoints of a command-line run: ``pipecc run OUT --checkpoint-dir DIR [--checkpoint-every N]
[--resume]``.

    DIR/latest.json              {"format", "step", "world", "folder"}: the newest complete checkpoint
    DIR/step_<S>/stage_<r>.safetensors, stage_<r>.json   rank r's state after S steps
                                                          (``PipelineRuntime.save_checkpoint``)

``r`` is the global rank: with replicated stages (PP x DP) every replica writes its own files
(their weights are equal; each also has its own RNG state), so a resume restores every rank.

Atomic. Every file is written under a temporary name and renamed. A checkpoint becomes the
newest only when every rank has written its files: the ranks meet (a collective) after saving,
and only then rewrite ``latest.json`` (temporary name, rename). A run killed at any moment leaves
``latest.json`` naming a complete checkpoint, or the one before. The two newest checkpoints are
kept (so ranks on machines that do not share DIR, one of which was killed before renaming its
``latest.json``, still find a step they all hold); each rank deletes only its own older files.

Resume. ``--resume`` reads ``latest.json`` (the ranks take the smallest step any of them found),
checks that it was written for this compiled folder (``folder``: a hash of the stages' code and
ports) and this many ranks, loads model, optimizer and RNG state, and continues at that step:
``--steps N`` counts from the start, so the resumed run does steps S .. N-1, and its losses and
weights are bit-identical to those of a run that was never interrupted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.runtime.engine import PipelineRuntime

__all__ = ["LATEST", "RunCheckpoints", "folder_fingerprint", "read_latest"]

LATEST = "latest.json"
FORMAT = "pipecc-run-checkpoint/1"
KEEP = 2
_STEP_DIR = re.compile(r"^step_(\d+)$")


def folder_fingerprint(stage_dirs: list[Path]) -> str:
    """sha256 of every stage's ``stage.py`` and ``ports.json``: what a checkpoint's state belongs to."""
    digest = hashlib.sha256()
    for folder in stage_dirs:
        for name in ("stage.py", "ports.json"):
            path = folder / name
            digest.update(f"{folder.name}/{name}\0".encode())
            digest.update(path.read_bytes() if path.is_file() else b"")
    return digest.hexdigest()


def read_latest(directory: Path) -> dict[str, Any] | None:
    """``DIR/latest.json`` as a dict; None when there is none; PipeccError when it is not ours."""
    path = directory / LATEST
    if not path.exists():
        return None
    try:
        latest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PipeccError(f"{path} is unreadable ({e}); give another --checkpoint-dir") from None
    if not isinstance(latest, dict) or latest.get("format") != FORMAT or not isinstance(latest.get("step"), int):
        raise PipeccError(f"{path} is not a pipecc run checkpoint; give another --checkpoint-dir")
    return latest


class RunCheckpoints:
    """One rank's side of ``--checkpoint-dir``; ``resume`` and ``save`` are collective."""

    def __init__(self, directory: Path, runtime: PipelineRuntime, fingerprint: str, every: int | None) -> None:
        self.directory, self.runtime, self.fingerprint, self.every = Path(directory), runtime, fingerprint, every

    def due(self, done: int, steps: int) -> bool:
        """Save after ``done`` steps? Every ``--checkpoint-every`` steps, and after the last one."""
        return done == steps or bool(self.every and done % self.every == 0)

    def resume(self) -> int:
        """Load the newest checkpoint every rank holds; the step to continue at."""
        latest = read_latest(self.directory)
        step = int(latest["step"]) if latest is not None else -1
        step = self._agree(step)
        if step < 0:
            raise PipeccError(f"--resume: {self.directory} holds no checkpoint (no {LATEST}); run without "
                              "--resume to start one")
        if latest is not None and latest.get("folder") != self.fingerprint:
            raise PipeccError(f"--resume: the checkpoint in {self.directory} was written by a run of another "
                              "compiled folder (its stages or ports differ); give the --checkpoint-dir of this one")
        if latest is not None and latest.get("world") != self.runtime.global_world:
            raise PipeccError(f"--resume: the checkpoint in {self.directory} is of a {latest.get('world')}-rank "
                              f"run, this one has {self.runtime.global_world} ranks")
        return self.runtime.load_checkpoint(self.directory / f"step_{step}")

    def save(self, step: int) -> Path:
        """Write this rank's state after ``step`` steps; when all ranks have, point ``latest.json`` at it."""
        target = self.directory / f"step_{step}"
        self.runtime.save_checkpoint(target, step)
        self._agree(0)  # every rank's files are in place
        latest = {"format": FORMAT, "step": step, "world": self.runtime.global_world, "folder": self.fingerprint}
        tmp = self.directory / f".{LATEST}.{self.runtime.global_rank}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(latest, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.directory / LATEST)
        self._prune(step)
        return target

    def _prune(self, newest: int) -> None:
        """Delete this rank's files of all but the ``KEEP`` newest checkpoints (and emptied folders)."""
        steps = sorted(int(m.group(1)) for m in (_STEP_DIR.match(p.name) for p in self.directory.iterdir())
                       if m and int(m.group(1)) <= newest)
        for old in steps[:-KEEP]:
            folder = self.directory / f"step_{old}"
            for suffix in (".safetensors", ".json"):
                (folder / f"stage_{self.runtime.global_rank}{suffix}").unlink(missing_ok=True)
            try:
                folder.rmdir()  # only once every rank removed its files
            except OSError:
                pass

    def _agree(self, value: int) -> int:
        """The smallest ``value`` over all ranks (and a barrier)."""
        if self.runtime.global_world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.runtime.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())
