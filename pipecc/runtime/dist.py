"""Distributed pipeline runtime, command line: ``python -m pipecc.runtime.dist OUT`` runs a compiled
folder, one process per rank, stages exchanging values point to point.

Launch one process per rank with ``pipecc run OUT`` (``pipecc.cli.run``), which starts torchrun on
``OUT/run_stage.py`` (by hand: ``torchrun --nproc-per-node P -m pipecc.runtime.dist OUT --steps N``);
the generated ``run_stage.py`` calls ``main``. This module reads the folder (``stage_<i>/``,
``pipecc.json``), loads this rank's stages and runs them; the runtime itself is in

  * ``pipecc.runtime.ports``: what crosses a stage boundary (``ports.json``), the micro-batch
    split, object values as JSON, the model's output structure;
  * ``pipecc.runtime.wire``: the transport (wire protocol, sends and receives, NCCL groups);
  * ``pipecc.runtime.engine``: ``PipelineRuntime``, which runs a rank's stages by the schedule
    (loss, faults, checkpoints), and ``init_distributed``;
  * ``pipecc.runtime.rundata``: the model's data (inputs, target, loss) and tied weights;
  * ``pipecc.runtime.replicas``: replicated stages (PP x DP): rank mapping, data slices, the
    gradient all-reduce;
  * ``pipecc.runtime.verify``: ``--verify``.

The runtime imports torch, ``pipecc.ir.schedule`` and ``pipecc.errors`` (and safetensors when
checkpointing, ``pipecc.frontend.modelfile`` for a model file) — never the compiler; the one
exception is the rank of an FPGA stage, whose executable is its C simulation, built and called by
``pipecc.backends.fpga`` (``_load_fpga_stage``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError, UsageError, printable
from pipecc.ir.schedule.registry import SCHEDULES, TRAINING_SCHEDULES
from pipecc.runtime import lifeline
from pipecc.runtime.admit import check_folder_plan
from pipecc.runtime.checkpoints import DEFAULT_LR, LATEST, RunCheckpoints, check_resume, folder_fingerprint, \
    read_latest, run_options
from pipecc.runtime.ckptlock import LOCK_ENV, CheckpointLock
from pipecc.runtime.engine import PipelineRuntime, RunConfig, build_schedule, init_distributed
from pipecc.runtime.lengths import Lengths, mark_dynamic, run_lengths
from pipecc.runtime.schedule_file import SCHEDULE_FILE, read_schedule_file
from pipecc.runtime.ports import StagePorts, as_tuple, flatten, unflatten
from pipecc.runtime.replicas import (Replicas, loss_share, replica_inputs, replica_ports, replica_problem,
                                     replica_target)
from pipecc.runtime.reslice import folder_sizes
from pipecc.runtime.rundata import RunData, TiedGradients
from pipecc.runtime.stagefile import check_folder, check_marker
from pipecc.runtime.stash import folder_balancing
from pipecc.runtime.timing import ActionTimer, gather, plan_identity, read_plan, run_document
from pipecc.runtime.trace import TraceRecorder, check_trace_path
from pipecc.runtime.trust import verify_problem
from pipecc.runtime.verify import PeerFailed, Verifier, verify_chained

__all__ = ["RankRun", "check_options", "inference_only", "load_rank", "main", "run_compiled", "train"]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipecc.runtime.dist OUT --steps N [--verify] [--schedule S]``, one process per rank.

    ``pipecc run OUT`` (``pipecc.cli.run``) starts this under torchrun through ``OUT/run_stage.py``.
    Under torchrun rank r loads its stages from ``OUT/stage_<i>/`` (through
    ``pipecc.runtime.local.load_stage``); without torchrun one process runs every stage (use
    ``--schedule interleaved`` when there are several). Schedule and micro-batches default to the
    compiled ones: under torchrun the ranks parse, validate and execute ``OUT/schedule.txt``, the
    plan's action list as compile wrote it (``pipecc.runtime.schedule_file``; a folder without
    one, or one that is invalid or does not fit the folder, is a one-line error); ``--schedule``
    or ``--microbatches`` build one by name from ``OUT/pipecc.json`` instead
    (``pipecc.ir.schedule.schedule_for``), as does one process. A pipeline compiled for CPUs only runs on the CPU over
    gloo even where CUDA is available; otherwise rank r uses cuda:LOCAL_RANK and NCCL.

    Data. When ``OUT/pipecc.json`` names a ``.py`` model file that exists, every rank imports it
    (without building the model) and calls ``example_inputs(batch_size, **model_args)`` and
    ``example_target(batch_size, **model_args)`` after seeding torch's RNG with ``--seed``, so
    every rank draws the same batch; the rank of stage 0 feeds the inputs (mapped to stage 0's
    receives through ``model_inputs``), the last rank uses the target and the file's
    ``loss_fn(outputs, target)`` on the outputs rebuilt in the model's structure. Without a
    ``loss_fn`` (or ``example_target``) the loss is the mean of the outputs, with a note. Without a
    usable model file (an ONNX model, a folder moved to another machine, no ``pipecc.json``) the
    run uses seeded random inputs of the compiled shapes and that smoke loss.

    Steps. Each step zeroes the gradients, runs ``PipelineRuntime.step``, sums the gradients of
    tied weights (a parameter used by stages on several ranks) across those ranks, and steps
    the optimizer (``--optimizer sgd|adam``, ``--lr``). The last rank prints
    ``step i: loss X, Y samples/s``: samples/s is the batch size divided by the wall time of
    the iteration on the last rank, from its ``zero_grad`` to its ``optimizer.step`` (a local
    ``time.perf_counter`` timer, no barrier: the ranks are coupled by their messages, so in
    steady state every rank's iteration takes the pipeline's period; step 0 includes start-up
    and, with ``--verify``, excludes the comparison).

    ``--verify`` (``pipecc.runtime.verify``): the first training step is checked against the
    original model in one process: each rank compares its own stages' parameter gradients
    (``--rtol``/``--atol``, default by dtype), the last rank also the outputs and the loss; a
    mismatch prints ``pipecc: error: verify: rank R stage S gradient of NAME differs: ...`` and
    exits 1. Both runs of that step have dropout off and random draws fixed (the verdict says
    so; that step's update uses those gradients); with BatchNorm and several micro-batches only eval-mode outputs are compared, before
    training. ``--verify`` needs the model file (imported only when its sha256 is the one
    ``pipecc.json`` records, ``pipecc.runtime.trust``): without one it is an error ("cannot verify:
    ...") unless ``--verify-stages-only``, which checks the pipeline's forward against all its
    stages chained on the last rank.

    Checkpoints (``pipecc.runtime.checkpoints``): ``--checkpoint-dir DIR`` saves every rank's
    model, optimizer and RNG state every ``--checkpoint-every N`` steps and after the last,
    atomically; ``--resume`` continues from the newest one (``--steps`` counts from the start),
    after checking its checksums, its state for NaN/Inf and the run's options against those it
    was trained with; one run holds the folder's lock at a time (``pipecc.runtime.ckptlock``).

    Replicated stages (``pipecc.json``: ``"replicas": d > 1``, ``pipecc.runtime.replicas``): under
    torchrun with n ranks, global rank g runs pipeline rank g // d (its stages, the schedule built
    for n // d ranks) as replica g % d: it feeds and uses its slice of every micro-batch (stage 0's
    inputs, the target), talks to the same replica of its neighbours, weights its loss by its
    share and all-reduces its stages' gradients with the other replicas (overlapped with the
    step's last backward, waited before the optimizer step; tied weights are summed after, among
    the same replica's ranks). The printed loss is the replicas' sum (the full-batch loss), and
    only replica 0 of the last stage prints; ``--verify`` checks every rank (its rows of the
    outputs); ``--json`` has a row per rank with its ``replica``; checkpoints are one file set per
    rank. Without torchrun one process runs the folder unreplicated (same numerics).

    Inference-only folders (``pipecc.json``: ``"inference_only": true`` — the plan has FPGA
    stages, which have no backward pass — or schedule "inference", compiled with --inference;
    also ``--schedule inference``) run ``--steps`` forward passes (``PipelineRuntime.infer``,
    stages in eval mode) under the inference schedule, and the last rank prints
    ``step i: forward only, Y samples/s``. A rank holding a stage with ``hls/`` runs it through
    its C simulation (``FpgaPipelineStage``, built with g++ on first use). ``--verify`` compares
    the first pass's outputs with the original model's eval-mode forward (``verify: outputs match
    the single-process run (forward only)``). ``--optimizer``/``--lr`` there are a usage error,
    and so is a training ``--schedule`` for a folder with FPGA stages.

    Activation balancing (BPipe; ``pipecc.json``'s ``activation_balancing``): under torchrun the
    schedule is ``bpipe(one_f_one_b(p, m), thresholds)`` (``pipecc.runtime.stash``); ``--schedule``
    other than 1f1b is a usage error. One process runs without it (a partner on the same rank
    would free nothing).

    Unequal micro-batches (``pipecc.json``'s ``microbatch_sizes``, one size list per stage):
    the gpipe schedule with every stage's own chunks (``pipecc.runtime.reslice``), in one
    process too; ``--schedule`` other than gpipe and ``--microbatches`` are usage errors.

    Bi-Partition folders (``pipecc.json``: ``"bipartition": "ship"``, ``pipecc.runtime.segments``):
    each rank loads its core and its adjacent segments (owned or replica), traces the segments'
    graphs on first use and refreshes the replicas after every optimizer step.

    ``--json`` (``pipecc.runtime.timing``): every rank times its stages' forward and backward
    actions and its receive waits, from step ``--warmup-steps`` (default 1) on; at the end the
    ranks' figures are gathered to the last rank, which prints one JSON document (measured next
    to ``plan.json``'s predictions) on stdout. Everything else this process prints to stdout (the
    step lines, verify's and checkpoints' lines) goes to stderr instead.

    Errors: one ``pipecc: error: rank R: ...`` line per failing rank (a traceback only with
    ``--debug``), exit 1 (2 for usage). Under torchrun a rank stops by itself when the torchrun
    agent or ``pipecc run`` is gone (``pipecc.runtime.lifeline``).
    """
    args = _parser().parse_args(argv)
    rank = os.environ.get("RANK")
    under_torchrun = rank is not None and "WORLD_SIZE" in os.environ
    if under_torchrun:
        lifeline.start(f"rank {rank}")
    stdout = sys.stdout  # --json: the document's only; everything else printed goes to stderr
    with contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext():
        code = _main(args, stdout)
    if under_torchrun:
        # NOTE: a rank ends at once, skipping interpreter teardown. A failed rank's teardown may
        # wait on a dead or hung peer's socket; a finished one's, past destroy_process_group,
        # still aborted in torch's C++ destructors ("terminate called without an active
        # exception", SIGABRT) in ~1 of 25 runs. Everything it wrote is closed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _main(args: argparse.Namespace, stdout: TextIO) -> int:
    try:
        return run_compiled(args, stdout)
    except PeerFailed:
        return 1  # another rank reported the problem
    except PipeccError as e:
        if args.debug:
            raise
        return _report(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, e.exit_code)
    except KeyboardInterrupt:
        return _report("interrupted", 130)
    except Exception as e:  # a bug, or the user's code (model file, loss) failing: one line unless --debug
        if args.debug:
            raise
        text = str(e).strip().splitlines()
        return _report(f"{type(e).__name__}: {text[0] if text else ''} (rerun with --debug for the traceback)", 1)


