"""Checkpoints of a command-line run: ``pipecc run OUT --checkpoint-dir DIR [--checkpoint-every N]
[--resume]``.

    DIR/latest.json              {"format", "step", "world", "folder", "run"}: the newest complete
                                 checkpoint; "run": the options it was trained with (``run_options``)
    DIR/step_<S>/stage_<r>.safetensors, stage_<r>.json   rank r's state after S steps
                                                          (``PipelineRuntime.save_checkpoint``)
    DIR/step_<S>/stage_<r>.sha256   {file name: hex sha256} of rank r's two files, written after them
    DIR/.pipecc-run.lock         held (flock) by the run that uses DIR (``pipecc.runtime.ckptlock``)

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

Re-planned. A checkpoint of another compiled folder (another ``folder`` hash) or of another
number of ranks (replicas) is not refused: every rank gathers all ranks' files under the
original model's tensor names and takes its own (``pipecc.runtime.ckpt_remap``, which says what
identifies the same model, how shards and optimizer state are sliced, and what happens to the RNG
state); a note says it was re-mapped. ``docs/checkpoints.md`` lists which re-plans are
bit-identical.

Trust. A resume checks, before it continues, what a damaged or edited checkpoint would change
silently: every rank's files against the sha256 written with them (a flipped byte, an edited
``stage_<r>.json`` such as its optimizer class), the optimizer class against this run's, and
every loaded weight, buffer and optimizer state tensor for NaN or Inf; each is refused in one
line; so is a step folder whose ranks' files come from different steps (each ``stage_<r>.json``
records its rank and step, checked on every rank before any loads). Checkpoints of the old
format (``pipecc-run-checkpoint/1``: no checksums) are refused: one cannot be told from a newer
checkpoint edited back to that format with its checksums deleted.

Options on resume (``check_resume``): another ``--optimizer`` or ``--seed`` than the checkpoint
was trained with is refused (the optimizer state belongs to its class; the seed draws the data
and the saved RNG state belongs to it, so the result would be neither run); another ``--lr`` or
``-m`` is taken, with a note (a deliberate learning-rate change on resume is common; other
micro-batches give the same gradients up to rounding, not bit-identical ones). ``--steps`` at or
below the checkpoint's step is refused ("already past --steps"): there would be nothing to train.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.runtime import ckpt_remap, watchdog, wire
from pipecc.runtime.atomic import write_atomic
from pipecc.runtime.engine import PipelineRuntime
# latest.json and the resume's refusals are torch-free (`pipecc run`'s launcher checks them)
from pipecc.runtime.ckpt_latest import (DEFAULT_LR, FORMAT, LATEST, OLD_FORMAT, check_resume,  # noqa: F401
                                        old_format_refusal, read_latest, run_options)

__all__ = ["DEFAULT_LR", "LATEST", "RunCheckpoints", "check_rank_sums", "check_resume", "folder_fingerprint",
           "read_latest", "run_options"]

SUMS = ".sha256"
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


def check_steps(folder: Path, world: int, step: int, prefix: str = "") -> None:
    """Every rank's ``stage_<r>.json`` in the checkpoint step ``folder`` says it is rank r's state
    after ``step`` steps: a folder whose ranks come from different steps (each file matching its
    own sha256) is refused on every rank alike, before any rank loads it."""
    for rank in range(world):
        path = folder / f"stage_{rank}.json"
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            raise PipeccError(f"{prefix}{path} is missing or unreadable; give another --checkpoint-dir to "
                              "start over") from None
        said = (meta.get("step"), meta.get("rank")) if isinstance(meta, dict) else (None, None)
        if said != (step, rank):
            raise PipeccError(f"{prefix}{path} holds rank {said[1]!r}'s state after step {said[0]!r}, not rank "
                              f"{rank}'s after step {step}: the checkpoint mixes files of different steps; resume "
                              "from another one or give another --checkpoint-dir to start over")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_rank_sums(folder: Path, rank: int, prefix: str = "") -> None:
    """Rank ``rank``'s files in the checkpoint step ``folder`` against the sha256 written with them."""
    base = f"stage_{rank}"
    try:
        sums = json.loads((folder / f"{base}{SUMS}").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        sums = None
    if not isinstance(sums, dict):
        raise PipeccError(f"{prefix}{folder / (base + SUMS)} is missing or unreadable, so the checkpoint cannot "
                          "be checked; give another --checkpoint-dir to start over")
    for name in (f"{base}.safetensors", f"{base}.json"):
        try:
            actual = _sha256(folder / name)
        except OSError as e:
            raise PipeccError(f"{prefix}cannot read {folder / name} ({e.strerror or e})") from None
        if actual != sums.get(name):
            raise PipeccError(f"{prefix}{folder / name} does not match the sha256 written with it (it was "
                              "changed or damaged); give another --checkpoint-dir to start over")


def _plan_text(stages: int, ranks: int) -> str:
    return f"{stages} stage{'s' * (stages != 1)} on {ranks} rank{'s' * (ranks != 1)}"


def _nonfinite(named: Any) -> str | None:
    """The name of the first floating tensor in (name, value) pairs holding NaN or Inf."""
    for name, value in named:
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()) \
                and not bool(torch.isfinite(value).all()):
            return name
    return None


