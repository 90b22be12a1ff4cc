"""A compiled folder's share for this rank, loaded and checked: ``load_rank`` (the folder read,
the options checked against it before any process group exists, the process group joined, this
rank's stages, ports and data loaded) and ``check_options``. ``pipecc.runtime.dist`` (``pipecc
run``'s ranks) and ``pipecc.runtime.distributed`` (a training script's ``pipecc.distributed.load``)
both start here.

Imports torch, ``pipecc.ir.schedule``, ``pipecc.errors`` and the runtime — never the compiler
(but for an FPGA stage's C simulation, ``_load_fpga_stage``).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from pipecc.errors import PipeccError, UsageError
from pipecc.runtime.ckptlock import LOCK_ENV, CheckpointLock
from pipecc.runtime.engine import RunConfig, init_distributed
from pipecc.runtime.folder import CompiledFolder, find_stage_dirs
from pipecc.runtime.lengths import Lengths, mark_dynamic, run_lengths
from pipecc.runtime.schedule_file import SCHEDULE_FILE
from pipecc.runtime.ports import StagePorts, as_tuple, flatten, unflatten
from pipecc.techniques.replicas.runtime import (Replicas, loss_share, replica_inputs, replica_ports,
                                     replica_target)
from pipecc.runtime.rundata import RunData
from pipecc.runtime.stagefile import check_folder
from pipecc.runtime.launch_checks import build_schedule, check_options  # torch-free: the launcher runs them too

__all__ = ["RankRun", "check_options", "folder_has_sizes", "load_rank"]


def _open_folder(out: Path) -> CompiledFolder | None:
    """``OUT``'s compiled folder (``pipecc.json`` read and checked), or None when it has none."""
    return CompiledFolder.find(out)


def folder_has_sizes(out: Path) -> bool:
    """True when the folder's plan gives its stages unequal micro-batches (``microbatch_sizes``)."""
    folder = _open_folder(out)
    return folder is not None and folder.has_sizes


def _heterogeneous(on: Sequence[str | None], backend: str | None) -> bool:
    """True when some stages run on the CPU and others on GPUs: then every rank speaks gloo (a
    GPU rank's messages go through host memory, ``pipecc.runtime.wire``); NCCL is refused."""
    mixed = "cpu" in on and any(d != "cpu" for d in on)
    if mixed and backend == "nccl":
        first = on.index("cpu")
        raise UsageError(f"stage {first} runs on the CPU, which NCCL cannot reach; use --backend gloo "
                         "(the GPU stages' messages then go through host memory)")
    return mixed


def _rank_device(on: Sequence[str | None], stages: Sequence[int], rank: int) -> str:
    """The one device a rank's stages share (a heterogeneous folder; ``CompiledFolder.stage_devices``)."""
    wanted = {on[s] for s in stages if s < len(on)}
    if len(wanted) > 1:
        raise PipeccError(f"rank {rank} holds stages {list(stages)} on different devices "
                          f"({', '.join(sorted(str(d or 'cuda') for d in wanted))}); one rank runs on one device")
    device = wanted.pop() if wanted else None
    return device or f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"


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


@dataclass
class RankRun:
    """This rank's share of a compiled folder, loaded and checked (``load_rank``): what the
    training loop (``train``) or the forward-only loop (``_run_forward``) runs. ``lock`` is the
    ``--checkpoint-dir`` lock this process holds while it runs (None: none, or the launcher's)."""

    stage_dirs: list[Path]
    folder: CompiledFolder
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

    @property
    def meta(self) -> dict[str, Any]:
        """The folder's ``pipecc.json``."""
        return self.folder.marker


