"""The distributed pipeline executor: ``PipelineRuntime`` runs one rank's stages by the schedule,
exchanging values with the neighbouring stages' ranks point to point.

Rank r holds the stages the schedule places on it: stage r for GPipe, 1F1B and inference,
stages r, r+P, r+2P, ... for interleaved 1F1B. ``PipelineRuntime`` executes the rank's action
list from ``pipecc.ir.schedule`` (``build_schedule``: a compiled folder's ``schedule.txt``, or
one built by name) literally, so a schedule's memory behaviour is real: GPipe stashes m
microbatches per stage, 1F1B at most p - r. It is a handler table keyed by action kind
(``_handlers``) over one ``StageRunner`` per stage (``pipecc.runtime.stage_runner``: F and B, the
stage's stash) and the messages; every other action kind is a technique's, run by the handler its
package's runtime part builds (``pipecc.runtime.handlers``: one protocol, whose hooks the engine
calls around each action and step; ``pipecc.techniques.parts("runtime")``). The runners and
handlers see the rank through one ``RankContext`` (``pipecc.runtime.context``: the schedule, the
device, the mailbox, the wire, what the caller sets between steps), never the runtime:

    SEND_F RECV_F SEND_B RECV_B   ``pipecc.runtime.messages`` (what travels: ``ports``, how: ``wire``)
    I W                           zero-bubble's (``pipecc.techniques.zero_bubble.runtime``)
    SEND_S RECV_S SEND_R RECV_R   BPipe's (``pipecc.techniques.bpipe.runtime``)
    REDUCE                        the replica groups' (``pipecc.techniques.replicas.runtime``)
    REFRESH                       Bi-Partition's (``pipecc.techniques.bipartition.runtime``, whose
                                  stages run a ``BipartitionRunner``)

Unequal micro-batches (UMPIPE; ``RunConfig.microbatch_sizes``, one size list per stage): the
schedule is ``gpipe_uneven`` or ``one_f_one_b_uneven`` (GPipe's or 1F1B's row order); every stage splits its own inputs and target by its own sizes,
receives upstream chunks whole and re-slices them (``pipecc.techniques.umpipe.runtime``), and the last
stage weights chunk k's loss by ``b_k / B``.

Loss. On the last stage microbatch i's loss is ``loss_fn(outputs, target_i)`` (``outputs`` is the
single output, or the tuple when there are several; without ``loss_fn`` the first output is the
loss) times ``n_i / n``, the microbatch's share of the batch (``1/m`` for equal splits); the
target is split along dim 0 like the batch. When ``loss_fn`` is a per-sample mean, the
accumulated gradients are those of the full-batch mean loss, and ``step`` returns that loss.

Replicas (PP x DP, ``pipecc.techniques.replicas.runtime``): with ``replicas`` given, ``rank``/``world`` are
this process's pipeline rank and the number of pipeline ranks; messages go to the same replica of
the neighbouring ranks (``global_rank``/``global_world`` are the process group's), each
micro-batch loss is weighted by the replica's share of the batch, the schedule's REDUCE actions
all-reduce the stages' gradients over the replicas (started during the last backward,
overlapping it), ``step`` waits for them and returns the full-batch loss. The caller gives
replica-sized ports, inputs and target. A schedule built by name, or text without REDUCE, gets
them here (``pipecc.ir.schedule.lower``, the lowering compile applies to schedule.txt), and a
Bi-Partition one its REFRESH actions; a lowered schedule.txt runs as written.

Faults. Every wait has a deadline of ``timeout_s``; a dead or hung peer gives
``PipeccError("rank 1: timed out after 5.0 s waiting for RECV_F mb 2 from rank 0")`` (or "failed"
when the connection broke) instead of a hang. The process group is created with the same timeout
(``init_distributed``). Checkpoints: ``pipecc.runtime.rank_checkpoint``.

Timing: with ``timer`` set (an ``ActionTimer``, ``pipecc run --json``) every action runs through
it, which times F and B and the receive waits (``pipecc.runtime.timing``); None costs nothing.
Tracing (``pipecc run --trace``): ``timer`` and ``trace`` are a ``TraceRecorder``
(``pipecc.runtime.trace``), which records every action and passes it on to the ActionTimer.

The NCCL path is written to the same contract but is only exercised on machines with several
GPUs; the tests run gloo on CPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipecc.errors import PipeccError, UsageError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.ir.schedule.lower import lower
from pipecc.ir.schedule.transforms import forward_only
from pipecc.runtime import rank_checkpoint, teardown, wire
from pipecc.runtime.context import Mailbox, RankContext, RankState, Shared
from pipecc.runtime.handlers import Handler, RankParts, captured, setup
from pipecc.runtime.messages import Messages
from pipecc.runtime.ports import StagePorts, as_tuple, flatten, microbatch_extents, split_batch, unflatten
from pipecc.techniques.replicas.runtime import Replicas
from pipecc.runtime.stage_runner import StageRunner
from pipecc.techniques import parts as technique_parts
from pipecc.runtime.trace import TraceRecorder
# torch-free, so `pipecc run`'s launcher builds the same schedule before any process starts
from pipecc.runtime.launch_checks import build_schedule  # noqa: F401
from pipecc.runtime.wire import Wire, check_fifo, directed_groups

__all__ = ["PRECISIONS", "PipelineRuntime", "RunConfig", "build_schedule", "init_distributed"]

PRECISIONS = {"bf16": torch.bfloat16, "fp16": torch.float16}  # RunConfig.precision -> autocast dtype


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
    # mixed precision (``PRECISIONS``): the stages' forward and loss under torch.autocast in that
    # dtype, float32 messages sent in it; None: as compiled (float32)
    precision: str | None = None


def _name(schedule: str | Schedule) -> str:
    """How an error message names a run's schedule: its name, or "(given as text)"."""
    if isinstance(schedule, Schedule) or schedule.lstrip().startswith(("rank ", "sizes:", "partner:")):
        return "(given as text)"
    return repr(schedule)