def _report(message: str, code: int) -> int:
    rank = os.environ.get("RANK")
    if rank is not None and not re.search(r"\brank \d+", message):
        message = f"rank {rank}: {message}"
    # NOTE: one write of the whole line: the ranks share torchrun's stderr pipe, and print's two
    # writes (text, then "\n") under PYTHONUNBUFFERED let two ranks' lines glue into one
    line = f"pipecc: error: {printable(message)}\n"
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), line.encode("utf-8", "replace"))
    except (OSError, ValueError, AttributeError):  # no real file descriptor (a test's capture)
        sys.stderr.write(line)
        sys.stderr.flush()
    return code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m pipecc.runtime.dist")
    parser.add_argument("out", type=Path, help="a compiled folder (pipecc compile -o OUT)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--schedule", help=f"{', '.join(SCHEDULES)} or schedule text (default: the compiled one)")
    parser.add_argument("--microbatches", type=int, help="default: the compiled number")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer")
    parser.add_argument("--backend", choices=("gloo", "nccl"))
    parser.add_argument("--optimizer", choices=("sgd", "adam"), help="default sgd (training only)")
    parser.add_argument("--lr", type=float, help="default 1e-3 (training only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", help="S=L or S=L1,L2,...: the steps' lengths, in turn (pipecc.runtime.lengths)")
    parser.add_argument("--verify", action="store_true", help="compare with the original model in one process")
    parser.add_argument("--rtol", type=float, default=None, help="--verify: relative tolerance (default by dtype)")
    parser.add_argument("--atol", type=float, default=None, help="--verify: absolute tolerance (default by dtype)")
    parser.add_argument("--verify-stages-only", action="store_true",
                        help="compare the pipeline with its stages chained in one process (no model file)")
    parser.add_argument("--checkpoint-dir", type=Path, help="save checkpoints here (pipecc.runtime.checkpoints)")
    parser.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default: at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document of measured vs predicted times (pipecc.runtime.timing)")
    parser.add_argument("--warmup-steps", type=int, default=1, help="--json: steps left out of the statistics")
    parser.add_argument("--trace", type=Path, help="write a Chrome trace of every action here (pipecc.runtime.trace)")
    parser.add_argument("--force", action="store_true", help="--trace: replace a file pipecc did not write")
    parser.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return parser