def load_rank(args: argparse.Namespace) -> RankRun:
    """Folder loading: check the folder and the options against it (before any process group
    exists), join the process group, and load this rank's stages, ports and data."""
    stage_dirs = find_stage_dirs(args.out)
    folder = _open_folder(args.out)
    if folder is None:  # run_stage.py started by hand: its stage code is recorded by hash in pipecc.json
        raise PipeccError(f"{args.out} is not a folder written by `pipecc compile` (no pipecc.json), so the stage "
                          "code it would run is recorded nowhere: compile it again")
    meta = folder.marker
    lock = _lock_checkpoints(args, create=False)  # held until this returns; a folder in use names its run
    try:
        from pipecc.runtime.local import load_stage  # lazy: the stage loader lives with the local runtime
    except ImportError:
        raise PipeccError("pipecc.runtime.local.load_stage is missing; cannot load compiled stages") from None
    specs = check_folder(args.out, len(stage_dirs), files=False)
    compiled = folder.schedule_file(len(stage_dirs))  # the folder's schedule.txt
    forward = folder.forward_only(args.schedule, args.optimizer, args.lr)
    why = folder.why or "--schedule inference"
    schedule_name = args.schedule or folder.schedule
    m = folder.run_microbatches(args.microbatches)
    batch = folder.batch(specs)
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    check_options(args, folder, forward, m, batch, why, one_process=not under_torchrun)
    lock = lock or _lock_checkpoints(args, create=True)  # the checks passed: a new folder may be made now
    count = folder.replicas if under_torchrun else 1  # one process runs the folder unreplicated
    world_guess = int(os.environ["WORLD_SIZE"]) // count if under_torchrun else 1
    sizes = folder.sizes_for(args.microbatches)  # unequal micro-batches: gpipe only
    # BPipe: 1f1b on one rank per stage; one process (every stage on one rank) runs without it
    balancing = folder.activation_balancing if under_torchrun else None
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
    mixed = under_torchrun and _heterogeneous(folder.stage_devices, args.backend)
    config = RunConfig(run_schedule, m, args.timeout, args.backend or ("gloo" if mixed else None),
                       folder.compiled_device, sizes, balancing, run_precision(args, meta))
    rank, world = init_distributed(config) if under_torchrun else (0, 1)
    replicas = Replicas.create(count, rank, world)  # collective when replicated
    if count > 1 and batch:  # its slices: s_r rows of every micro-batch (equal or one apart)
        replicas.share, replicas.batch = loss_share(batch // m, count, replicas.index), batch
    rank, world = rank // count, world // count  # the pipeline rank, the pipeline ranks
    if len(stage_dirs) % world:
        raise PipeccError(f"{len(stage_dirs)} stages do not divide over {world} ranks")
    schedule = build_schedule(run_schedule, world, m, len(stage_dirs) // world, sizes, balancing)
    if mixed:  # each rank on its stages' device
        config.device = _rank_device(folder.stage_devices, schedule.stages_of(rank), rank)
    loaded = [load_stage(stage_dirs[s]) for s in schedule.stages_of(rank)]
    modules, ports = [mod for mod, _ in loaded], [replica_ports(p, count, replicas.index, m, replicas.batch)
                                                       for _, p in loaded]
    declared = folder.lengths
    lengths = run_lengths(getattr(args, "length", None), declared)
    if declared is not None:  # the dims that vary: their shapes travel with every message
        ports = [mark_dynamic(p, declared.symbol) for p in ports]
    batches = {n: RunData.load(folder, specs, args.seed, n) for n in lengths}  # the same on every rank
    data = batches[lengths[0]] if lengths else RunData.load(folder, specs, args.seed)
    rows, target = _replica_data(data, specs, m, replicas)
    at_length = {n: (d, *_replica_data(d, specs, m, replicas)) for n, d in batches.items()}
    if forward:
        for i, s in enumerate(schedule.stages_of(rank)):
            if (stage_dirs[s] / "hls").is_dir():
                modules[i] = _load_fpga_stage(stage_dirs[s], s)
    return RankRun(stage_dirs, folder, specs, forward, why, schedule_name, m, batch, config, rank, world, replicas,
                   modules, ports, data, rows, target, load_stage, lock, lengths, at_length)


def _lock_checkpoints(args: argparse.Namespace, create: bool) -> CheckpointLock | None:
    """``--checkpoint-dir``'s lock when this process must hold it: one process, or rank 0 of a
    torchrun started by hand; under ``pipecc run`` its launcher holds it (``LOCK_ENV``)."""
    if args.checkpoint_dir is None or os.environ.get("RANK", "0") != "0" or LOCK_ENV in os.environ:
        return None
    return CheckpointLock.take(args.checkpoint_dir, create=create)


def run_precision(args: argparse.Namespace, meta: dict[str, Any] | None) -> str | None:
    """The run's autocast precision (`RunConfig.precision`; None: float32): --precision (or
    ``load(precision=)``), else the one the folder was compiled for (``compile --precision``).
    `--verify` compares float32 runs: a folder's own bf16/fp16 is not used by it (a note says so);
    an explicit one is refused by `check_options`."""
    asked = getattr(args, "precision", None)
    chosen = asked or CompiledFolder(Path(getattr(args, "out", ".")), meta or {}).precision
    if asked is None and chosen != "fp32" and (getattr(args, "verify", False)
                                               or getattr(args, "verify_stages_only", False)):
        if os.environ.get("RANK", "0") == "0":
            print(f"note: --verify compares float32 runs; {args.out} was compiled for {chosen}, "
                  "which this run does not use", file=sys.stderr)
        return None
    return None if chosen == "fp32" else chosen


def _replica_data(data: RunData, specs: list[dict[str, Any]], m: int, replicas: Replicas) -> tuple[tuple, Any]:
    """Stage 0's inputs and the target as this replica feeds them (its slice of every
    micro-batch, ``pipecc.techniques.replicas.runtime``); the full batch without replicas."""
    if replicas.count == 1:
        return data.inputs, data.target
    first = StagePorts.from_json(specs[0])
    leaves = flatten(as_tuple(data.inputs), first.receives, "inputs")
    dims = [p.batch_dim if p.kind == "tensor" else None for p in first.in_leaves]
    rows = tuple(unflatten(replica_inputs(leaves, dims, m, replicas.count, replicas.index, replicas.batch),
                           first.receives))
    return rows, replica_target(data.target, m, replicas.count, replicas.index, replicas.batch)
