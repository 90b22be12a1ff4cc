"""PP x DP: a pipeline whose every stage runs on a group of ``d`` replicas (``pipecc.json``'s
``"replicas"``, the plan's ``replicas``), each taking a slice of every micro-batch (equal, or one
sample apart when d does not divide it), the group all-reducing the stage's gradients.

Ranks. A run of ``n`` processes has ``P = n // d`` pipeline ranks; global rank ``g`` is pipeline
rank ``j = g // d``, replica ``r = g % d`` (so ``g = j * d + r`` runs on the plan's device ``g``,
and the group of pipeline rank j is ranks ``j*d .. j*d + d - 1``). Every replica runs the
schedule built for ``P`` ranks, row ``j``, and exchanges values with replica ``r`` of the
neighbouring pipeline ranks (``Replicas.rank_of``). ``Replicas.create`` makes one process group per
pipeline rank's replica set, on every rank in the same order (``dist.new_group`` is collective).

Data. Micro-batch ``i`` of the batch (``torch.tensor_split`` into ``m``, as without replicas) is
cut into ``d`` contiguous slices (``torch.tensor_split`` again: of ``mb`` rows the first
``mb % d`` replicas take one more, like DDP's sampler); replica ``r`` feeds slice ``r`` of stage 0's
inputs and uses slice ``r`` of the target (``replica_slice``, ``replica_inputs``,
``replica_target``). The batch must split into ``m`` equal micro-batches of at least ``d`` rows
(``replica_problem``; ``pipecc compile`` refuses other plans, ``pipecc run`` another
``--microbatches``), so replica ``r`` takes ``s_r`` rows of every micro-batch and its stages see a
batch of ``m * s_r`` (``replica_rows``; ``replica_ports`` rescales the batch dims of
``ports.json``, a dim of ``c * B`` rows to ``c * m * s_r``), and its micro-batch ``i`` is exactly
slice ``r`` of the pipeline's micro-batch ``i``.

Loss. Each micro-batch loss is weighted by the replica's share of the micro-batch (``loss_share``:
``s_r / mb``, ``1/d`` for equal slices; ``Replicas.share``) on top of the micro-batch's share of
the replica's batch (``1/m``), i.e. ``s_r / B``, so with a per-sample mean loss the gradients
SUMMED over the replicas are those of the full-batch mean loss, and the replicas' losses summed
are the full-batch loss (``PipelineRuntime.step`` sums them over the last stage's group).

Gradients (``GradientAllReduce``, run by the schedule's ``REDUCE`` actions: ``ReduceActions``).
``REDUCE(s, j)`` follows stage s's last gradient-accumulating action of the step (its last B, or
W; ``pipecc.ir.schedule.transforms.gradient_reduce``). During that action every parameter gets a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``) that starts an asynchronous ``all_reduce`` (SUM)
of its final gradient in the stage's group as soon as autograd has written it, so the all-reduce
overlaps the rest of that backward; ``wait`` (before the optimizer step, at the end of
``PipelineRuntime.step``) completes them. A parameter whose hook did not fire but has a gradient
is reduced by the REDUCE. NOTE: collectives of one group must be issued in the same
order on every member: the replicas run the same stage code on the same graph, and autograd visits
it in the same order on each, so the hooks fire in the same order.

Imports torch, ``pipecc.errors`` and the schedule IR's ``ActionKind`` only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.ir.schedule.actions import ActionKind
from pipecc.runtime.handlers import Handler, RankParts
from pipecc.runtime.wire import wait_until
from pipecc.techniques.replicas.rows import replica_problem  # noqa: F401  (torch-free: the launcher asks it)

__all__ = ["GradientAllReduce", "ReduceActions", "Replicas", "handler", "loss_share", "replica_inputs", "replica_ports", "replica_problem",
           "replica_rows", "replica_slice", "replica_target", "slice_sizes"]


@dataclass
class Replicas:
    """This rank's place among the replicas: ``count`` (d) replicas per stage, this is replica
    ``index``; ``groups[j]`` is the process group of pipeline rank j's replicas (d > 1 only);
    ``share`` the weight of its losses (``loss_share``; None: ``1 / count``, equal slices) and
    ``batch`` the full batch's rows (None: equal slices, every batch dim cut into ``count``)."""

    count: int = 1
    index: int = 0
    groups: dict[int, Any] = field(default_factory=dict)
    share: float | None = None
    batch: int | None = None

    @property
    def weight(self) -> float:
        """The factor on this replica's micro-batch losses (module docstring)."""
        return 1.0 / self.count if self.share is None else self.share

    def rank_of(self, pipeline_rank: int, replica: int | None = None) -> int:
        """The global rank of ``pipeline_rank``'s replica ``replica`` (default: this rank's)."""
        return pipeline_rank * self.count + (self.index if replica is None else replica)

    def group(self, pipeline_rank: int) -> Any:
        return self.groups.get(pipeline_rank)

    @classmethod
    def create(cls, count: int, global_rank: int, world: int) -> Replicas:
        """Collective when ``count > 1``: one group per pipeline rank, made on every rank in order."""
        if count < 1 or world % count:
            raise PipeccError(f"the folder runs every stage on {count} replicas, which do not divide the "
                              f"{world} ranks started; start a multiple of {count} ranks (pipecc run OUT does)")
        if count == 1:
            return cls()
        groups = {j: dist.new_group(list(range(j * count, (j + 1) * count))) for j in range(world // count)}
        return cls(count, global_rank % count, groups)


def slice_sizes(rows: int, replicas: int) -> list[int]:
    """The rows of each replica's slice of ``rows`` (``torch.tensor_split``: the first
    ``rows % replicas`` take one more)."""
    return [rows // replicas + (1 if r < rows % replicas else 0) for r in range(replicas)]


def replica_rows(batch: int, microbatches: int, replicas: int, index: int) -> int:
    """Rows of a batch of ``batch`` that replica ``index`` runs: its slice of every micro-batch."""
    return sum(slice_sizes(mb, replicas)[index] for mb in slice_sizes(batch, microbatches))


def loss_share(microbatch: int, replicas: int, index: int) -> float:
    """The weight of replica ``index``'s micro-batch loss (module docstring): its slice's rows /
    the micro-batch's, so the replicas' gradients sum to the full-batch gradient (``1 /
    replicas`` for equal slices)."""
    return slice_sizes(microbatch, replicas)[index] / microbatch


def replica_slice(value: torch.Tensor, dim: int, microbatches: int, replicas: int, index: int,
                  batch: int | None = None) -> torch.Tensor:
    """Replica ``index``'s rows of ``value`` along ``dim``: slice ``index`` of ``replicas`` of each of
    the ``microbatches`` micro-batches (``torch.tensor_split`` both times), concatenated. With
    ``batch``, a dim of ``c * batch`` rows is cut in blocks of ``c`` (``c`` rows per sample)."""
    if replicas == 1:
        return value
    extent = value.shape[dim]
    c = extent // batch if batch and extent % batch == 0 and extent > batch else 1
    sizes = [c * n for mb in slice_sizes(extent // c, microbatches) for n in slice_sizes(mb, replicas)]
    parts = torch.split(value, sizes, dim=dim)
    return torch.cat([parts[i * replicas + index] for i in range(microbatches)], dim=dim)


def replica_unslice(parts: Sequence[torch.Tensor], dim: int, microbatches: int, batch: int | None = None) -> torch.Tensor:
    """``replica_slice``'s inverse: the replicas' rows (``parts[index]``, each its slices of the
    ``microbatches`` micro-batches concatenated) back in the batch's order."""
    replicas = len(parts)
    if replicas == 1:
        return parts[0]
    extent = sum(p.shape[dim] for p in parts)
    c = extent // batch if batch and extent % batch == 0 and extent > batch else 1
    sizes = [[c * n for n in slice_sizes(mb, replicas)] for mb in slice_sizes(extent // c, microbatches)]
    pieces = [torch.split(p, [row[i] for row in sizes], dim=dim) for i, p in enumerate(parts)]
    return torch.cat([pieces[i][j] for j in range(microbatches) for i in range(replicas)], dim=dim)


def replica_ports(spec: dict[str, Any], replicas: int, index: int = 0, microbatches: int = 1,
                  batch: int | None = None) -> dict[str, Any]:
    """A ``ports.json`` dict as replica ``index`` sees it: every batched tensor's batch dim its
    rows (``replica_rows``). Equal slices (``batch`` None, or ``batch / microbatches`` a multiple of
    ``replicas``): ``1/replicas`` of it; else a dim of ``c * batch`` rows gets ``c`` per row."""
    if replicas == 1:
        return spec
    even = batch is None or (batch % microbatches == 0 and (batch // microbatches) % replicas == 0)

    def port(p: Any) -> Any:
        if not isinstance(p, dict):
            return p
        p = dict(p)
        if p.get("kind") == "tuple":
            p["items"] = [port(item) for item in p.get("items", ())]
        elif p.get("kind", "tensor") == "tensor" and p.get("batch_dim") is not None and "shape" in p:
            shape, dim = list(p["shape"]), int(p["batch_dim"])
            if 0 <= dim < len(shape):
                if even and shape[dim] % replicas:
                    raise PipeccError(f"port {p.get('name')!r}: batch dim of {shape[dim]} rows does not split over "
                                      f"{replicas} replicas")
                if not even and (shape[dim] % batch or not shape[dim]):
                    raise PipeccError(f"port {p.get('name')!r}: batch dim of {shape[dim]} rows is not a multiple of "
                                      f"the batch of {batch}, so it cannot be cut into unequal replica slices; "
                                      f"plan with a replica count that divides the micro-batch of "
                                      f"{batch // microbatches}")
                shape[dim] = shape[dim] // replicas if even else \
                    shape[dim] // batch * replica_rows(batch, microbatches, replicas, index)
                p["shape"] = shape
        return p

    out = dict(spec)
    for key in ("receives", "sends"):
        if key in out:
            out[key] = [port(p) for p in out[key]]
    return out


def replica_inputs(leaves: Sequence[Any], batch_dims: Sequence[int | None], microbatches: int,
                   replicas: int, index: int, batch: int | None = None) -> list[Any]:
    """Stage 0's input leaves for replica ``index`` (batched tensors sliced, the rest whole)."""
    return [replica_slice(v, dim, microbatches, replicas, index, batch)
            if isinstance(v, torch.Tensor) and dim is not None else v for v, dim in zip(leaves, batch_dims)]


def replica_target(target: Any, microbatches: int, replicas: int, index: int, batch: int | None = None) -> Any:
    """The target for replica ``index``: a tensor (or a tuple/list of them) sliced along dim 0."""
    if isinstance(target, torch.Tensor):
        return replica_slice(target, 0, microbatches, replicas, index, batch)
    if isinstance(target, (tuple, list)) and target and all(isinstance(t, torch.Tensor) for t in target):
        return type(target)(replica_slice(t, 0, microbatches, replicas, index, batch) for t in target)
    return target


class GradientAllReduce:
    """One pipeline rank's gradient all-reduce over its replica group (see the module docstring)."""

    def __init__(self, group: Any, rank: int, timeout_s: float, nccl: bool = False) -> None:
        self.group, self.rank, self.timeout_s, self.nccl = group, rank, timeout_s, nccl
        self.works: list[Any] = []
        self._hooks: list[Any] = []
        self._armed: list[torch.nn.Parameter] = []
        self._fired: set[int] = set()

    def arm(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Before a stage's last backward of the step: reduce each gradient once it is final."""
        self._armed = [p for p in params if p.requires_grad]
        self._fired = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._launch) for p in self._armed]

    def disarm(self) -> None:
        """After that action: drop the hooks; reduce what had a gradient but no hook call."""
        for hook in self._hooks:
            hook.remove()
        for p in self._armed:
            if id(p) not in self._fired and p.grad is not None:
                self._launch(p)
        self._hooks, self._armed = [], []

    def _launch(self, param: torch.Tensor) -> None:
        self._fired.add(id(param))
        self.works.append(dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def wait(self) -> None:
        """Complete every all-reduce started this step (before the optimizer reads the gradients)."""
        deadline = time.monotonic() + self.timeout_s
        works, self.works = self.works, []
        for work in works:
            try:
                wait_until(work, deadline, self.nccl)
            except (RuntimeError, TimeoutError) as e:
                if isinstance(e, TimeoutError) or "timed out" in str(e).lower():
                    raise PipeccError(f"rank {self.rank}: timed out after {self.timeout_s} s waiting for the "
                                      "gradient all-reduce of its replicas") from None
                raise PipeccError(f"rank {self.rank}: the gradient all-reduce of its replicas failed, a replica "
                                  f"exited or crashed ({str(e).strip().splitlines()[0] if str(e).strip() else e})") \
                    from None


class ReduceActions(Handler):
    """The executor's REDUCE handler: ``prepare(row)`` finds, for each REDUCE of the rank's row,
    the stage's last gradient action before it; ``before`` arms the all-reduce's hooks on that
    action's stage (``params_of(stage)``), so the reduction starts during its backward, and the
    REDUCE (``run``) completes the launch. Without replicas (``sync`` None) a REDUCE does nothing:
    a group of one is its own sum."""

    def __init__(self, sync: GradientAllReduce | None, params_of: Callable[[int], Iterable[torch.nn.Parameter]]):
        self.sync, self.params_of = sync, params_of
        self.points: set[Any] = set()

    kinds = (ActionKind.REDUCE,)

    def reset(self, schedule: Any, row: Sequence[Any], training: bool) -> None:
        self.points = set()
        if not training or self.sync is None:
            return
        last: dict[int, Any] = {}
        for a in row:
            if a.kind.frees_stash:
                last[a.stage] = a
            elif a.kind is ActionKind.REDUCE and a.stage in last:
                self.points.add(last[a.stage])

    def before(self, action: Any) -> None:
        if action in self.points:  # (a REDUCE still pending of another stage completes first)
            self.sync.disarm()
            self.sync.arm(self.params_of(action.stage))

    def run(self, action: Any, training: bool) -> None:
        if self.sync is not None:
            self.sync.disarm()

    def wait(self) -> None:
        """Before the caller's optimizer step: every all-reduce of the step completed."""
        if self.sync is not None:
            self.sync.wait()

    def finish_step(self, trace: Any) -> None:
        """`wait`, as the trace's "all-reduce wait" span when there is a trace and a group."""
        if trace is not None and self.sync is not None:
            trace.span("all-reduce wait", "all-reduce", self.wait)
        else:
            self.wait()

    def forget_groups(self) -> None:
        if self.sync is not None:
            self.sync.group, self.sync.works = None, []


def handler(parts: RankParts) -> ReduceActions:
    """The replica groups' share of the rank (`pipecc.runtime.handlers`): REDUCE, and the
    all-reduce of a stage's gradients in its group, started during its last backward."""
    ctx = parts.ctx
    sync = None if ctx.replicas.count == 1 else GradientAllReduce(
        ctx.replicas.group(ctx.rank), ctx.global_rank, parts.timeout_s, nccl=parts.nccl)
    return ReduceActions(sync, lambda s: parts.runner(s).module.parameters())