def _stage_dirs(out: Path) -> list[Path]:
    dirs = sorted((p for p in out.glob("stage_*") if p.is_dir() and p.name[6:].isdigit()),
                  key=lambda p: int(p.name[6:]))
    if not dirs:
        raise PipeccError(f"{out} holds no stage_<i>/ folders; run `pipecc compile` first")
    if [int(p.name[6:]) for p in dirs] != list(range(len(dirs))):
        raise PipeccError(f"{out}: stage folders {[p.name for p in dirs]} are not stage_0 .. stage_{len(dirs) - 1}")
    return dirs


def _read_marker(out: Path) -> dict[str, Any] | None:
    """``OUT/pipecc.json`` as a dict, or None when there is none."""
    path = out / "pipecc.json"
    if not path.exists():
        return None
    try:
        marker = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise PipeccError(f"{path} is unreadable ({e}); compile again") from None
    except RecursionError:
        raise PipeccError(f"{path} nests too deeply to read; it is damaged: compile again") from None
    if not isinstance(marker, dict):
        raise PipeccError(f"{path} is not a pipecc marker; compile again")
    check_marker(out, marker)
    return marker


def _compiled_device(meta: dict[str, Any] | None) -> str | None:
    """"cpu" when the pipeline was compiled for CPUs (and FPGA cards, whose stages run as a C
    simulation on the host CPU) only: then it runs on the CPU, over gloo, even where CUDA is
    available; None otherwise: the runtime's default, cuda:LOCAL_RANK with NCCL."""
    devices = (meta or {}).get("devices") or []
    if devices and all(isinstance(d, dict) and d.get("kind") in ("cpu", "fpga") for d in devices):
        return "cpu"
    return None


