"""What a run of a compiled folder checks before any process group exists, without torch:
``pipecc run``'s launcher runs these once before it starts torchrun (`pipecc.cli.run`), and every
rank runs them again (`pipecc.runtime.rank`, `pipecc.runtime.engine` re-export them).

    check_options(args, folder, ...)   the run's options against the folder (one-line errors)
    build_schedule(kind, world, m, ...) the validated schedule the ranks run
    check_trace_path(path, args)       --trace's file, writable by the one output-file rule

Imports ``pipecc.errors``, the schedule IR, the techniques' rules and torch-free runtime
modules only: `tests/test_launch_imports.py` checks that the launcher imports neither torch nor
sympy."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule.actions import Schedule
from pipecc.ir.schedule.registry import SCHEDULES, VIRTUAL, schedule_for
from pipecc.ir.schedule.text import ScheduleError, parse
from pipecc.ir.schedule.validate import validate
from pipecc.runtime.admit import check_folder_plan
from pipecc.runtime.ckpt_latest import LATEST, check_resume, read_latest, run_options
from pipecc.runtime.trust import verify_problem
from pipecc.techniques import TECHNIQUES
from pipecc.techniques.replicas.rows import replica_problem

if TYPE_CHECKING:
    from pipecc.runtime.folder import CompiledFolder

__all__ = ["build_schedule", "check_options", "check_trace_path"]


def check_options(args: argparse.Namespace, folder: CompiledFolder, forward: bool, m: int, batch: int,
                  why: str, one_process: bool = False) -> None:
    """Refuse, before any process group exists, what the run could only fail at later (one line).

    ``pipecc run`` makes the same checks before it starts torchrun (``pipecc.cli.run``); the
    techniques' rules on the folder's plan are ``pipecc.runtime.admit``'s. ``one_process`` (no
    torchrun): activation balancing is off, so any ``--schedule`` BPipe refuses goes."""
    folder.sizes_for(args.microbatches)
    folder.activation_balancing  # noqa: B018  (refuses pairs that are not pipecc's)
    check_folder_plan(folder.marker, folder.plan, args.schedule, one_process=one_process)
    if batch and m > batch:
        raise UsageError(f"--microbatches {m} is more than the batch of {batch} rows this folder was compiled "
                         f"for; give --microbatches {batch} or fewer")
    problem = replica_problem(batch, m, folder.replicas)
    if problem:
        raise UsageError(f"--microbatches {m}: {problem}")
    if args.verify and not args.verify_stages_only:
        problem = verify_problem(folder.marker, args.out)
        if problem:
            raise PipeccError(problem)
    ckpt = [flag for flag, given in (("--checkpoint-every", args.checkpoint_every is not None),
                                     ("--resume", args.resume)) if given]
    if args.checkpoint_dir is None and ckpt:
        raise UsageError(f"{' and '.join(ckpt)} need{'s' if len(ckpt) == 1 else ''} --checkpoint-dir DIR")
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise UsageError(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    warmup = getattr(args, "warmup_steps", 1)
    if warmup < 0:
        raise UsageError(f"--warmup-steps must be >= 0, got {warmup}")
    if getattr(args, "trace", None) is not None:
        if args.steps < 1:
            raise UsageError("--trace records the run's steps: give --steps 1 or more")
        if os.environ.get("RANK", "0") == "0":  # the rank that writes it
            check_trace_path(args.trace, args)
    epochs = getattr(args, "epochs", None)
    for flag, value in (("--epochs", epochs), ("--eval-every", getattr(args, "eval_every", None))):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    clip = getattr(args, "clip_grad_norm", None)
    if clip is not None and not clip > 0:
        raise UsageError(f"--clip-grad-norm must be a positive number, got {clip}")
    if getattr(args, "precision", None) not in (None, "fp32") and (args.verify or args.verify_stages_only):
        raise UsageError(f"--verify compares float32 runs; run it without --precision {args.precision} first")
    if forward and any(v is not None for v in (epochs, clip, getattr(args, "eval_every", None))):
        raise UsageError(f"{args.out} runs forward passes only ({why}): --epochs, --clip-grad-norm and --eval-every "
                         "are for training")
    if getattr(args, "memory", False) and not getattr(args, "json", False):
        raise UsageError("--memory adds the measured peak memory to --json's document: give --json too")
    if getattr(args, "json", False) and epochs is None and args.steps <= warmup:
        raise UsageError(f"--json reports the steps after the {warmup} warm-up step{'s' if warmup != 1 else ''}: "
                         f"give --steps {warmup + 1} or more (or fewer --warmup-steps)")
    if args.checkpoint_dir is None:
        return
    if forward:
        raise UsageError(f"{args.out} runs forward passes only ({why}): there is no training state to checkpoint")
    if args.resume and (args.verify or args.verify_stages_only):
        raise UsageError("--verify checks the first step from the compiled weights; it cannot be combined "
                         "with --resume")
    latest = read_latest(Path(args.checkpoint_dir))
    if latest is None and args.resume:
        raise PipeccError(f"--resume: {args.checkpoint_dir} holds no checkpoint (no {LATEST}); run without --resume "
                          "to start one")
    if latest is not None and not args.resume:
        raise PipeccError(f"{args.checkpoint_dir} already holds a checkpoint (step {latest['step']}): give --resume "
                          "to continue from it, or another --checkpoint-dir to start over")
    if latest is not None:  # the options it was trained with, --steps against its step (refusals only here)
        check_resume(latest, run_options(args.optimizer, args.lr, args.seed, m), args.steps, Path(args.checkpoint_dir))





def build_schedule(kind: str | Schedule, world: int, microbatches: int, stages_per_rank: int = 1,
                   sizes: Sequence[Sequence[int]] | None = None,
                   balancing: Sequence[dict] | None = None) -> Schedule:
    """The validated schedule for ``world`` ranks; ``kind`` is a ``Schedule`` (a compiled
    folder's ``schedule.txt``, parsed), a name or the schedule's text form.

    A name is built by ``pipecc.ir.schedule.schedule_for``, the same function the planner and
    compile use. ``sizes`` (unequal micro-batches, one list per stage): "gpipe" and "1f1b" run
    them (``gpipe_uneven``, ``one_f_one_b_uneven``), and ``microbatches`` is ignored (the longest
    list counts).
    ``balancing`` (BPipe pairs, ``pipecc.techniques.bpipe.thresholds``): only "1f1b" with one stage per rank runs
    them, as ``bpipe(one_f_one_b(world, m), thresholds, policy)``."""
    for technique in TECHNIQUES:  # their rules again on this run's placement (`at_run`)
        at_run = getattr(technique, "at_run", None)
        built = at_run(kind, world, microbatches, stages_per_rank, sizes, balancing) if at_run else None
        if built is not None:
            return built
    if isinstance(kind, Schedule):
        return _checked(kind, world)
    if kind.lstrip().startswith(("rank ", "sizes:", "partner:")):
        schedule = parse(kind)
        if schedule.microbatch_sizes is not None:  # NOTE: the engine checks its sizes against the ports
            return _checked(schedule, world)
    elif kind not in SCHEDULES:
        raise UsageError(f"unknown schedule {kind!r}; choose from {', '.join(SCHEDULES)} or give schedule text")
    elif kind not in VIRTUAL and stages_per_rank != 1:
        raise PipeccError(f"schedule {kind!r} puts one stage on each rank, got {stages_per_rank} per rank; "
                          f"use --schedule {' or '.join(VIRTUAL)}")
    else:
        try:
            schedule = schedule_for(kind, world * stages_per_rank, microbatches, num_ranks=world)
        except ScheduleError as e:
            raise PipeccError(f"invalid schedule: {e.summary}") from None
        except ValueError as e:
            if kind not in VIRTUAL:
                raise  # NOTE: as before; only interleaved's stage-count errors are reported as usage problems
            raise PipeccError(str(e)) from None
    schedule = _checked(schedule, world)
    if schedule.num_microbatches != microbatches:
        raise PipeccError(f"schedule has {schedule.num_ranks} ranks and {schedule.num_microbatches} microbatches, "
                          f"the run {world} and {microbatches}")
    return schedule


def _checked(schedule: Schedule, world: int) -> Schedule:
    """``schedule`` once it validates and has ``world`` ranks (one-line PipeccError otherwise)."""
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipeccError(f"invalid schedule: {e.summary}") from None
    if schedule.num_ranks != world:
        raise PipeccError(f"schedule has {schedule.num_ranks} ranks, the run {world}")
    return schedule


def check_trace_path(path: str | os.PathLike, args: Any = None) -> Path:
    """``--trace PATH`` resolved, once it can be written by the one output-file rule
    (``pipecc.runtime.outfile``: never the compiled folder's files, its model file or the
    checkpoint folder's, a file pipecc did not write only with ``--force``; a character device
    or a read pipe written into); a one-line PipeccError otherwise. Checked before any process
    starts, so a bad path costs no run. ``args``: the run's arguments (out, checkpoint_dir, force)."""
    from pipecc.runtime import outfile
    inputs: list[Any] = []
    if args is not None and getattr(args, "out", None) is not None:
        inputs = [*outfile.compiled_inputs(args.out), getattr(args, "checkpoint_dir", None)]
    target = outfile.check(path, "--trace", inputs, bool(getattr(args, "force", False)))
    p = target.real
    if target.kind in ("device", "fifo"):
        return p
    if not p.parent.is_dir():
        raise PipeccError(f"--trace {path}: folder {p.parent} does not exist; create it or trace elsewhere")
    if not os.access(p.parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise PipeccError(f"--trace {path}: cannot write in {p.parent}; give a writable path")
    return p