# ---------------------------------------------------------------------------- runtime


class PipelineRuntime:
    """Runs this rank's stage(s) of a pipeline, following the schedule's action list literally.

    ``stage`` is one module, or a list (one per stage the schedule places on this rank, in
    stage order) with ``ports`` a matching list. ``step`` runs one training iteration and
    accumulates gradients into the stage parameters (it does not zero them; the caller runs
    ``optimizer.zero_grad()`` and ``optimizer.step()``). ``optimizer`` is only needed for
    checkpoints. ``world > 1`` initialises torch.distributed from the torchrun environment
    unless it already is. Internally values travel as leaves (tuple ports opened).

    What other modules read (everything else is the runtime's own):
      * who and where the rank is, read-only, from its ``RankContext`` (``ctx``, what the stage
        runners and action handlers are given instead of the runtime): ``rank``, ``world``,
        ``global_rank``, ``global_world``, ``stage_ids``, ``last_stage``, ``m``, ``schedule``,
        ``device``, ``replicas``; and ``modules``, the rank's stage modules;
      * what the caller sets: ``optimizer`` (checkpoints save it), ``trace`` (``pipecc run
        --trace``'s ``TraceRecorder``), and what lives in the rank's ``RankState`` (``ctx.state``),
        which the runners read: ``loss_scale`` (fp16: the scaled loss's factor,
        pipecc.runtime.distributed's scaler), ``keep_outputs`` (True: step() keeps the last stage's
        outputs for last_outputs()), ``refresh_follows`` (Bi-Partition: the caller runs
        after_optimizer_step after every step, so the replicas' refresh receive is posted during the
        step, REFRESH), ``timer`` (set: every action runs through it, pipecc run --json); ``_wire``
        is the rank's wire (a test may swap it);
      * after a step: ``peak_stash``, ``peak_sends``;
      * the methods below the constructor.
    """

    loss_scale = Shared()
    keep_outputs = Shared()
    refresh_follows = Shared()
    timer = Shared()
    _wire = Shared("wire")

    def __init__(self, stage: nn.Module | Sequence[nn.Module], ports: dict | Sequence[dict], rank: int,
                 world: int, config: RunConfig, loss_fn: Callable | None = None,
                 optimizer: torch.optim.Optimizer | None = None, replicas: Replicas | None = None):
        modules = [stage] if isinstance(stage, nn.Module) else list(stage)
        port_list = [ports] if isinstance(ports, dict) else list(ports)
        if len(port_list) != len(modules):
            raise PipeccError(f"rank {rank}: {len(modules)} stage modules but {len(port_list)} port specs")
        stage_ports = [StagePorts.from_json(p) for p in port_list]
        self._modules, self._config, self._world = modules, config, world
        self.optimizer = optimizer
        if config.precision is not None and config.precision not in PRECISIONS:
            raise UsageError(f"precision {config.precision!r}: choose from {', '.join(PRECISIONS)} (or none: float32)")
        amp_dtype = PRECISIONS.get(config.precision) if config.precision else None
        device = torch.device(config.device) if config.device else _default_device()
        backend = config.backend or ("nccl" if device.type == "cuda" else "gloo")
        # gloo carries a GPU rank's messages through host memory (pipecc.runtime.wire): slower
        # than NCCL, but it is how a GPU stage talks to a CPU stage
        schedule = build_schedule(config.schedule, world, config.microbatches, len(modules),
                                  config.microbatch_sizes, config.activation_balancing)
        replicas = replicas or Replicas()
        runtime_parts = technique_parts("runtime")  # each technique's share of the rank (`pipecc.runtime.handlers`)
        setup(runtime_parts, "check", schedule, modules, stage_ports, replicas)  # what the rank cannot run
        global_rank, global_world = replicas.rank_of(rank), world * replicas.count
        if global_world > 1:
            init_distributed(config)
            if (dist.get_rank(), dist.get_world_size()) != (global_rank, global_world):
                raise PipeccError(f"runtime built for rank {global_rank} of {global_world}, process group "
                                  f"says {dist.get_rank()} of {dist.get_world_size()}")
        stage_ids = schedule.stages_of(rank)
        if len(stage_ids) != len(modules):
            raise PipeccError(f"rank {rank} holds stages {stage_ids} in this schedule but got "
                              f"{len(modules)} modules")
        for module in modules:
            module.to(device)
        if world > 1 and backend == "nccl":
            check_fifo(schedule)
            groups = directed_groups(schedule, replicas.count, replicas.index)
            self._state = RankState(Wire(global_rank, config.timeout_s, nccl=True, groups=groups, by_order=True))
        else:
            self._state = RankState(Wire(global_rank, config.timeout_s))
        self._mailbox = Mailbox()
        self._peak_stash = 0  # most microbatches stashed at once during the last step
        self.trace: TraceRecorder | None = None  # set (and timer set to it): pipecc run --trace
        # the collectives, added by compile's lowering to a schedule built here by name or from text;
        # a lowered one (the folder's schedule.txt) is itself, executed as written
        lowering = {k: v for extra in setup(runtime_parts, "lowering", stage_ids, modules) for k, v in extra.items()}
        schedule = lower(schedule, replicas=replicas.count, **lowering)
        # each technique's handler, in TECHNIQUES order: built below, once the runners exist
        self._techniques: list[Handler] = []
        self._ctx = RankContext(rank, global_rank, tuple(stage_ids), schedule, device, amp_dtype, replicas,
                                loss_fn, self._mailbox, self._techniques, self._state)
        self._runners: list[StageRunner] = [
            _runner_class(runtime_parts, module)(self.ctx, s, module, ports)
            for s, module, ports in zip(stage_ids, modules, stage_ports)]
        self._messages = Messages(self.ctx, self.runner)
        parts = RankParts(self.ctx, self.runner, self._runners, config.timeout_s, backend == "nccl")
        self._techniques.extend(part.handler(parts) for part in runtime_parts)
        self._handlers: dict[ActionKind, Callable[[Action, bool], None]] = {
            ActionKind.F: self._forward,
            ActionKind.B: self._backward,
            ActionKind.SEND_F: self._messages.send_forward,
            ActionKind.RECV_F: self._messages.recv_forward,
            ActionKind.SEND_B: self._messages.send_backward,
            ActionKind.RECV_B: self._messages.recv_backward,
            **{kind: handler.run for handler in self._techniques for kind in handler.kinds},
        }
        if world > 1:
            self._messages.handshake()

    # -- who and where the rank is (read-only; the RankContext's) -------------------------

    @property
    def ctx(self) -> RankContext:
        """The rank as its stage runners and action handlers see it (``pipecc.runtime.context``)."""
        return self._ctx

    @property
    def rank(self) -> int:
        """The pipeline rank: the schedule's row."""
        return self.ctx.rank

    @property
    def world(self) -> int:
        """The number of pipeline ranks."""
        return self._world

    @property
    def global_rank(self) -> int:
        """This process's rank in the process group (replicas: ``Replicas.rank_of``)."""
        return self.ctx.global_rank

    @property
    def global_world(self) -> int:
        """The process group's size: pipeline ranks times replicas."""
        return self._world * self.ctx.replicas.count

    @property
    def stage_ids(self) -> list[int]:
        """The rank's stages, ascending (a new list)."""
        return list(self.ctx.stage_ids)

    @property
    def last_stage(self) -> int:
        return self.ctx.last_stage

    @property
    def m(self) -> int:
        """Micro-batches per step (unequal sizes: the most chunks of any stage)."""
        return self.ctx.m

    @property
    def schedule(self) -> Schedule:
        """The schedule the rank runs (its collectives included)."""
        return self.ctx.schedule

    @property
    def device(self) -> torch.device:
        return self.ctx.device

    @property
    def replicas(self) -> Replicas:
        return self.ctx.replicas

    @property
    def modules(self) -> list[nn.Module]:
        """The rank's stage modules, in ``stage_ids`` order."""
        return self._modules

    # -- public API ----------------------------------------------------------------------

    @property
    def peak_sends(self) -> int:
        """Most sending actions whose tensors were held at once during the last step/infer."""
        return self._state.wire.peak_inflight

    @property
    def peak_stash(self) -> int:
        """Most micro-batches stashed at once during the last step."""
        return self._peak_stash

    def runner(self, stage: int) -> StageRunner:
        """The runner of this rank's stage ``stage``."""
        return self._runners[self.ctx.stage_ids.index(stage)]

    def step(self, inputs: Sequence[Any] | None = None, target: Any = None) -> float | None:
        """One training iteration; the full-batch mean loss on the rank holding the last stage."""
        if not self.schedule.is_training:
            raise PipeccError(f"schedule {_name(self._config.schedule)} has no backward; use infer()")
        self._run(self.schedule, inputs, target, training=True)
        for handler in self._techniques:  # before the caller's optimizer step (the replicas' all-reduces)
            handler.finish_step(self.trace)
        if self.last_stage in self.ctx.stage_ids:
            losses = self.runner(self.last_stage).losses
            if self.replicas.count > 1:  # each replica's loss is its share: the sum is the full batch's
                total = torch.stack(losses).sum().reshape(1)
                wire.all_reduce(total, group=self.replicas.group(self.rank))
                return float(total)
            return float(sum(losses))
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
        if self.last_stage not in self.ctx.stage_ids or len(self.runner(self.last_stage).results) != chunks:
            return None
        last = self.runner(self.last_stage)
        merged = []
        for i, port in enumerate(last.ports.out_leaves):
            values = [last.results[mb][i] for mb in range(chunks)]
            merged.append(torch.cat(values, port.batch_dim) if port.kind == "tensor" and port.batch_dim is not None
                          else values)
        last.results = {}
        outs = unflatten(merged, last.ports.sends)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def after_optimizer_step(self) -> None:
        """Bi-Partition: the owners of segments send their updated weights to the replicas
        (call after every ``optimizer.step()``; a no-op without Bi-Partition)."""
        for handler in self._techniques:
            handler.after_optimizer_step()

    def forget_groups(self) -> None:
        """Drop this runtime's references to process groups (replica groups, NCCL's directed
        groups, the replicas' pending all-reduces) once they are destroyed, so their backends
        end now rather than at interpreter exit (``pipecc.runtime.teardown``). No step runs after."""
        self.replicas.groups.clear()
        self._state.wire.groups.clear()
        for handler in self._techniques:
            handler.forget_groups()

    def save_checkpoint(self, directory: str | os.PathLike, step: int) -> Path:
        """Write ``stage_<rank>.safetensors`` and ``stage_<rank>.json`` into ``directory``."""
        return rank_checkpoint.save_checkpoint(self, directory, step)

    def load_checkpoint(self, directory: str | os.PathLike) -> int:
        """Restore module (and optimizer) state saved by ``save_checkpoint``; returns its step."""
        return rank_checkpoint.load_checkpoint(self, directory)

    # -- execution -----------------------------------------------------------------------

    def _run(self, schedule: Schedule, inputs: Sequence[Any] | None, target: Any, training: bool) -> None:
        """Run this rank's row of ``schedule``: each action through its handler (``_handlers``)."""
        state = self._state
        state.inputs = self._split_inputs(inputs) if 0 in self.ctx.stage_ids else None
        state.targets = self._split_target(target) if training and self.last_stage in self.ctx.stage_ids else None
        self._mailbox.clear()
        for runner in self._runners:
            runner.reset()
        self._peak_stash = state.wire.peak_inflight = 0
        release = schedule.send_release(self.rank)
        row = schedule.actions[self.rank]
        handlers = self._techniques
        for handler in handlers:
            handler.reset(schedule, row, training)
        for action in row:
            for handler in handlers:
                handler.before(action)
            self.ctx.timed(action, lambda a=action: self._handlers[a.kind](a, training))
            releases = release.get(action, [])
            if not any([handler.after(action, releases) for handler in handlers]):  # none keeps them
                state.wire.release(releases)
        state.wire.flush()
        leftover = ([x for r in self._runners for x in r.leftover] or self._mailbox.inbox or self._mailbox.outbox
                    or [x for handler in self._techniques for x in handler.leftover])
        assert not leftover, f"rank {self.global_rank}: schedule left {sorted(leftover)} unconsumed"
        state.inputs = state.targets = None

    def _forward(self, a: Action, training: bool) -> None:
        """F on its stage's runner (BPipe: an evicted micro-batch's saved activations captured)."""
        runner = self.runner(a.stage)
        runner.forward(a.microbatch, training, captured(self._techniques, a.stage, a.microbatch, runner.module))
        self._peak_stash = max(self._peak_stash, sum(len(r.stash) for r in self._runners))

    def _backward(self, a: Action, training: bool) -> None:
        """B on its stage's runner (BPipe: the micro-batch's saved activations were unpacked)."""
        self.runner(a.stage).backward(a.microbatch)
        for handler in self._techniques:
            handler.backward_done(a.stage, a.microbatch)

    # -- the batch -------------------------------------------------------------------------

    def _split_inputs(self, inputs: Sequence[Any] | None) -> list[list[Any]]:
        """Stage 0's inputs as leaves, one list per microbatch (batched leaves split, others shared)."""
        ports = self.runner(0).ports
        inputs = as_tuple(inputs) if inputs is not None else ()
        if len(inputs) != len(ports.receives):
            raise PipeccError(f"rank {self.global_rank}: stage 0 takes {len(ports.receives)} inputs "
                              f"({', '.join(p.name for p in ports.receives)}), got {len(inputs)}")
        per_leaf = []
        for v, port in zip(flatten(inputs, ports.receives, "inputs"), ports.in_leaves):
            if port.kind == "tensor":
                v = v.to(self.device)
                if not port.matches(v.shape, port.shape) or v.dtype != port.dtype:
                    raise PipeccError(f"input {port.name!r} is {list(v.shape)} {v.dtype}, the compiled stage "
                                      f"expects {list(port.shape)} {port.dtype}")
                if port.batch_dim in port.dynamic:  # a length in the batch dim (B*S rows): this batch's
                    port = replace(port, shape=tuple(v.shape))
            extents = port.extents(ports.batch_size, self.ctx.split_of(0))
            per_leaf.append(torch.split(v, extents, port.batch_dim) if extents else [v] * self.schedule.chunks(0))
        return [[values[mb] for values in per_leaf] for mb in range(self.schedule.chunks(0))]

    def _split_target(self, target: Any) -> list[Any]:
        """The target per microbatch: tensors (or a tuple/list of them) split along dim 0."""
        batch = self.runner(self.last_stage).ports.batch_size
        split_as, chunks = self.ctx.split_of(self.last_stage), self.schedule.chunks(self.last_stage)

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


def _runner_class(runtime_parts: Sequence[Any], module: nn.Module) -> type[StageRunner]:
    """The runner of a stage module: a technique's (its runtime part's ``stage_runner``), else ``StageRunner``."""
    return next((cls for cls in setup(runtime_parts, "stage_runner", module) if cls is not None), StageRunner)


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
        teardown.bind_defaults_early()  # before the group exists (pipecc.runtime.teardown)
        dist.init_process_group(backend, timeout=timedelta(seconds=config.timeout_s), **kwargs)
    return dist.get_rank(), dist.get_world_size()