def _fpga_stages(meta: dict[str, Any] | None, stage_dirs: Sequence[Path]) -> list[int]:
    """The stages that run on an FPGA card: ``pipecc.json``'s ``fpga_stages``, else those with ``hls/``."""
    listed = (meta or {}).get("fpga_stages") or {}
    try:
        found = {int(k) for k in listed}
    except (TypeError, ValueError):
        found = set()
    return sorted(found | {i for i, d in enumerate(stage_dirs) if (d / "hls").is_dir()})


def inference_only(meta: dict[str, Any] | None, stage_dirs: Sequence[Path] = ()) -> tuple[bool, bool, str]:
    """(runs forward only, can never train, why) for a compiled folder.

    A folder with FPGA stages (``pipecc.json``: ``"inference_only": true``, or a ``stage_<i>/hls/``)
    can never train: the C simulation has no backward pass. One compiled with ``--inference``
    (schedule "inference") runs forward only unless a training schedule is asked for.
    """
    fpga = _fpga_stages(meta, stage_dirs)
    if fpga or (meta or {}).get("inference_only"):
        why = f"FPGA stages: {fpga}" if fpga else str((meta or {}).get("inference_only_reason")
                                                       or "compiled inference-only")
        return True, True, why
    if (meta or {}).get("schedule") == "inference":
        return True, False, "compiled with --inference"
    return False, False, ""


def _load_fpga_stage(stage_dir: Path, index: int) -> nn.Module:
    """Stage ``index``'s executable when it runs on an FPGA card: its C simulation.

    NOTE: the runtime never imports the compiler (pipecc.backends, passes, cost) for CPU/GPU
    stages, whose executable is the generated ``stage.py``. An FPGA stage's executable is the
    HLS project in ``stage_<i>/hls/`` built with g++ into a shared library and called through
    ctypes (the C-sim bridge), which only the FPGA backend can build and call; so this branch,
    taken only by the rank that holds an FPGA stage, imports it, lazily.
    """
    hls = stage_dir / "hls"
    try:
        from pipecc.backends.fpga import pipeline as fpga
        from pipecc.backends.fpga import toolchain_problem
    except ImportError as e:
        raise PipeccError(f"stage {index} runs on an FPGA ({hls}) but the FPGA backend cannot be imported "
                          f"({e})") from None
    problem = toolchain_problem()
    if problem:
        raise PipeccError(f"stage {index} runs on an FPGA through its C simulation, which cannot be built "
                          f"here: {problem}")
    usable = getattr(fpga, "_usable_hls", None)  # a temporary copy when hls/ is read-only
    where, keep = usable(hls) if usable is not None else (hls, None)
    return fpga.FpgaPipelineStage(where, index, keep=keep)


