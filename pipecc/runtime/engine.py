"""The distributed pipeline engine: ``PipelineRuntime`` runs one rank's stages by the schedule,
exchanging values with the neighbouring stages' ranks point to point.

Rank r holds the stages the schedule places on it: stage r for GPipe, 1F1B and inference,
stages r, r+P, r+2P, ... for interleaved 1F1B. ``PipelineRuntime`` executes the rank's action
list from ``pipecc.ir.schedule`` (``build_schedule``: a compiled folder's ``schedule.txt``, or
one built by name) literally, so a schedule's memory behaviour is real: GPipe stashes m
microbatches per stage, 1F1B at most p - r. What a stage receives and sends is
``pipecc.runtime.ports``; how it travels, ``pipecc.runtime.wire``.

Zero-bubble (I and W actions, ``zb-h1``): I computes the gradient of the stage's received inputs
only, so SEND_B can go upstream at once; the stash stays until W, which accumulates the
parameters' gradients and frees the graph (how, and what it costs: ``pipecc.runtime.split_backward``).

Activation balancing (BPipe, ``RunConfig.activation_balancing``, ``pipecc.runtime.stash``): the
schedule is ``bpipe(one_f_one_b(p, m), thresholds)`` (1F1B, one stage per rank; anything else is
refused). A micro-batch the schedule evicts (it has a ``SEND_S``) runs its forward under
saved-tensor hooks that file every saved activation in its store; SEND_S packs the store's
storages into one payload, sends it to the partner stage p-1-s and drops them (the wire lets
go of the payload once the send completed, ``Wire.collect``); the partner keeps them from RECV_S to SEND_R; RECV_R posts their receive (a prefetch) and B
waits for it first, so ``unpack`` finds them. Inputs and outputs of the stage stay (the engine holds them).

Loss. On the last stage microbatch i's loss is ``loss_fn(outputs, target_i)`` (``outputs`` is the
single output, or the tuple when there are several; without ``loss_fn`` the first output is the
loss) times ``n_i / n``, the microbatch's share of the batch (``1/m`` for equal splits); the
target is split along dim 0 like the batch. When
``loss_fn`` is a per-sample mean, the accumulated gradients are those of the full-batch mean loss,
and ``step`` returns that full-batch loss.

Unequal micro-batches (UMPIPE; ``RunConfig.microbatch_sizes``, one size list per stage): the
schedule is ``gpipe_uneven`` (GPipe's row order; other schedules and replicas are refused),
every stage splits its own inputs and target by its own sizes, receives upstream chunks whole
and re-slices them (``pipecc.runtime.reslice``), and the last stage weights chunk k's loss by
``b_k / B``.

Faults. Every wait has a deadline of ``timeout_s``; a dead or hung peer gives
``PipeccError("rank 1: timed out after 5.0 s waiting for RECV_F mb 2 from rank 0")`` (or "failed"
when the connection broke) instead of a hang. The process group is created with the same timeout
(``init_distributed``).

Checkpoints: ``stage_<rank>.safetensors`` (module state as ``model.<stage>.<key>``, optimizer
tensors as ``optim.<path>``, the RNG state as ``rng.cpu``/``rng.cuda``) and ``stage_<rank>.json``
(step, placement, the optimizer's non-tensor state); no pickle anywhere. Each file is written
under a temporary name and renamed; ``pipecc.runtime.checkpoints`` makes a set of them atomic
across ranks (``pipecc run --checkpoint-dir``).

Replicas (PP x DP, ``pipecc.runtime.replicas``): with ``replicas`` given, ``rank``/``world`` are
this process's pipeline rank and the number of pipeline ranks; messages go to the same replica of
the neighbouring ranks (``global_rank``/``global_world`` are the process group's), each
micro-batch loss is weighted by the replica's share of the batch, ``step`` all-reduces the
stages' gradients over the replicas (started from the last backward, overlapping it) and
returns the full-batch loss. The caller gives replica-sized ports, inputs and target.

Bi-Partition (``pipecc.runtime.segments``): a stage module that is a ``BipartitionWorker`` runs
F and B through its ``WorkerProgram`` (core under autograd, misplaced segments through their
AOT forward/backward graphs); its forward message carries the values crossing its forward cut
plus any segment's saved tensors, its backward message the gradients at its backward cut plus
any saved tensors (``SAVED`` ports after the usual ones); a message with saved tensors sends
all its tensors as one packed payload (``wire.pack_tensors``, ``_recv_packed``: one message,
as the planner charges a boundary). ``after_optimizer_step`` refreshes the segments' replicas
from their owners (also after ``load_checkpoint``); with ``refresh_follows`` (dist.py's
training loop) a replica's receive is posted into its parameters right after the rank's last
forward of the step, so the transfer overlaps the rank's remaining backwards. Equal
micro-batches, no replicas, no zero-bubble split.

Timing: with ``timer`` set (an ``ActionTimer``, ``pipecc run --json``) every action runs through
it, which times F and B and the receive waits (``pipecc.runtime.timing``); None costs nothing.

The NCCL path is written to the same contract but is only exercised on machines with several
GPUs; the tests run gloo on CPU.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.registry import SCHEDULES, VIRTUAL, schedule_for
from pipecc.ir.schedule.text import ScheduleError, parse
from pipecc.ir.schedule.transforms import forward_only, with_collectives
from pipecc.ir.schedule.validate import validate
from pipecc.runtime.ports import (
    Port,
    StagePorts,
    as_tuple,
    describe,
    flatten,
    from_json,
    microbatch_extents,
    split_batch,
    split_sizes,
    to_json,
    unflatten,
)
from pipecc.runtime.replicas import GradientAllReduce, Replicas
from pipecc.runtime.reslice import Reslicer, check_sizes
from pipecc.runtime.segments import SAVED, BipartitionWorker, WorkerProgram
from pipecc.runtime.split_backward import input_backward, weight_backward
from pipecc.runtime.stash import (Prefetch, SavedTensors, bpipe_thresholds, module_storages, recv_packed, send_stash,
                                  storage_key)
from pipecc.runtime.timing import ActionTimer
from pipecc.runtime.wire import (
    Wire,
    check_fifo,
    decode_object,
    directed_groups,
    encode_object,
    fingerprint,
    pack_tensors,
    packed_layout,
    packed_views,
    peer_rank,
    send_release,
)

__all__ = ["PipelineRuntime", "RunConfig", "build_schedule", "init_distributed"]

# NOTE(size): PipelineRuntime is the interpreter of the schedule IR, one method per action kind
# (F, B, I, W, SEND/RECV) around one shared state (inbox, outbox, stash); the zero-bubble split,
# the replica groups' arithmetic and Bi-Partition's pieces already live in split_backward.py,
# replicas.py and segments.py (what stays here: their hooks into the actions and messages).

MAX_PORTS = 1024  # values crossing one stage boundary


# ---------------------------------------------------------------------------- schedules


@dataclass
class RunConfig:
    """How to run: the schedule (a name, schedule text ``rank 0: ...``, or a parsed ``Schedule``:
    a compiled folder's ``schedule.txt``), microbatches, limits.

    ``timeout_s`` bounds every single wait for a peer, so it must exceed the longest legitimate
    one — in GPipe, rank 0 waits for its first gradient for nearly a whole iteration.
    """

    schedule: str | Schedule
    microbatches: int
    timeout_s: float = 60.0
    backend: str | None = None  # None: nccl on CUDA, else gloo
    device: str | None = None  # None: cuda:LOCAL_RANK when CUDA is available, else cpu
    microbatch_sizes: Sequence[Sequence[int]] | None = None  # per stage (UMPIPE); None: m equal
    # BPipe: pipecc.json's pairs [{"evictor", "acceptor", "threshold", "policy"}]; None/[]: off
    activation_balancing: Sequence[dict] | None = None


def build_schedule(kind: str | Schedule, world: int, microbatches: int, stages_per_rank: int = 1,
                   sizes: Sequence[Sequence[int]] | None = None,
                   balancing: Sequence[dict] | None = None) -> Schedule:
    """The validated schedule for ``world`` ranks; ``kind`` is a ``Schedule`` (a compiled
    folder's ``schedule.txt``, parsed), a name or the schedule's text form.

    A name is built by ``pipecc.ir.schedule.schedule_for``, the same function the planner and
    compile use. ``sizes`` (unequal micro-batches, one list per stage): only "gpipe" runs them
    (``gpipe_uneven``), and ``microbatches`` is ignored (the longest list counts).
    ``balancing`` (BPipe pairs, ``bpipe_thresholds``): only "1f1b" with one stage per rank runs
    them, as ``bpipe(one_f_one_b(world, m), thresholds, policy)``."""
    if isinstance(kind, Schedule):
        if balancing:  # the folder's record of its BPipe pairs must still be one the runtime can run
            bpipe_thresholds(balancing, kind.num_stages)
        return _checked(kind, world)
    if balancing:
        thresholds, policy = bpipe_thresholds(balancing, world * stages_per_rank)
        if kind != "1f1b" or stages_per_rank != 1 or sizes is not None:
            what = f"schedule {kind!r}" if kind != "1f1b" else (
                f"{stages_per_rank} stages per rank" if stages_per_rank != 1 else "unequal micro-batch sizes")
            raise UsageError(f"activation balancing (BPipe) runs under the 1f1b schedule with one stage per rank, "
                             f"not {what}; drop --schedule or compile with --activation-balancing off")
        try:
            return schedule_for("1f1b", world, microbatches, bpipe_thresholds=thresholds, bpipe_policy=policy)
        except (ValueError, ScheduleError) as e:
            raise PipeccError(f"activation balancing: {getattr(e, 'summary', e)}") from None
    if sizes is not None:
        if kind != "gpipe":
            raise UsageError(f"unequal micro-batch sizes run under the gpipe schedule only, not {kind!r}; "
                             "drop --schedule or compile with equal micro-batches")
        try:
            return schedule_for("gpipe", len(sizes), microbatches, num_ranks=world, microbatch_sizes=sizes)
        except ValueError as e:
            raise PipeccError(f"microbatch_sizes: {getattr(e, 'summary', e)}") from None
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


def _name(schedule: str | Schedule) -> str:
    """How an error message names a run's schedule: its name, or "(given as text)"."""
    if isinstance(schedule, Schedule) or schedule.lstrip().startswith(("rank ", "sizes:", "partner:")):
        return "(given as text)"
    return repr(schedule)


def _checked(schedule: Schedule, world: int) -> Schedule:
    """``schedule`` once it validates and has ``world`` ranks (one-line PipeccError otherwise)."""
    try:
        validate(schedule)
    except ScheduleError as e:
        raise PipeccError(f"invalid schedule: {e.summary}") from None
    if schedule.num_ranks != world:
        raise PipeccError(f"schedule has {schedule.num_ranks} ranks, the run {world}")
    return schedule


# ---------------------------------------------------------------------------- runtime


class PipelineRuntime:
    """Runs this rank's stage(s) of a pipeline, following the schedule's action list literally.

    ``stage`` is one module, or a list (one per stage the schedule places on this rank, in
    stage order) with ``ports`` a matching list. ``step`` runs one training iteration and
    accumulates gradients into the stage parameters (it does not zero them; the caller runs
    ``optimizer.zero_grad()`` and ``optimizer.step()``). ``optimizer`` is only needed for
    checkpoints. ``world > 1`` initialises torch.distributed from the torchrun environment
    unless it already is. Internally values travel as leaves (tuple ports opened).
    """

    def __init__(self, stage: nn.Module | Sequence[nn.Module], ports: dict | Sequence[dict], rank: int,
                 world: int, config: RunConfig, loss_fn: Callable | None = None,
                 optimizer: torch.optim.Optimizer | None = None, replicas: Replicas | None = None):
        self.modules = [stage] if isinstance(stage, nn.Module) else list(stage)
        port_list = [ports] if isinstance(ports, dict) else list(ports)
        if len(port_list) != len(self.modules):
            raise PipeccError(f"rank {rank}: {len(self.modules)} stage modules but {len(port_list)} port specs")
        self.ports = [StagePorts.from_json(p) for p in port_list]
        self.rank, self.world, self.config = rank, world, config
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.m = config.microbatches
        self.device = torch.device(config.device) if config.device else _default_device()
        self.backend = config.backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.backend == "gloo" and self.device.type != "cpu":
            raise PipeccError(f"the gloo backend sends CPU tensors only, device is {self.device}; use --backend nccl")
        self.schedule = build_schedule(config.schedule, world, self.m, len(self.modules), config.microbatch_sizes,
                                       config.activation_balancing)
        self.m = self.schedule.num_microbatches  # unequal sizes: the most chunks of any stage
        self.replicas = replicas or Replicas()
        if self.schedule.microbatch_sizes is not None:
            if self.replicas.count > 1:
                raise PipeccError("unequal micro-batch sizes cannot run with replicated stages (--replicas > 1); "
                                  "compile with --replicas 1 or equal micro-batches")
            check_sizes(self.schedule.microbatch_sizes, self.schedule.num_stages,
                        self.ports[0].batch_size)
        self.global_rank, self.global_world = self.replicas.rank_of(rank), world * self.replicas.count
        if self.global_world > 1:
            init_distributed(config)
            if (dist.get_rank(), dist.get_world_size()) != (self.global_rank, self.global_world):
                raise PipeccError(f"runtime built for rank {self.global_rank} of {self.global_world}, process group "
                                  f"says {dist.get_rank()} of {dist.get_world_size()}")
        self.stage_ids = self.schedule.stages_of(rank)
        if len(self.stage_ids) != len(self.modules):
            raise PipeccError(f"rank {rank} holds stages {self.stage_ids} in this schedule but got "
                              f"{len(self.modules)} modules")
        self._reslice = Reslicer(self.schedule, self.stage_ids, self.ports)  # unequal sizes' inbox
        self.last_stage = self.schedule.num_stages - 1
        for module in self.modules:
            module.to(self.device)
        if world > 1 and self.backend == "nccl":
            check_fifo(self.schedule)
            groups = directed_groups(self.schedule, self.replicas.count, self.replicas.index)
            self._wire = Wire(self.global_rank, config.timeout_s, nccl=True, groups=groups, by_order=True)
        else:
            self._wire = Wire(self.global_rank, config.timeout_s)
        self.grad_sync = None if self.replicas.count == 1 else GradientAllReduce(
            self.replicas.group(rank), self.global_rank, config.timeout_s, nccl=self.backend == "nccl")
        self._bip = self._bipartition()  # stage -> its Bi-Partition program (pipecc.runtime.segments)
        # the collectives the run needs (a schedule built by name, or text without them, gets them here)
        self.schedule = with_collectives(self.schedule, self.replicas.count, self._refreshing(self._bip))
        # Bi-Partition: True when the caller runs after_optimizer_step after every step (dist.py's
        # training loop): the replicas' refresh receive is then posted during the step
        self.refresh_follows = False
        self._refresh_posted: dict[int, list] = {}  # segment boundary -> its refresh's posted receives
        self.peak_stash = 0  # most microbatches stashed at once during the last step
        self.evicted: dict[int, list[int]] = {}  # BPipe: stage -> bytes of each SEND_S of the last step
        self.keep_outputs = False  # True: step() keeps the last stage's outputs for last_outputs()
        self.timer: ActionTimer | None = None  # set: every action runs through it (pipecc run --json)
        if world > 1:
            self._handshake()

    def _bipartition(self) -> dict[int, WorkerProgram]:
        """The Bi-Partition workers among this rank's stages (``pipecc.runtime.segments``); v1
        runs them one stage per rank or all in one process, equal micro-batches, no replicas,
        no zero-bubble split."""
        programs = {}
        for s, module in zip(self.stage_ids, self.modules):
            if not isinstance(module, BipartitionWorker):
                continue
            if self.replicas.count > 1 or self.schedule.microbatch_sizes is not None:
                raise PipeccError("a Bi-Partition pipeline runs without replicas and with equal micro-batches; "
                                  "compile it again without those")
            if any(a.kind in (ActionKind.I, ActionKind.W) for row in self.schedule.actions for a in row):
                raise PipeccError("a Bi-Partition pipeline cannot run a zero-bubble schedule; use 1f1b or gpipe")
            program = WorkerProgram(module)
            ports, split = self._ports(s), self._split(s)
            program.shape_of = lambda port, mb, ports=ports, split=split: port.microbatch_shape(
                mb, ports.batch_size, split)
            program.device = self.device
            programs[s] = program
        return programs

    def after_optimizer_step(self) -> None:
        """Bi-Partition: the owners of segments send their updated weights to the replicas
        (call after every ``optimizer.step()``; a no-op without Bi-Partition). A replica's
        receive was posted during the step when ``refresh_follows`` is set (``_post_refresh``);
        it lands in the replica's parameters directly."""
        if not self._bip:
            return
        for s, program in self._bip.items():
            for runner in program.module.runners:
                if not runner.owner:
                    continue
                peer_stage = runner.fp
                if peer_stage in self._bip:  # one process: copy into the replica directly
                    replica = next(r for r in self._bip[peer_stage].module.runners if r.boundary == runner.boundary)
                    with torch.no_grad():
                        for dst, src in zip(replica.module.parameters(), runner.module.parameters()):
                            dst.copy_(src)
                    continue
                peer = self.schedule.stage_to_rank[peer_stage]
                for i, p in enumerate(runner.module.parameters()):
                    self._wire.send(p.detach(), peer, self._tag(3, peer_stage, runner.boundary % self.m, i),
                                    "the replica refresh", key=("refresh", runner.boundary))
        for s in self._bip:
            self._post_refresh(s)
        for posted in self._refresh_posted.values():
            self._wire.wait(posted)
        self._refresh_posted = {}
        self._wire.flush()

    def _post_refresh(self, s: int) -> None:
        """Post the receives of stage ``s``'s replicas' refresh straight into their parameters
        (once per step). ``_run`` posts them right after the stage's last forward of a step
        when ``refresh_follows``: the replica is not read again before the refresh, and the
        transfer overlaps this rank's remaining backwards instead of following them."""
        for runner in self._bip[s].module.runners:
            if runner.owner or runner.bp in self._bip or runner.boundary in self._refresh_posted:
                continue
            params = [p.detach() for p in runner.module.parameters()]
            tags = [self._tag(3, s, runner.boundary % self.m, i) for i in range(len(params))]
            self._refresh_posted[runner.boundary] = self._wire.post(
                params, self.schedule.stage_to_rank[runner.bp], tags, "the replica refresh")

    @staticmethod
    def _refreshing(programs: dict[int, WorkerProgram]) -> list[int]:
        """Bi-Partition: the stages holding a replica of a segment another stage owns (their
        schedule row has a REFRESH)."""
        return sorted(s for s, program in programs.items() if any(not r.owner for r in program.module.runners))

    # -- public API ----------------------------------------------------------------------

    @property
    def peak_sends(self) -> int:
        """Most sending actions whose tensors were held at once during the last step/infer."""
        return self._wire.peak_inflight

    def step(self, inputs: Sequence[Any] | None = None, target: Any = None) -> float | None:
        """One training iteration; the full-batch mean loss on the rank holding the last stage."""
        if not self.schedule.is_training:
            raise PipeccError(f"schedule {_name(self.config.schedule)} has no backward; use infer()")
        self._run(self.schedule, inputs, target, training=True)
        if self.grad_sync is not None:
            self.grad_sync.wait()  # before the caller's optimizer step
        if self.last_stage in self.stage_ids:
            if self.replicas.count > 1:  # each replica's loss is its share: the sum is the full batch's
                total = torch.stack(self._losses).sum().reshape(1)
                dist.all_reduce(total, group=self.replicas.group(self.rank))
                return float(total)
            return float(sum(self._losses))
        return None

    def infer(self, inputs: Sequence[Any] | None = None) -> Any:
        """Forward the batch through the pipeline; the model outputs on the last rank, else None.

        Batched tensor outputs are concatenated over microbatches along their batch dim,
        other outputs come as a list of one value per microbatch.
        """
        with torch.no_grad():
            self._run(forward_only(self.schedule), inputs, None, training=False)
        return self.last_outputs()

    def last_outputs(self) -> Any:
        """The model outputs of the last ``infer`` (or ``step`` with ``keep_outputs`` set), merged
        over microbatches as ``infer`` returns them; None off the last rank or when none are kept."""
        chunks = self.schedule.chunks(self.last_stage)
        if self.last_stage not in self.stage_ids or len(getattr(self, "_results", {})) != chunks:
            return None
        ports = self._ports(self.last_stage)
        merged = []
        for i, port in enumerate(ports.out_leaves):
            values = [self._results[mb][i] for mb in range(chunks)]
            merged.append(torch.cat(values, port.batch_dim) if port.kind == "tensor" and port.batch_dim is not None
                          else values)
        self._results = {}
        outs = unflatten(merged, ports.sends)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _handshake(self) -> None:
        """Check with every remote neighbour that both read the same boundary from ports.json.

        Neighbours that disagree would otherwise exchange messages of the wrong size, which
        gloo reports only as a closed connection.
        """
        for s in self.stage_ids:
            if s < self.last_stage and s + 1 not in self.stage_ids:
                peer = self.replicas.rank_of(self.schedule.stage_to_rank[s + 1])
                digest = fingerprint(self._ports(s).out_leaves).to(self.device)
                self._wire.send(digest, peer, self._tag(2, s + 1, 0, 0), "the port handshake", key=s)
        for s in self.stage_ids:
            if s > 0 and s - 1 not in self.stage_ids:
                peer = self.replicas.rank_of(self.schedule.stage_to_rank[s - 1])
                got = torch.empty(32, dtype=torch.uint8, device=self.device)
                self._wire.recv([got], peer, [self._tag(2, s, 0, 0)], "the port handshake")
                if not torch.equal(got.cpu(), fingerprint(self._ports(s).in_leaves)):
                    ports = ", ".join(f"{p.name}:{describe(p)}" for p in self._ports(s).in_leaves)
                    raise PipeccError(f"rank {self.global_rank}: stage {s} receives ({ports}) but stage {s - 1} "
                                      f"on rank {peer} sends something else; are both from the same compilation?")
        self._wire.flush()

    # -- execution -----------------------------------------------------------------------

    def _run(self, schedule: Schedule, inputs: Sequence[Any] | None, target: Any, training: bool) -> None:
        self._inputs = self._split_inputs(inputs) if 0 in self.stage_ids else None
        self._targets = self._split_target(target) if training and self.last_stage in self.stage_ids else None
        # ("F"|"B", stage, mb) -> leaf values received (or handed over locally) / to send
        self._inbox: dict[tuple[str, int, int], list] = {}
        self._outbox: dict[tuple[str, int, int], list] = {}
        self._stash: dict[tuple[int, int], tuple[list, Any]] = {}  # (stage, mb) -> (input leaves, outputs)
        # after I, for W: (outputs, their grads, torch's param groups, parameters left to a walk)
        self._roots: dict[tuple[int, int], tuple[list, list | None, list, list]] = {}
        self._losses: list[torch.Tensor] = []
        self._results: dict[int, list] = {}
        # BPipe: (stage, mb) -> the saved activations of an evicted micro-batch (this rank's
        # stage); (evictor stage, mb) -> the partner's storages this rank keeps for it
        self._saved: dict[tuple[int, int], SavedTensors] = {}
        self._foreign: dict[tuple[int, int], torch.Tensor] = {}  # packed payloads (stash.pack)
        self._returning: dict[tuple[int, int], Prefetch] = {}  # RECV_R posted, B not yet run
        self._evicting = {(a.stage, a.microbatch) for a in schedule.actions[self.rank]
                          if a.kind is ActionKind.SEND_S} if training else set()
        self._moving: list[Action] = []  # SEND_S/SEND_R whose buffers may still be on their way
        self.evicted = {}
        self._reslice.reset()
        self.peak_stash = self._wire.peak_inflight = 0
        release = send_release(schedule, self.rank)
        deferred: dict[tuple[int, int], list[Action]] = {}  # BPipe: RECV_R's releases, until it arrived
        reduce_after = self._reduce_points(schedule) if training and self.grad_sync is not None else {}
        for action in schedule.actions[self.rank]:
            if action in reduce_after:  # (a REDUCE still pending of another stage completes first)
                self.grad_sync.disarm()
                self.grad_sync.arm(self._module(action.stage).parameters())
            key = (action.stage, action.microbatch)
            if action.kind.is_backward and key in self._returning:
                # BPipe: the prefetched stash must be here; waiting for it is a receive wait, and
                # only then are the sends RECV_R proves complete (send_release) released
                self._timed(Action(ActionKind.RECV_R, *key), partial(self._returned, *key))
                self._wire.release(deferred.pop(key, ()))
            self._timed(action, partial(self._execute, action, training))
            if action.kind is ActionKind.RECV_R:  # only posted: its releases wait for its arrival
                deferred[key] = release.get(action, [])
            else:
                self._wire.release(release.get(action, ()))
            if self._moving:
                self._moving = self._wire.collect(self._moving)
        self._wire.flush()
        leftover = (self._stash or self._inbox or self._outbox or self._roots or self._reslice.leftover
                    or self._saved or self._foreign or self._returning)
        assert not leftover, f"rank {self.global_rank}: schedule left {sorted(leftover)} unconsumed"
        self._inputs = self._targets = None

    def _timed(self, action: Action, execute: Callable[[], None]) -> None:
        if self.timer is None:
            execute()
        else:
            self.timer.run(action, execute)

    def _reduce_points(self, schedule: Schedule) -> set[Action]:
        """Replicas: for each REDUCE of this rank's row, the stage's last gradient action before
        it (B, or W when the backward is split): its parameters' all-reduce is started from that
        action's hooks, overlapping it, and REDUCE completes the launch."""
        last: dict[int, Action] = {}
        points = set()
        for a in schedule.actions[self.rank]:
            if a.kind.frees_stash:
                last[a.stage] = a
            elif a.kind is ActionKind.REDUCE and a.stage in last:
                points.add(last[a.stage])
        return points

    def _execute(self, a: Action, training: bool) -> None:
        s, mb = a.stage, a.microbatch
        if a.kind is ActionKind.F:
            self._forward(s, mb, training)
        elif a.kind is ActionKind.B:
            self._backward(s, mb)
        elif a.kind is ActionKind.I:
            self._backward_input(s, mb)
        elif a.kind is ActionKind.W:
            self._backward_weight(s, mb)
        elif a.kind is ActionKind.SEND_F:
            values = self._outbox.pop(("F", s, mb))
            ports = self._ports(s).out_leaves
            self._send(a, values, [*ports, *[SAVED] * (len(values) - len(ports))])  # Bi-Partition: saved after
        elif a.kind is ActionKind.SEND_B:
            values = self._outbox.pop(("B", s, mb))
            ports = self._bip[s].grad_sends if s in self._bip else [p for p in self._ports(s).in_leaves
                                                                     if p.carries_grad]
            self._send(a, values, [*ports, *[SAVED] * (len(values) - len(ports))])
        elif a.kind is ActionKind.RECV_F:
            extra = self._bip[s].forward_extra(mb, self.device) if s in self._bip and training else []
            leaves = self._recv(a, self._ports(s).in_leaves, extra)
            if training:
                for v, port in zip(leaves, self._ports(s).in_leaves):
                    if port.carries_grad:
                        v.requires_grad_(True)
            self._inbox[("F", s, mb)] = leaves
        elif a.kind is ActionKind.RECV_B:
            if s in self._bip:
                self._inbox[("B", s, mb)] = self._recv(a, self._bip[s].grad_receives,
                                                       self._bip[s].backward_extra(mb, self.device))
            else:
                self._inbox[("B", s, mb)] = self._recv(a, [p for p in self._ports(s).out_leaves if p.carries_grad])
        elif a.kind.is_stash:
            self._move_stash(a)
        elif a.kind is ActionKind.REDUCE:
            if self.grad_sync is not None:  # no replicas: nothing to reduce
                self.grad_sync.disarm()
        elif a.kind is ActionKind.REFRESH:
            if training and self.refresh_follows and s in self._bip:
                self._post_refresh(s)

    def _move_stash(self, a: Action) -> None:
        """BPipe (``pipecc.runtime.stash``): SEND_S evicts (stage, mb)'s saved activations to the
        partner, RECV_S keeps the evictor's, SEND_R sends them back, RECV_R restores them."""
        s, mb = a.stage, a.microbatch
        evictor = s if a.kind in (ActionKind.SEND_S, ActionKind.RECV_R) else self.schedule.partner[s]
        peer = self.replicas.rank_of(peer_rank(self.schedule, a))
        direction = 3 if a.kind in (ActionKind.SEND_S, ActionKind.RECV_S) else 4

        def tag_of(i: int) -> int:
            return self._tag(direction, evictor, mb, i)

        what = f"{a.kind.value} mb {mb} of stage {evictor}"
        if a.kind is ActionKind.SEND_S:
            store = self._saved.get((s, mb))
            if store is None:
                raise PipeccError(f"rank {self.global_rank}: {a} before {s}F{mb} (nothing captured to evict)")
            leaves, outs = self._stash[(s, mb)]
            resident = frozenset(storage_key(t) for t in (*leaves, *outs) if isinstance(t, torch.Tensor))
            buffers = store.evict(resident)
            self.evicted.setdefault(s, []).append(sum(b.numel() for b in buffers))
            if self.timer is not None:
                self.timer.note_eviction(s, self.evicted[s][-1])
            send_stash(self._wire, buffers, peer, tag_of, what, a, self.device)
            self._moving.append(a)
        elif a.kind is ActionKind.RECV_S:
            self._foreign[(evictor, mb)] = recv_packed(self._wire, peer, tag_of, what, self.device)  # kept whole
        elif a.kind is ActionKind.SEND_R:
            send_stash(self._wire, self._foreign.pop((evictor, mb)), peer, tag_of, what, a, self.device, counted=False)
            self._moving.append(a)
        else:  # RECV_R: a prefetch, completed right before B (``_returned``)
            self._returning[(s, mb)] = Prefetch(self._wire, peer, tag_of, what, self.device,
                                                self._saved[(s, mb)].away_sizes)

    def _returned(self, s: int, mb: int) -> None:
        """BPipe: wait for the stash RECV_R posted and put it back into (s, mb)'s store."""
        self._saved[(s, mb)].restore(self._returning.pop((s, mb)).wait())

    def _forward(self, s: int, mb: int, training: bool) -> None:
        ports = self._ports(s)
        if s == 0:
            leaves = self._inputs[mb]
        elif self._reslice.active(s):  # unequal sizes: slices of the upstream chunks it overlaps
            leaves = self._reslice.forward_leaves(s, mb, self._inbox, training)
        else:
            leaves = self._inbox.pop(("F", s, mb))
        extra: list[Any] = []
        if s in self._bip:  # Bi-Partition: core and segments (pipecc.runtime.segments)
            out_leaves, extra = self._bip[s].forward(mb, leaves, training, first=s == 0)
            outs = tuple(unflatten(out_leaves, ports.sends))
        else:
            module = self._module(s)
            with torch.set_grad_enabled(training):
                if (s, mb) in self._evicting:  # BPipe: its saved activations will leave this rank
                    store = self._saved[(s, mb)] = SavedTensors(module_storages([module]),
                                                                 f"rank {self.global_rank} stage {s} mb {mb}")
                    with store.capture():
                        outs = as_tuple(module(*unflatten(leaves, ports.receives)))
                else:
                    outs = as_tuple(module(*unflatten(leaves, ports.receives)))
            out_leaves = flatten(outs, ports.sends, f"rank {self.global_rank} stage {s} output")
        self._check(s, mb, out_leaves, ports.out_leaves)
        if s == self.last_stage:
            if not training:
                self._results[mb] = out_leaves
                return
            if self.keep_outputs:
                self._results[mb] = [o.detach() if isinstance(o, torch.Tensor) else o for o in out_leaves]
            loss = self._loss(outs, mb)
            self._losses.append(loss.detach())
            self._stash[(s, mb)] = (leaves, loss)
        else:
            if training:
                self._stash[(s, mb)] = (leaves, out_leaves)
            if s + 1 in self.stage_ids:  # local neighbour: hand over detached copies, like a receive
                self._inbox[("F", s + 1, mb)] = [
                    o.detach().requires_grad_(training and p.carries_grad) if p.kind == "tensor" else o
                    for o, p in zip(out_leaves, ports.out_leaves)] + list(extra)
            else:
                self._outbox[("F", s, mb)] = [*out_leaves, *extra]
        self.peak_stash = max(self.peak_stash, len(self._stash))

    def _backward(self, s: int, mb: int) -> None:
        in_leaves, outs = self._stash.pop((s, mb))
        if s in self._bip:  # Bi-Partition: the program's backward, then the usual hand-over
            received = None if s == self.last_stage else self._inbox.pop(("B", s, mb))
            upstream = self._bip[s].backward(mb, received, outs if s == self.last_stage else None, first=s == 0)
            if upstream is not None and s - 1 in self.stage_ids:
                self._inbox[("B", s - 1, mb)] = upstream
            elif upstream is not None:
                self._outbox[("B", s, mb)] = upstream
            return
        ports = self._ports(s)
        if s == self.last_stage:
            torch.autograd.backward(outs)  # the scaled loss
        else:
            grads = iter(self._inbox.pop(("B", s, mb)))
            pairs = [(o, next(grads)) for o, p in zip(outs, ports.out_leaves) if p.carries_grad]
            pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        self._saved.pop((s, mb), None)  # BPipe: its saved activations were unpacked
        if s == 0:
            return
        if self._reslice.active(s):  # unequal sizes: the upstream chunks whose gradient is complete
            ready = self._reslice.backward_done(s, mb)
        else:
            ready = [(mb, [x.grad if x.grad is not None else torch.zeros_like(x)
                           for x, p in zip(in_leaves, ports.in_leaves) if p.carries_grad])]
        for j, input_grads in ready:
            if s - 1 in self.stage_ids:
                self._inbox[("B", s - 1, j)] = input_grads
            else:
                self._outbox[("B", s, j)] = input_grads

    def _output_grads(self, s: int, mb: int, outs: Any) -> tuple[list, list | None]:
        """The backward's roots and their gradients: the scaled loss on the last stage (no
        gradient), else the outputs that carry one with the gradients received for them."""
        if s == self.last_stage:
            return [outs], None
        grads = iter(self._inbox.pop(("B", s, mb)))
        pairs = [(o, next(grads)) for o, p in zip(outs, self._ports(s).out_leaves) if p.carries_grad]
        pairs = [(o, g) for o, g in pairs if isinstance(o, torch.Tensor) and o.requires_grad]
        return [o for o, _ in pairs], [g for _, g in pairs]

    def _backward_input(self, s: int, mb: int) -> None:
        """Zero-bubble I: the gradient of the stage's inputs, handed to stage s - 1; what W
        needs is kept (module docstring)."""
        in_leaves, outs = self._stash[(s, mb)]
        roots, grads = self._output_grads(s, mb, outs)
        params = [q for q in self._module(s).parameters() if q.requires_grad]
        ports = self._ports(s)
        wanted = [x for x, p in zip(in_leaves, ports.in_leaves) if p.carries_grad] if s > 0 else []
        need = [x for x in wanted if isinstance(x, torch.Tensor) and x.requires_grad]
        got: Sequence[Any] = ()
        groups: list = []
        walk = params  # stage 0, or nothing to differentiate: W walks for every parameter
        if roots and need:
            got, groups, walk = input_backward(roots, grads, need, params)
        if walk:
            self._roots[(s, mb)] = (roots, grads, groups, walk)
        else:  # NOTE: W starts from torch's saved gradients: let go of the rest of the graph
            self._roots[(s, mb)] = ([], None, groups, walk)
            self._stash[(s, mb)] = ([], None)
        if s == 0:
            return  # no input gradient to send
        found = {id(x): g for x, g in zip(need, got)}
        input_grads = [found[id(x)] if found.get(id(x)) is not None else torch.zeros_like(x) for x in wanted]
        if s - 1 in self.stage_ids:
            self._inbox[("B", s - 1, mb)] = input_grads
        else:
            self._outbox[("B", s, mb)] = input_grads

    def _backward_weight(self, s: int, mb: int) -> None:
        """Zero-bubble W: the parameters' gradients, accumulated into ``.grad``; frees the graph
        and the stash of (s, mb)."""
        self._stash.pop((s, mb))
        roots, grads, groups, walk = self._roots.pop((s, mb))
        if roots and walk:
            torch.autograd.backward(roots, grads, inputs=walk, retain_graph=bool(groups))
        if groups:
            weight_backward([q for q in self._module(s).parameters() if q.requires_grad], groups)

    def _loss(self, outs: tuple, mb: int) -> torch.Tensor:
        value = outs[0] if len(outs) == 1 else outs
        loss = self.loss_fn(value, self._targets[mb]) if self.loss_fn is not None else outs[0]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise PipeccError(f"rank {self.global_rank}: the loss must be a scalar tensor, got "
                              f"{getattr(loss, 'shape', type(loss).__name__)}; pass loss_fn")
        n = self._ports(self.last_stage).batch_size
        if self.schedule.microbatch_sizes is not None:  # b_k / B (n: the sizes' sum, check_sizes)
            share = self.schedule.microbatch_sizes[self.last_stage][mb] / sum(self.schedule.microbatch_sizes[0])
        else:
            share = split_sizes(n, self.m)[mb] / n if n is not None else 1.0 / self.m
        return loss.reshape(()) * (share * self.replicas.weight)

    # -- communication -------------------------------------------------------------------

    def _tag(self, direction: int, stage: int, mb: int, leaf: int) -> int:
        """The gloo tag of a leaf's first message (even; an object's payload gets tag + 1).

        Both ends compute it from (direction, receiving stage, mb, leaf) alone, so it must not
        depend on anything only one side knows. Unique within a step: ``self.m`` is the largest
        chunk count of any stage (unequal sizes: ``mb`` is the upstream stage's chunk).
        """
        tag = (((direction * self.schedule.num_stages + stage) * self.m + mb) * MAX_PORTS + leaf) * 2
        if leaf >= MAX_PORTS or tag >= 2**31:
            raise PipeccError(f"too many ports ({leaf + 1}), stages or microbatches for 31-bit message tags")
        return tag

    def _send(self, a: Action, values: Sequence[Any], ports: Sequence[Port]) -> None:
        peer = self.replicas.rank_of(peer_rank(self.schedule, a))
        forward = a.kind is ActionKind.SEND_F
        receiver = a.stage + 1 if forward else a.stage - 1
        what = f"{a.kind.value} mb {a.microbatch}"
        payloads = []
        packed = any(p is SAVED for p in ports)  # Bi-Partition: its tensors go as one payload (wire.pack_tensors)
        if packed:
            tensors = [i for i, port in enumerate(ports) if port.kind == "tensor"]
            self._wire.send(pack_tensors([values[i] for i in tensors], self.device), peer,
                            self._tag(0 if forward else 1, receiver, a.microbatch, tensors[0]), what, key=a)
        for i, (v, port) in enumerate(zip(values, ports)):
            tag = self._tag(0 if forward else 1, receiver, a.microbatch, i)
            if port.kind == "tensor":
                if not packed:
                    self._wire.send(v, peer, tag, what, key=a)
            else:
                data = encode_object(v, f"{what} port {port.name!r}").to(self.device)
                length = torch.tensor([data.numel()], dtype=torch.int64, device=self.device)
                self._wire.send(length, peer, tag, what, key=a)
                payloads.append((data, tag + 1))
        for data, tag in payloads:
            self._wire.send(data, peer, tag, what, key=a)

    def _recv(self, a: Action, ports: Sequence[Port], extra: Sequence[torch.Tensor] = ()) -> list[Any]:
        peer = self.replicas.rank_of(peer_rank(self.schedule, a))
        direction = 0 if a.kind is ActionKind.RECV_F else 1
        what = f"{a.kind.value} mb {a.microbatch}" + (f" of stage {a.stage}" if len(self.stage_ids) > 1 else "")
        batch = self._ports(a.stage).batch_size
        first: list[torch.Tensor] = []
        for port in ports:
            if port.kind == "tensor":  # RECV_F: an upstream chunk (unequal sizes: its own size)
                shape = port.microbatch_shape(a.microbatch, batch, self._split(
                    a.stage - 1 if a.kind is ActionKind.RECV_F else a.stage))
                first.append(torch.empty(shape, dtype=port.dtype, device=self.device))
            else:
                first.append(torch.empty(1, dtype=torch.int64, device=self.device))
        tags = [self._tag(direction, a.stage, a.microbatch, i) for i in range(len(ports) + len(extra))]
        if extra:  # Bi-Partition's saved tensors: every tensor leaf arrives in one payload (``_send``)
            first, extra = self._recv_packed(first, ports, extra, peer, tags, what)
        else:
            self._wire.recv([*first, *extra], peer, tags, what)
        objects = [i for i, p in enumerate(ports) if p.kind == "object"]
        if not objects:
            return [*first, *extra]
        payloads = [torch.empty(int(first[i].item()), dtype=torch.uint8, device=self.device) for i in objects]
        self._wire.recv(payloads, peer, [tags[i] + 1 for i in objects], what)
        values: list[Any] = list(first)
        for i, data in zip(objects, payloads):
            values[i] = decode_object(data, self.device)
        return [*values, *extra]

    def _recv_packed(self, first: list[torch.Tensor], ports: Sequence[Port], extra: Sequence[torch.Tensor], peer: int,
                     tags: Sequence[int], what: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Receive a message whose tensor leaves (``first``'s tensor ports, then ``extra``) travel
        packed, with the object ports' lengths; returns the leaves as views of the payload."""
        leaves = [i for i, p in enumerate(ports) if p.kind == "tensor"]
        objects = [i for i, p in enumerate(ports) if p.kind != "tensor"]
        tensors = [first[i] for i in leaves] + list(extra)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        payload = torch.empty(packed_layout(specs)[1], dtype=torch.uint8, device=self.device)
        self._wire.recv([payload, *[first[i] for i in objects]], peer,
                        [tags[leaves[0] if leaves else len(ports)], *[tags[i] for i in objects]], what)
        views = packed_views(payload, specs)
        for i, v in zip(leaves, views):
            first[i] = v
        return first, views[len(leaves):]

    # -- helpers ---------------------------------------------------------------------------

    def _split(self, stage: int) -> int | tuple[int, ...]:
        """How ``stage`` splits the batch: its chunk sizes (unequal micro-batches), else m."""
        sizes = self.schedule.microbatch_sizes
        return self.m if sizes is None else sizes[stage]

    def _module(self, stage: int) -> nn.Module:
        return self.modules[self.stage_ids.index(stage)]

    def _ports(self, stage: int) -> StagePorts:
        return self.ports[self.stage_ids.index(stage)]

    def _check(self, s: int, mb: int, leaves: Sequence[Any], ports: Sequence[Port]) -> None:
        """Fail early, naming the port, when an output does not match the spec its peer relies on."""
        batch = self._ports(s).batch_size
        for v, port in zip(leaves, ports):
            if port.kind != "tensor":
                continue
            shape = port.microbatch_shape(mb, batch, self._split(s))
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape or v.dtype != port.dtype:
                got = f"{list(v.shape)} {str(v.dtype).removeprefix('torch.')}" if isinstance(v, torch.Tensor) \
                    else type(v).__name__
                raise PipeccError(f"rank {self.global_rank} stage {s} mb {mb}: output {port.name!r} is {got}, "
                                  f"ports.json says {list(shape)} {str(port.dtype).removeprefix('torch.')}")

    def _split_inputs(self, inputs: Sequence[Any] | None) -> list[list[Any]]:
        """Stage 0's inputs as leaves, one list per microbatch (batched leaves split, others shared)."""
        ports = self._ports(0)
        inputs = as_tuple(inputs) if inputs is not None else ()
        if len(inputs) != len(ports.receives):
            raise PipeccError(f"rank {self.global_rank}: stage 0 takes {len(ports.receives)} inputs "
                              f"({', '.join(p.name for p in ports.receives)}), got {len(inputs)}")
        per_leaf = []
        for v, port in zip(flatten(inputs, ports.receives, "inputs"), ports.in_leaves):
            if port.kind == "tensor":
                v = v.to(self.device)
                if tuple(v.shape) != port.shape or v.dtype != port.dtype:
                    raise PipeccError(f"input {port.name!r} is {list(v.shape)} {v.dtype}, the compiled stage "
                                      f"expects {list(port.shape)} {port.dtype}")
            extents = port.extents(ports.batch_size, self._split(0))
            per_leaf.append(torch.split(v, extents, port.batch_dim) if extents else [v] * self.schedule.chunks(0))
        return [[values[mb] for values in per_leaf] for mb in range(self.schedule.chunks(0))]

    def _split_target(self, target: Any) -> list[Any]:
        """The target per microbatch: tensors (or a tuple/list of them) split along dim 0."""
        batch = self._ports(self.last_stage).batch_size
        split_as, chunks = self._split(self.last_stage), self.schedule.chunks(self.last_stage)

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            t = t.to(self.device)
            if batch is None:
                return split_batch(t, self.m)
            return list(torch.split(t, microbatch_extents(t.shape[0], batch, split_as, "target"), dim=0))

        if isinstance(target, torch.Tensor):
            return split(target)
        if isinstance(target, (tuple, list)) and target and all(isinstance(t, torch.Tensor) for t in target):
            parts = [split(t) for t in target]
            return [type(target)(p[i] for p in parts) for i in range(chunks)]
        return [target] * chunks

    # -- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self, directory: str | os.PathLike, step: int) -> Path:
        """Write ``stage_<rank>.safetensors`` and ``stage_<rank>.json`` into ``directory``."""
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors: dict[str, torch.Tensor] = {}
        for s, module in zip(self.stage_ids, self.modules):
            for key, t in module.state_dict().items():
                tensors[f"model.{s}.{key}"] = t.detach().cpu().clone(memory_format=torch.contiguous_format)
        # NOTE: the RNG state too, so dropout masks after a resume are those of an uninterrupted run
        tensors["rng.cpu"] = torch.get_rng_state()
        if self.device.type == "cuda":
            tensors["rng.cuda"] = torch.cuda.get_rng_state(self.device)
        meta: dict[str, Any] = {"format": "pipecc-checkpoint/1", "step": step, "rank": self.global_rank,
                                "world": self.global_world, "stages": self.stage_ids}
        if self.optimizer is not None:
            meta["optimizer"] = {"class": type(self.optimizer).__name__,
                                 "state": to_json(self.optimizer.state_dict(), tensors, "optim")}
        base = directory / f"stage_{self.global_rank}"  # one file per rank, each replica its own
        save_file(tensors, f"{base}.safetensors.tmp")
        os.replace(f"{base}.safetensors.tmp", f"{base}.safetensors")
        Path(f"{base}.json.tmp").write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(f"{base}.json.tmp", f"{base}.json")
        return Path(f"{base}.safetensors")

    def load_checkpoint(self, directory: str | os.PathLike) -> int:
        """Restore module (and optimizer) state saved by ``save_checkpoint``; returns its step."""
        from safetensors.torch import load_file

        base = Path(directory) / f"stage_{self.global_rank}"
        if not Path(f"{base}.json").exists():
            raise PipeccError(f"no checkpoint for rank {self.global_rank} in {directory} (expected {base.name}.json)")
        meta = json.loads(Path(f"{base}.json").read_text())
        if (meta["world"], meta["stages"]) != (self.global_world, self.stage_ids):
            raise PipeccError(f"checkpoint {base}.json holds stages {meta['stages']} of a {meta['world']}-rank run, "
                              f"this rank runs stages {self.stage_ids} of {self.global_world}")
        # NOTE: on the CPU: load_state_dict copies into the parameters' devices, and optimizers
        # want their `step` counters on the CPU unless capturable.
        tensors = load_file(f"{base}.safetensors", device="cpu")
        for s, module in zip(self.stage_ids, self.modules):
            prefix = f"model.{s}."
            module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        if "rng.cpu" in tensors:
            torch.set_rng_state(tensors["rng.cpu"])
        if "rng.cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng.cuda"], self.device)
        if self.optimizer is not None:
            if "optimizer" not in meta:
                raise PipeccError(f"checkpoint {base}.json has no optimizer state")
            self.optimizer.load_state_dict(from_json(meta["optimizer"]["state"], tensors))
        self.after_optimizer_step()  # Bi-Partition: checkpoints hold the owners' weights; refresh the replicas
        return int(meta["step"])


# ---------------------------------------------------------------------------- process group


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(config: RunConfig) -> tuple[int, int]:
    """Join the process group torchrun describes (env://) unless already joined; (rank, world)."""
    if not dist.is_initialized():
        device = torch.device(config.device) if config.device else _default_device()
        backend = config.backend or ("nccl" if device.type == "cuda" else "gloo")
        kwargs: dict[str, Any] = {}
        if backend == "nccl":
            # NOTE: binding the device initialises the communicator now, while every rank is
            # here; directed_groups then splits its two-rank groups from it.
            torch.cuda.set_device(device)
            kwargs["device_id"] = device
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()