class RunCheckpoints:
    """One rank's side of ``--checkpoint-dir``; ``resume`` and ``save`` are collective."""

    def __init__(self, directory: Path, runtime: PipelineRuntime, fingerprint: str, every: int | None,
                 run: dict[str, Any] | None = None) -> None:
        self.directory, self.runtime, self.fingerprint, self.every = Path(directory), runtime, fingerprint, every
        self.run = run  # run_options of this run: recorded in latest.json, compared on resume
        self.notes: list[str] = []  # what resume found changed (or unchecked), for the run to print

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
        if latest is not None and (latest.get("folder") != self.fingerprint
                                   or latest.get("world") != self.runtime.global_world):
            return self._resume_replanned(latest, step)
        folder = self.directory / f"step_{step}"
        if latest is not None and latest.get("format") == OLD_FORMAT:
            raise PipeccError(old_format_refusal(self.directory))
        self.notes = check_resume(latest, self.run, None, self.directory) if latest is not None and self.run else []
        self._check_sums(folder)
        check_steps(folder, self.runtime.global_world, step, "--resume: ")
        self._check_optimizer(folder)
        try:
            loaded = self.runtime.load_checkpoint(folder)
        except PipeccError:
            raise
        except (KeyError, TypeError, ValueError, RuntimeError, OSError) as e:
            raise PipeccError(f"--resume: the checkpoint in {folder} cannot be loaded ({type(e).__name__}: {e}); "
                              "it is damaged: give another --checkpoint-dir to start over") from None
        self._check_finite(folder)
        if self.run is not None and self.runtime.optimizer is not None:
            # NOTE: load_state_dict restored the checkpoint's learning rate; the note on another
            # --lr promises this run's from here on
            for group in self.runtime.optimizer.param_groups:
                group["lr"] = self.run["lr"]
        return loaded

    def _resume_replanned(self, latest: dict[str, Any], step: int) -> int:
        """A checkpoint of another compiled folder: every rank's files gathered under the model's
        names and mapped onto this folder's stages (``pipecc.runtime.ckpt_remap``)."""
        folder = self.directory / f"step_{step}"
        rt = self.runtime
        refused = f"--resume: the checkpoint in {self.directory} " + (
            "was written by a run of another compiled folder" if latest.get("folder") != self.fingerprint else
            f"is of a {latest.get('world')}-rank run, this one has {rt.global_world} ranks")
        # NOTE: first the collective (every rank reaches it), then what one rank alone may refuse
        sig, problem = ckpt_remap.new_signature(rt.stage_ids, rt.modules, gather_all=rt.global_world > 1)
        if problem:
            raise PipeccError(f"{refused}, and {problem}")
        if latest.get("format") == OLD_FORMAT:
            raise PipeccError(old_format_refusal(self.directory))
        world = latest.get("world")
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise PipeccError(f"--resume: {self.directory / LATEST} says world {world!r}; it is damaged: give "
                              "another --checkpoint-dir to start over")
        self.notes = check_resume(latest, self.run, None, self.directory) if self.run else []
        try:
            found = ckpt_remap.gather(folder, world, lambda f, r: self._check_sums(f, r))
            check_steps(folder, world, step, "--resume: ")
            ckpt_remap.check_same_model(found, sig)
        except PipeccError as e:
            text = str(e)
            raise PipeccError(text if text.startswith("--resume:") else f"{refused} and cannot be mapped onto "
                              f"this one: {text}") from None
        run = self.run or {}
        mapped = ckpt_remap.load(found, rt, run.get("lr"), int(run.get("seed", 0)))
        self._check_finite(folder)
        rng = "RNG state of the same ranks" if mapped else \
            "RNG re-seeded from the step (dropout draws differ from an uninterrupted run)"
        self.notes.append(f"note: re-mapped from a plan of {_plan_text(found.stages, found.world)} to this one "
                          f"of {_plan_text(rt.schedule.num_stages, rt.global_world)}, by the model's tensor names; "
                          f"{rng}")
        return step

    def _check_sums(self, folder: Path, rank: int | None = None) -> None:
        """A rank's files (default: this rank's) against the sha256 written with them."""
        check_rank_sums(folder, self.runtime.global_rank if rank is None else rank, "--resume: ")

    def _check_optimizer(self, folder: Path) -> None:
        """The checkpoint's optimizer class is this run's (its state belongs to that class)."""
        opt = self.runtime.optimizer
        try:
            meta = json.loads((folder / f"stage_{self.runtime.global_rank}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return  # load_checkpoint names it
        saved = (meta.get("optimizer") or {}).get("class") if isinstance(meta, dict) else None
        if opt is not None and saved is not None and saved != type(opt).__name__:
            raise PipeccError(f"--resume: the checkpoint in {folder} holds {saved} optimizer state, this run's "
                              f"optimizer is {type(opt).__name__}; give the --optimizer it was trained with")

    def _check_finite(self, folder: Path) -> None:
        """Refuse NaN or Inf in the loaded weights, buffers or optimizer state."""
        for s, module in zip(self.runtime.stage_ids, self.runtime.modules):
            bad = _nonfinite(module.state_dict().items())
            if bad is not None:
                raise PipeccError(f"--resume: the checkpoint in {folder} holds NaN or Inf in stage {s}'s {bad}; "
                                  "resume from an earlier one or start over")
        if self.runtime.optimizer is not None:
            state = self.runtime.optimizer.state_dict().get("state", {})
            bad = _nonfinite((f"{p}.{k}", v) for p, entry in state.items() for k, v in entry.items())
            if bad is not None:
                raise PipeccError(f"--resume: the checkpoint in {folder} holds NaN or Inf in the optimizer state "
                                  f"({bad}); resume from an earlier one or start over")

    def save(self, step: int) -> Path:
        """Write this rank's state after ``step`` steps; when all ranks have, point ``latest.json`` at it."""
        target = self.directory / f"step_{step}"
        base = f"stage_{self.runtime.global_rank}"
        # NOTE: a save that hangs (a stalled disk) ends this rank with a line naming it (pipecc run's
        # --timeout), rather than leaving the others to time out in the meeting below
        with watchdog.bounded(f"writing checkpoint step {step} into {target}"):
            self.runtime.save_checkpoint(target, step)
            sums = {name: _sha256(target / name) for name in (f"{base}.safetensors", f"{base}.json")}
            write_atomic(target / f"{base}{SUMS}", json.dumps(sums, indent=1) + "\n")
        self._agree(0, saved=(target, step))  # every rank's files are in place
        latest = {"format": FORMAT, "step": step, "world": self.runtime.global_world, "folder": self.fingerprint}
        if self.run is not None:
            latest["run"] = self.run
        write_atomic(self.directory / LATEST, json.dumps(latest, indent=1) + "\n")
        self._prune(step)
        return target

    def _prune(self, newest: int) -> None:
        """Delete this rank's files of all but the ``KEEP`` newest checkpoints (and emptied folders)."""
        steps = sorted(int(m.group(1)) for m in (_STEP_DIR.match(p.name) for p in self.directory.iterdir())
                       if m and int(m.group(1)) <= newest)
        for old in steps[:-KEEP]:
            folder = self.directory / f"step_{old}"
            for suffix in (".safetensors", ".json", SUMS):
                (folder / f"stage_{self.runtime.global_rank}{suffix}").unlink(missing_ok=True)
            try:
                folder.rmdir()  # only once every rank removed its files
            except OSError:
                pass

    def _agree(self, value: int, saved: tuple[Path, int] | None = None) -> int:
        """The smallest ``value`` over all ranks (and a barrier). ``saved``: the step folder and
        step every rank has just written; a meeting that times out names the ranks whose files
        are not there (as a receive names its sender: ``launcher.root_cause``)."""
        if self.runtime.global_world == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.runtime.device)
        try:
            wire.all_reduce(t, op=dist.ReduceOp.MIN)
        except RuntimeError as exc:
            if saved is None or "timed out" not in str(exc).lower():
                raise
            target, step = saved
            missing = [r for r in range(self.runtime.global_world) if not (target / f"stage_{r}{SUMS}").exists()]
            seconds = re.search(r"(\d+)\s*ms", str(exc))
            after = f"{int(seconds.group(1)) / 1000:g}" if seconds else "?"
            if not missing:
                raise
            raise PipeccError(f"rank {self.runtime.global_rank}: timed out after {after} s waiting for checkpoint "
                              f"step {step} from rank {missing[0]}") from None
        return int(t.item())