def _make_optimizer(kind: str, params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer | None:
    if not params:
        return None
    return torch.optim.Adam(params, lr=lr) if kind == "adam" else torch.optim.SGD(params, lr=lr)


@dataclass
class RankRun:
    """This rank's share of a compiled folder, loaded and checked (``load_rank``): what the
    training loop (``train``) or the forward-only loop (``_run_forward``) runs. ``lock`` is the
    ``--checkpoint-dir`` lock this process holds while it runs (None: none, or the launcher's)."""

    stage_dirs: list[Path]
    meta: dict[str, Any] | None
    specs: list[dict[str, Any]]
    forward: bool  # forward passes only (an inference-only folder, or --schedule inference)
    why: str  # why forward only, for messages
    schedule_name: str
    m: int
    batch: int
    config: RunConfig
    rank: int  # the pipeline rank
    world: int  # the pipeline ranks
    replicas: Replicas
    modules: list[nn.Module]
    ports: list[dict]
    data: RunData
    rows: tuple  # stage 0's inputs as this replica feeds them
    target: Any
    load_stage: Callable
    lock: CheckpointLock | None
    lengths: list[int]  # --length: step i runs at lengths[i % len]; [] = the folder's example length
    at_length: dict[int, tuple[RunData, tuple, Any]]  # length -> (data, rows, target)


def run_compiled(args: argparse.Namespace, stdout: TextIO | None = None) -> int:
    """The body of ``main``: load this rank's share of the folder (``load_rank``), then run the
    training loop (``train``) or the forward passes; ``--json``'s document goes to ``stdout``
    (default: ``sys.stdout``)."""
    run = load_rank(args)  # NOTE: holds the checkpoint lock until this returns
    if run.forward:
        return _run_forward(args, run.meta, run.stage_dirs, run.specs, run.data, run.modules, run.ports, run.rank,
                            run.world, run.config, run.load_stage, run.why, stdout, run.replicas, run.rows,
                            run.lengths, run.at_length)
    return train(args, run, stdout)


def load_rank(args: argparse.Namespace) -> RankRun:
    """Folder loading: check the folder and the options against it (before any process group
    exists), join the process group, and load this rank's stages, ports and data."""
    stage_dirs = _stage_dirs(args.out)
    meta = _read_marker(args.out)
    lock = _lock_checkpoints(args, create=False)  # held until this returns; a folder in use names its run
    try:
        from pipecc.runtime.local import load_stage  # lazy: the stage loader lives with the local runtime
    except ImportError:
        raise PipeccError("pipecc.runtime.local.load_stage is missing; cannot load compiled stages") from None
    specs = check_folder(args.out, len(stage_dirs), files=False)
    compiled = read_schedule_file(args.out, len(stage_dirs), meta)  # the folder's schedule.txt
    forward, never_trains, why = inference_only(meta, stage_dirs)
    if args.schedule in TRAINING_SCHEDULES and never_trains:
        raise UsageError(f"{args.out} is an inference-only pipeline ({why}): FPGA stages have no backward "
                         f"pass, so it runs forward passes only; --schedule {args.schedule} would train it")
    forward = forward and args.schedule not in TRAINING_SCHEDULES or args.schedule == "inference"
    why = why or "--schedule inference"
    if forward and (args.optimizer is not None or args.lr is not None):
        asked = " and ".join(f for f, v in (("--optimizer", args.optimizer), ("--lr", args.lr)) if v is not None)
        raise UsageError(f"{args.out} is an inference-only pipeline ({why}): it runs forward passes only, "
                         f"so {asked} would train it")
    schedule_name = args.schedule or (meta or {}).get("schedule") or "1f1b"
    m = args.microbatches or int((meta or {}).get("microbatches") or 4)
    batch = int((meta or {}).get("batch_size") or StagePorts.from_json(specs[0]).batch_size or 0)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_options(args, meta, forward, m, batch, why, one_process=not under_torchrun)
    lock = lock or _lock_checkpoints(args, create=True)  # the checks passed: a new folder may be made now
    count = _replica_count(meta) if under_torchrun else 1  # one process runs the folder unreplicated
    world_guess = int(os.environ["WORLD_SIZE"]) // count if under_torchrun else 1
    sizes = folder_sizes(meta, args.microbatches)  # unequal micro-batches: gpipe only
    # BPipe: 1f1b on one rank per stage; one process (every stage on one rank) runs without it
    balancing = folder_balancing(meta) if under_torchrun else None
    # Under torchrun the folder's schedule.txt runs as it is (forward only: without its backward
    # actions); --schedule or --microbatches build one by name from the folder's plan instead, and
    # one process (every stage on one rank) runs the schedule built for it, as below.
    use_file = under_torchrun and args.schedule is None and args.microbatches is None
    if use_file and world_guess != compiled.num_ranks:
        raise PipeccError(f"{args.out / SCHEDULE_FILE} runs on {compiled.num_ranks} pipeline ranks, this run has "
                          f"{world_guess}; start {compiled.num_ranks} (pipecc run does), or give --schedule to "
                          f"build one for {world_guess}")
    if forward and sizes is None and not use_file:
        # one stage per rank: the inference schedule; several (one process): interleaved, which
        # infer() runs without its backward actions
        schedule_name = "inference" if len(stage_dirs) == world_guess else "interleaved"
    run_schedule = compiled if use_file else schedule_name
    config = RunConfig(run_schedule, m, args.timeout, args.backend, _compiled_device(meta), sizes, balancing)
    rank, world = init_distributed(config) if under_torchrun else (0, 1)
    replicas = Replicas.create(count, rank, world)  # collective when replicated
    if count > 1 and batch:  # its slices: s_r rows of every micro-batch (equal or one apart)
        replicas.share, replicas.batch = loss_share(batch // m, count, replicas.index), batch
    rank, world = rank // count, world // count  # the pipeline rank, the pipeline ranks
    if len(stage_dirs) % world:
        raise PipeccError(f"{len(stage_dirs)} stages do not divide over {world} ranks")
    schedule = build_schedule(run_schedule, world, m, len(stage_dirs) // world, sizes, balancing)
    loaded = [load_stage(stage_dirs[s]) for s in schedule.stages_of(rank)]
    modules, ports = [mod for mod, _ in loaded], [replica_ports(p, count, replicas.index, m, replicas.batch)
                                                       for _, p in loaded]
    declared = Lengths.from_json((meta or {}).get("lengths"))
    lengths = run_lengths(getattr(args, "length", None), declared)
    if declared is not None:  # the dims that vary: their shapes travel with every message
        ports = [mark_dynamic(p, declared.symbol) for p in ports]
    batches = {n: RunData.load(meta, specs, args.seed, args.out, n) for n in lengths}  # the same on every rank
    data = batches[lengths[0]] if lengths else RunData.load(meta, specs, args.seed, args.out)
    rows, target = _replica_data(data, specs, m, replicas)
    at_length = {n: (d, *_replica_data(d, specs, m, replicas)) for n, d in batches.items()}
    if forward:
        for i, s in enumerate(schedule.stages_of(rank)):
            if (stage_dirs[s] / "hls").is_dir():
                modules[i] = _load_fpga_stage(stage_dirs[s], s)
    return RankRun(stage_dirs, meta, specs, forward, why, schedule_name, m, batch, config, rank, world, replicas,
                   modules, ports, data, rows, target, load_stage, lock, lengths, at_length)


def train(args: argparse.Namespace, run: RankRun, stdout: TextIO | None = None) -> int:
    """The training loop: ``--steps`` steps of this rank's stages (``--verify`` checks the first,
    ``--checkpoint-dir`` saves and resumes, ``--json`` times them)."""
    modules, ports, data, replicas, batch, m = run.modules, run.ports, run.data, run.replicas, run.batch, run.m
    stage_dirs, meta, specs, load_stage = run.stage_dirs, run.meta, run.specs, run.load_stage
    rows = run.rows
    params = [p for mod in modules for p in mod.parameters()]
    optimizer = _make_optimizer(args.optimizer or "sgd", params, DEFAULT_LR if args.lr is None else args.lr)
    runtime = PipelineRuntime(modules, ports, run.rank, run.world, run.config, data.loss_fn, optimizer, replicas)
    timer = _timer(args, runtime)
    is_last = runtime.last_stage in runtime.stage_ids
    speaks = is_last and replicas.index == 0  # replicas: one of the last stage's prints
    if speaks and data.note:
        print(data.note, flush=True)
    tied = TiedGradients(runtime, modules, specs)
    inputs = rows if 0 in runtime.stage_ids else None
    target = run.target if is_last else None

    verifier = None
    if args.verify_stages_only:
        outputs = runtime.infer(inputs)
        if outputs is not None:
            verify_chained(outputs, rows, [load_stage(d)[0].to(runtime.device) for d in stage_dirs], speaks)
    elif args.verify:
        verifier = Verifier(runtime, data, meta or {}, stage_dirs, load_stage, args.rtol, args.atol)
        if verifier.eval_only:
            verifier.check_eval_outputs(inputs)
            verifier = None

    def train_step(i: int, update: bool, check: bool | None = None) -> None:
        nonlocal inputs, target
        check = verifier is not None and i == 0 if check is None else check
        if run.lengths:  # --length: this step's batch (step i at the (i mod n)-th length)
            _, rows_i, target_i = run.at_length[run.lengths[i % len(run.lengths)]]
            inputs, target = (rows_i if 0 in runtime.stage_ids else None), (target_i if is_last else None)
        if timer is not None and update:
            timer.begin_step()
        start = time.perf_counter()
        if optimizer is not None:
            optimizer.zero_grad()
        runtime.keep_outputs = check
        runtime.refresh_follows = update  # Bi-Partition: after_optimizer_step follows; post its receive early
        # dropout off, draws fixed: as the reference runs
        with verifier.deterministic() if check and verifier is not None else contextlib.nullcontext():
            loss = runtime.step(inputs, target)
        tied.reduce()
        if check and verifier is not None:
            paused = time.perf_counter()
            verifier.check_step(loss)
            start += time.perf_counter() - paused
        if optimizer is not None and update:
            if runtime.trace is not None:
                runtime.trace.span("optimizer", "optimizer", optimizer.step)
            else:
                optimizer.step()
        if update:
            runtime.after_optimizer_step()  # Bi-Partition: the replicas' weight refresh
        elapsed = time.perf_counter() - start
        if timer is not None and update:
            timer.end_step(elapsed)
        if loss is not None and update and speaks:
            rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
            print(f"step {i}: loss {loss:.6g}{rate}", flush=True)

    checkpoints, first = None, 0
    if args.checkpoint_dir is not None:
        checkpoints = RunCheckpoints(args.checkpoint_dir, runtime, folder_fingerprint(stage_dirs),
                                     args.checkpoint_every, run_options(args.optimizer, args.lr, args.seed, m))
        if args.resume:
            first = checkpoints.resume()
            for note in checkpoints.notes if speaks else ():
                print(note, flush=True)
            if speaks:
                print(f"resumed from {args.checkpoint_dir / f'step_{first}'}: step {first} of --steps {args.steps}",
                      flush=True)
    if verifier is not None and len(set(run.lengths)) > 1:  # --verify at every length, before training
        verifier = None
        symbol = Lengths.from_json((meta or {}).get("lengths")).symbol  # type: ignore[union-attr]
        for k, n in enumerate(run.lengths):
            if n in run.lengths[:k]:
                continue
            if speaks:
                print(f"verify at {symbol}={n}:", flush=True)
            verifier = Verifier(runtime, run.at_length[n][0], meta or {}, stage_dirs, load_stage, args.rtol, args.atol)
            train_step(k, update=False, check=True)
        verifier = None
    elif verifier is not None and args.steps < 1:
        train_step(0, update=False)  # --verify --steps 0: check one step, train none
    for i in range(first, args.steps):
        train_step(i, update=True)
        if checkpoints is not None and checkpoints.due(i + 1, args.steps):
            where = checkpoints.save(i + 1)
            if speaks:
                print(f"checkpoint: step {i + 1} saved in {where}", flush=True)
    if timer is not None and getattr(args, "json", False):
        _print_times(runtime, timer, args.out, run.schedule_name, batch, stdout or sys.stdout)
    if runtime.trace is not None:
        runtime.trace.write(Path(args.trace).resolve(), run.schedule_name)
    if dist.is_initialized():
        # NOTE: every rank past its last message before any tears its process group down; a
        # rank destroying gloo's pairs while a peer still drains a collective (--json's gather)
        # aborted ("terminate called without an active exception") in ~1 of 12 runs.
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _lock_checkpoints(args: argparse.Namespace, create: bool) -> CheckpointLock | None:
    """``--checkpoint-dir``'s lock when this process must hold it: one process, or rank 0 of a
    torchrun started by hand; under ``pipecc run`` its launcher holds it (``LOCK_ENV``)."""
    if args.checkpoint_dir is None or os.environ.get("RANK", "0") != "0" or LOCK_ENV in os.environ:
        return None
    return CheckpointLock.take(args.checkpoint_dir, create=create)


def _replica_count(meta: dict[str, Any] | None) -> int:
    """How many replicas run every stage (``pipecc.json``'s ``replicas``; 1 when absent)."""
    try:
        count = int((meta or {}).get("replicas") or 1)
    except (TypeError, ValueError):
        count = 0
    if count < 1:
        raise PipeccError(f"pipecc.json says replicas {(meta or {}).get('replicas')!r}; compile again")
    return count


def _replica_data(data: RunData, specs: list[dict[str, Any]], m: int, replicas: Replicas) -> tuple[tuple, Any]:
    """Stage 0's inputs and the target as this replica feeds them (its slice of every
    micro-batch, ``pipecc.runtime.replicas``); the full batch without replicas."""
    if replicas.count == 1:
        return data.inputs, data.target
    first = StagePorts.from_json(specs[0])
    leaves = flatten(as_tuple(data.inputs), first.receives, "inputs")
    dims = [p.batch_dim if p.kind == "tensor" else None for p in first.in_leaves]
    rows = tuple(unflatten(replica_inputs(leaves, dims, m, replicas.count, replicas.index, replicas.batch),
                           first.receives))
    return rows, replica_target(data.target, m, replicas.count, replicas.index, replicas.batch)


def _timer(args: argparse.Namespace, runtime: PipelineRuntime) -> ActionTimer | TraceRecorder | None:
    """With ``--json``: the runtime's action timer, set; with ``--trace``: the trace recorder
    around it (``pipecc.runtime.trace``), its clock aligned (collective)."""
    warmup = getattr(args, "warmup_steps", 1)
    if getattr(args, "json", False):
        runtime.timer = ActionTimer(runtime.global_rank, runtime.device, warmup, replica=runtime.replicas.index)
    if getattr(args, "trace", None) is not None:
        runtime.timer = runtime.trace = TraceRecorder(runtime, warmup, inner=runtime.timer)
        runtime.trace.align()
    return runtime.timer


def _print_times(runtime: PipelineRuntime, timer: ActionTimer, out: Path, schedule: str, batch: int,
                 stdout: TextIO) -> None:
    """``--json``: gather every rank's times to the last stage's rank, which prints the document
    (collective: every rank calls it)."""
    dst = runtime.replicas.rank_of(runtime.schedule.stage_to_rank[runtime.last_stage], 0)
    summaries = gather(timer.summary(runtime.stage_ids), dst, runtime.device)
    if summaries is not None:
        plan = read_plan(out)
        document = run_document(summaries, plan, schedule, runtime.m, batch,
                                stash=runtime.schedule.partner is not None, identity=plan_identity(out, plan))
        print(json.dumps(document), file=stdout, flush=True)


def check_options(args: argparse.Namespace, meta: dict[str, Any] | None, forward: bool, m: int, batch: int,
                  why: str, one_process: bool = False) -> None:
    """Refuse, before any process group exists, what the run could only fail at later (one line).

    ``pipecc run`` makes the same checks before it starts torchrun (``pipecc.cli.run``); the
    techniques' rules on the folder's plan are ``pipecc.runtime.admit``'s. ``one_process`` (no
    torchrun): activation balancing is off, so any ``--schedule`` BPipe refuses goes."""
    folder_sizes(meta, args.microbatches)
    folder_balancing(meta)
    check_folder_plan(meta, read_plan(Path(args.out)), args.schedule, one_process=one_process)
    if batch and m > batch:
        raise UsageError(f"--microbatches {m} is more than the batch of {batch} rows this folder was compiled "
                         f"for; give --microbatches {batch} or fewer")
    problem = replica_problem(batch, m, _replica_count(meta))
    if problem:
        raise UsageError(f"--microbatches {m}: {problem}")
    if args.verify and not args.verify_stages_only:
        problem = verify_problem(meta, args.out)
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
    if getattr(args, "json", False) and args.steps <= warmup:
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


def _run_forward(args: argparse.Namespace, meta: dict[str, Any] | None, stage_dirs: list[Path],
                 specs: list[dict[str, Any]], data: RunData, modules: list[nn.Module], ports: list[dict],
                 rank: int, world: int, config: RunConfig, load_stage: Callable, why: str,
                 stdout: TextIO | None = None, replicas: Replicas | None = None, rows: tuple | None = None,
                 lengths: Sequence[int] = (), at_length: dict[int, tuple[RunData, tuple, Any]] | None = None) -> int:
    """An inference-only folder: ``--steps`` forward passes (eval mode) of the model's example
    inputs; ``--verify`` compares the first one's outputs with the original model's forward.
    ``--length`` (``lengths``): pass i at the (i mod n)-th length, each verified at its first pass."""
    for module in modules:
        module.eval()  # inference semantics: what an FPGA stage computes (BatchNorm folded, no dropout)
    runtime = PipelineRuntime(modules, ports, rank, world, config, replicas=replicas)
    timer = _timer(args, runtime)
    is_last = runtime.last_stage in runtime.stage_ids and runtime.replicas.index == 0  # the one that prints
    rows = data.inputs if rows is None else rows  # replicas: this replica's rows
    inputs = rows if 0 in runtime.stage_ids else None
    batch = int((meta or {}).get("batch_size") or StagePorts.from_json(specs[0]).batch_size or 0)
    if is_last:
        print(f"inference-only pipeline ({why}): running forward passes", flush=True)
    verifier = None
    verify = args.verify or args.verify_stages_only
    if args.verify and not args.verify_stages_only:
        verifier = Verifier(runtime, data, meta or {}, stage_dirs, load_stage, args.rtol, args.atol)

    def check(outputs: Any) -> None:
        if verifier is not None:
            verifier.check_forward(outputs)
        elif outputs is not None:  # no model file: against all (torch) stages chained here
            verify_chained(outputs, rows, [load_stage(d)[0].eval().to(runtime.device) for d in stage_dirs], is_last)

    for i in range(args.steps):
        first = i == 0
        if lengths and at_length is not None:  # --length: this pass's batch, verified at its first pass
            n = lengths[i % len(lengths)]
            data, rows, _ = at_length[n]
            inputs = rows if 0 in runtime.stage_ids else None
            first = n not in lengths[:i]
            if verify and first and args.verify and not args.verify_stages_only and i > 0:
                verifier = Verifier(runtime, data, meta or {}, stage_dirs, load_stage, args.rtol, args.atol)
            if verify and first and is_last:
                print(f"verify at {(meta or {}).get('lengths', {}).get('symbol')}={n}:", flush=True)
        if timer is not None:
            timer.begin_step()
        start = time.perf_counter()
        outputs = runtime.infer(inputs)
        elapsed = time.perf_counter() - start
        if timer is not None:
            timer.end_step(elapsed)
        if verify and first:
            check(outputs)
        if is_last:
            rate = f", {batch / elapsed:.1f} samples/s" if batch and elapsed > 0 else ""
            print(f"step {i}: forward only{rate}", flush=True)
    if verify and args.steps < 1:
        check(runtime.infer(inputs))  # --verify --steps 0: check one forward pass
    if timer is not None and getattr(args, "json", False):
        _print_times(runtime, timer, args.out, "inference", batch, stdout or sys.stdout)
    if runtime.trace is not None:
        runtime.trace.write(Path(args.trace).resolve(), "inference")
    if dist.is_initialized():
        # NOTE: every rank past its last message before any tears its process group down; a
        # rank destroying gloo's pairs while a peer still drains a collective (--json's gather)
        # aborted ("terminate called without an active exception") in ~1 of 12 runs.
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
