"""Bi-Partition in the executor (the workers' programs: ``pipecc.techniques.bipartition.runtime_segments``).

``BipartitionRunner`` is the stage runner of a ``BipartitionWorker``: F and B run through its
``WorkerProgram`` (core under autograd, misplaced segments through their AOT forward/backward
graphs); its forward message carries the values crossing its forward cut plus any segment's
saved tensors, its backward message the gradients at its backward cut plus any saved tensors
(the ports and buffers ``pipecc.runtime.messages`` sends and receives).

``WeightRefresh`` refreshes the segments' replicas from their owners: the owners send their
updated weights after every optimizer step (``after_optimizer_step``, also after a checkpoint
is loaded); a replica's receive is posted into its parameters by the schedule's ``REFRESH``
action of its stage (right after the stage's last forward of the step) when ``refresh_follows``
(dist.py's training loop calls ``after_optimizer_step`` after every step), so the transfer
overlaps the rank's remaining backwards; otherwise ``after_optimizer_step`` posts it. In one
process the owner's weights are copied into the replica. Equal micro-batches, no replicas, no
zero-bubble split (``check_runs`` refuses the rest). Both see their rank through a
``RankContext`` (``pipecc.runtime.context``); ``WeightRefresh`` is given the rank's runners.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import Action, ActionKind, Schedule
from pipecc.runtime.context import RankContext
from pipecc.runtime.handlers import Handler, RankParts
from pipecc.runtime.messages import message_tag
from pipecc.runtime.ports import Port, StagePorts, unflatten
from pipecc.techniques.bipartition.runtime_segments import BipartitionWorker, WorkerProgram, share_replicas, worker_class
from pipecc.runtime.stage_runner import StageRunner
from pipecc.runtime.stagefile import RECOMPILE, build_module, gist, load_weights


__all__ = ["BipartitionRunner", "WeightRefresh", "check", "check_precision", "check_runs", "handler", "is_worker",
           "load_stage", "lowering", "one_process", "replica_stages", "stage_runner"]


def is_worker(module: torch.nn.Module) -> bool:
    """True for a Bi-Partition worker's stage module."""
    return isinstance(module, BipartitionWorker)


def holds_replica(module: torch.nn.Module) -> bool:
    """True for a worker that runs a segment another worker owns (its row gets a REFRESH)."""
    return is_worker(module) and any(not r.owner for r in module.runners)


def replica_stages(stage_ids: Sequence[int], modules: Sequence[torch.nn.Module]) -> list[int]:
    """Of a rank's stages (``stage_ids``, their ``modules``), those holding a replica of a segment
    another stage owns: the stages whose REFRESH the schedule gets (``pipecc.ir.schedule.lower``)."""
    return [s for s, module in zip(stage_ids, modules) if holds_replica(module)]


def check_runs(schedule: Schedule, replicas: int) -> None:
    """Refuse what a rank with Bi-Partition workers cannot run: replicas, unequal micro-batches,
    a zero-bubble schedule."""
    if replicas > 1 or schedule.microbatch_sizes is not None:
        raise PipeccError("a Bi-Partition pipeline runs without replicas and with equal micro-batches; "
                          "compile it again without those")
    if any(a.kind in (ActionKind.I, ActionKind.W) for row in schedule.actions for a in row):
        raise PipeccError("a Bi-Partition pipeline cannot run a zero-bubble schedule; use 1f1b or gpipe")


def check(schedule: Schedule, modules: Sequence[torch.nn.Module], ports: Sequence[StagePorts], replicas: Any) -> None:
    """`check_runs` on a rank holding Bi-Partition workers (`pipecc.runtime.handlers`' ``check``)."""
    if any(is_worker(module) for module in modules):
        check_runs(schedule, replicas.count)


def check_precision(precision: str | None, modules: Sequence[torch.nn.Module]) -> None:
    """Refuse mixed precision on a rank holding Bi-Partition workers (`pipecc.runtime.handlers`'
    ``check_precision``): their programs run in float32."""
    if precision is not None and any(is_worker(m) for m in modules):
        raise PipeccError("mixed precision does not run Bi-Partition pipelines yet; load it in float32 "
                          "(precision=None) or compile without --bipartition")


def lowering(stage_ids: Sequence[int], modules: Sequence[torch.nn.Module]) -> dict[str, Any]:
    """The rank's REFRESH stages for ``pipecc.ir.schedule.lower`` (`pipecc.runtime.handlers`' ``lowering``)."""
    return {"refresh_stages": replica_stages(stage_ids, modules)}


def load_stage(folder: Path, core: torch.nn.Module, ports: dict[str, Any]) -> torch.nn.Module | None:
    """A Bi-Partition worker (``pipecc.techniques.bipartition.runtime_segments``) when the stage's
    ``ports`` have a ``bipartition`` section, else None (`pipecc.runtime.handlers`' ``load_stage``):
    its core and its segments' modules, owned or replica; ``PARAM_NAMES`` names the core's and the
    owned segments' tensors, ``SHARDS`` their split layers' slices (a slice of a split layer may sit
    in a core or in a segment)."""
    if not isinstance(ports.get("bipartition"), dict):
        return None
    worker = int(ports.get("stage", 0))
    names = {f"core.{a}": n for a, n in getattr(type(core), "PARAM_NAMES", {}).items()}
    shards = {f"core.{a}": v for a, v in getattr(type(core), "SHARDS", {}).items()}
    segments = []
    try:
        for info in ports["bipartition"]["segments"]:
            module = build_module(folder, str(info["file"]), str(info["class"]))
            load_weights(module, folder / str(info["weights"]))
            segments.append((info, module))
            if int(info["bp_worker"]) == worker:  # the owner's tensors are the model's
                names.update({f"segment_{int(info['boundary'])}.{a}": n
                              for a, n in getattr(type(module), "PARAM_NAMES", {}).items()})
                shards.update({f"segment_{int(info['boundary'])}.{a}": v
                               for a, v in getattr(type(module), "SHARDS", {}).items()})
    except (KeyError, TypeError, ValueError) as e:
        raise PipeccError(f"{folder / 'ports.json'}: bad bipartition section ({gist(e)}); {RECOMPILE}") from None
    return worker_class(names, shards)(core, segments, ports, worker)


def one_process(modules: Sequence[torch.nn.Module]) -> None:
    """`pipecc.load`'s one process (`pipecc.runtime.handlers`' ``one_process``) needs no replica:
    the owner's weights serve (``share_replicas``)."""
    share_replicas(modules)


def stage_runner(module: torch.nn.Module) -> type[StageRunner] | None:
    """A worker's runner (`pipecc.runtime.handlers`' ``stage_runner``), else None."""
    return BipartitionRunner if is_worker(module) else None


class BipartitionRunner(StageRunner):
    """A Bi-Partition worker's stage: its program computes, its ports carry the cuts' values
    (the executor has checked the run with ``check_runs``)."""

    def __init__(self, ctx: RankContext, stage: int, module: torch.nn.Module, ports: StagePorts) -> None:
        super().__init__(ctx, stage, module, ports)
        program = self.program = WorkerProgram(module)
        split = ctx.split_of(stage)
        program.shape_of = lambda port, mb: port.microbatch_shape(mb, ports.batch_size, split)
        program.device = ctx.device

    def grad_sends(self) -> list[Port]:
        return self.program.grad_sends

    def grad_receives(self) -> list[Port]:
        return self.program.grad_receives

    def forward_extra(self, mb: int, training: bool) -> list[torch.Tensor]:
        return self.program.forward_extra(mb, self.ctx.device) if training else []

    def backward_extra(self, mb: int) -> list[torch.Tensor]:
        return self.program.backward_extra(mb, self.ctx.device)

    def compute(self, mb: int, leaves: list[Any], training: bool,
                capture: contextlib.AbstractContextManager | None) -> tuple[tuple, list[Any], list[Any]]:
        out_leaves, extra = self.program.forward(mb, leaves, training, first=self.first)
        return tuple(unflatten(out_leaves, self.ports.sends)), out_leaves, extra

    def backward(self, mb: int) -> None:
        """The program's backward, then the usual hand-over."""
        _, outs = self.stash.pop(mb)
        received = None if self.last else self.ctx.mailbox.inbox.pop(("B", self.stage, mb))
        upstream = self.program.backward(mb, received, outs if self.last else None, first=self.first)
        if upstream is not None:
            self.hand_down(mb, upstream)


class WeightRefresh(Handler):
    """The replica refresh of the Bi-Partition runners among ``runners``, the stage runners of the
    rank ``ctx`` (module docstring)."""

    def __init__(self, ctx: RankContext, runners: Sequence[StageRunner]) -> None:
        self.ctx = ctx
        self.runners = list(runners)
        self.posted: dict[int, list] = {}  # segment boundary -> its refresh's posted receives

    kinds = (ActionKind.REFRESH,)

    def programs(self) -> dict[int, WorkerProgram]:
        return {r.stage: r.program for r in self.runners if isinstance(r, BipartitionRunner)}

    def run(self, a: Action, training: bool) -> None:
        """REFRESH: from here the stage's replicas are not read again this step; post their
        refresh's receive when the optimizer step (and the owners' send) follows the step."""
        if training and self.ctx.state.refresh_follows and a.stage in self.programs():
            self.post(a.stage)

    def post(self, s: int) -> None:
        """Post the receives of stage ``s``'s replicas' refresh straight into their parameters
        (once per step)."""
        ctx, programs = self.ctx, self.programs()
        for runner in programs[s].module.runners:
            if runner.owner or runner.bp in programs or runner.boundary in self.posted:
                continue
            params = [p.detach() for p in runner.module.parameters()]
            tags = [message_tag(ctx.schedule, 3, s, runner.boundary % ctx.m, i) for i in range(len(params))]
            self.posted[runner.boundary] = ctx.wire.post(params, ctx.schedule.stage_to_rank[runner.bp], tags,
                                                         "the replica refresh")

    def after_optimizer_step(self) -> None:
        """The owners of segments send their updated weights to the replicas; a replica's
        receive, posted during the step or here, lands in its parameters directly."""
        ctx, programs = self.ctx, self.programs()
        if not programs:
            return
        for program in programs.values():
            for runner in program.module.runners:
                if not runner.owner:
                    continue
                peer_stage = runner.fp
                if peer_stage in programs:  # one process: copy into the replica directly
                    replica = next(r for r in programs[peer_stage].module.runners if r.boundary == runner.boundary)
                    with torch.no_grad():
                        for dst, src in zip(replica.module.parameters(), runner.module.parameters()):
                            dst.copy_(src)
                    continue
                peer = ctx.schedule.stage_to_rank[peer_stage]
                for i, p in enumerate(runner.module.parameters()):
                    tag = message_tag(ctx.schedule, 3, peer_stage, runner.boundary % ctx.m, i)
                    ctx.wire.send(p.detach(), peer, tag, "the replica refresh", key=("refresh", runner.boundary))
        for s in programs:
            self.post(s)
        for posted in self.posted.values():
            ctx.wire.wait(posted)
        self.posted = {}
        ctx.wire.flush()


def handler(parts: RankParts) -> WeightRefresh:
    """Bi-Partition's share of the rank (`pipecc.runtime.handlers`): REFRESH, and the owners'
    weights sent to their replicas after the optimizer step."""
    return WeightRefresh(parts.ctx, parts.runners)
