"""PP x DP: a pipeline whose every stage runs on a group of ``d`` replicas (``pipecc.json``'s
``"replicas"``, the plan's ``replicas``), each taking ``1/d`` of every micro-batch, the group
all-reducing the stage's gradients.

Ranks. A run of ``n`` processes has ``P = n // d`` pipeline ranks; global rank ``g`` is pipeline
rank ``j = g // d``, replica ``r = g % d`` (so ``g = j * d + r`` runs on the plan's device ``g``,
and the group of pipeline rank j is ranks ``j*d .. j*d + d - 1``). Every replica runs the
schedule built for ``P`` ranks, row ``j``, and exchanges values with replica ``r`` of the
neighbouring pipeline ranks (``Replicas.rank_of``). ``Replicas.create`` makes one process group per
pipeline rank's replica set, on every rank in the same order (``dist.new_group`` is collective).

Data. Micro-batch ``i`` of the batch (``torch.tensor_split`` into ``m``, as without replicas) is
cut into ``d`` contiguous slices (``torch.tensor_split`` again); replica ``r`` feeds slice ``r`` of
stage 0's inputs and uses slice ``r`` of the target (``replica_slice``, ``replica_inputs``,
``replica_target``). The runtime needs equal slices: the batch must split into ``m * d`` equal
parts (``replica_problem``; ``pipecc compile`` refuses other plans, ``pipecc run`` another
``--microbatches``). A replica's stages then see a batch of ``B / d`` (``replica_ports`` rescales
the batch dims of ``ports.json``), and its micro-batch ``i`` is exactly slice ``r`` of the
pipeline's micro-batch ``i``.

Loss. Each micro-batch loss is weighted by the replica's share of the batch (``loss_share``:
``rows of replica r / B = 1/d``) on top of the micro-batch's share of the replica's batch, so
with a per-sample mean loss the gradients SUMMED over the replicas are those of the full-batch
mean loss, and the replicas' losses summed are the full-batch loss (``PipelineRuntime.step``
sums them over the last stage's group).

Gradients (``GradientAllReduce``). During a stage's last gradient-accumulating action of a step
(its last B), every parameter gets a post-accumulate-grad hook
(``Tensor.register_post_accumulate_grad_hook``) that starts an asynchronous ``all_reduce`` (SUM)
of its final gradient in the stage's group as soon as autograd has written it, so the all-reduce
overlaps the rest of that backward; ``wait`` (before the optimizer step, at the end of
``PipelineRuntime.step``) completes them. A parameter whose hook did not fire but has a gradient
is reduced right after the action. NOTE: collectives of one group must be issued in the same
order on every member: the replicas run the same stage code on the same graph, and autograd visits
it in the same order on each, so the hooks fire in the same order.

Imports torch and ``pipecc.errors`` only.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pipecc.errors import PipeccError
from pipecc.runtime.wire import wait_until

__all__ = ["GradientAllReduce", "Replicas", "loss_share", "replica_inputs", "replica_ports", "replica_problem",
           "replica_slice", "replica_target"]


@dataclass
class Replicas:
    """This rank's place among the replicas: ``count`` (d) replicas per stage, this is replica
    ``index``; ``groups[j]`` is the process group of pipeline rank j's replicas (d > 1 only)."""

    count: int = 1
    index: int = 0
    groups: dict[int, Any] = field(default_factory=dict)

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


def replica_problem(batch: int, microbatches: int, replicas: int) -> str | None:
    """Why a batch of ``batch`` rows cannot run as ``microbatches`` micro-batches over
    ``replicas`` replicas (None when it can: ``batch`` splits into ``m * d`` equal parts)."""
    if replicas <= 1 or not batch:
        return None
    if batch % microbatches or (batch // microbatches) % replicas:
        fits = [k for k in range(1, batch + 1) if batch % (k * replicas) == 0]
        return (f"{replicas} replicas each take an equal slice of every micro-batch, so the batch of {batch} must "
                f"split into {microbatches} micro-batches of a multiple of {replicas} rows; use "
                f"--microbatches {', '.join(map(str, fits[:8]))}" + (" ..." if len(fits) > 8 else ""))
    return None


def loss_share(replicas: int) -> float:
    """The weight of a replica's loss (its rows / the batch's): the replicas' gradients then sum
    to the full-batch gradient. Equal slices (``replica_problem``): ``1 / replicas``."""
    return 1.0 / replicas


def replica_slice(value: torch.Tensor, dim: int, microbatches: int, replicas: int, index: int) -> torch.Tensor:
    """Replica ``index``'s rows of ``value`` along ``dim``: slice ``index`` of ``replicas`` of each of
    the ``microbatches`` micro-batches (``torch.tensor_split`` both times), concatenated."""
    if replicas == 1:
        return value
    parts = [torch.tensor_split(mb, replicas, dim=dim)[index]
             for mb in torch.tensor_split(value, microbatches, dim=dim)]
    return torch.cat(parts, dim=dim)


def replica_ports(spec: dict[str, Any], replicas: int) -> dict[str, Any]:
    """A ``ports.json`` dict as replica sees it: every batched tensor's batch dim ``1/replicas``."""
    if replicas == 1:
        return spec

    def port(p: Any) -> Any:
        if not isinstance(p, dict):
            return p
        p = dict(p)
        if p.get("kind") == "tuple":
            p["items"] = [port(item) for item in p.get("items", ())]
        elif p.get("kind", "tensor") == "tensor" and p.get("batch_dim") is not None and "shape" in p:
            shape, dim = list(p["shape"]), int(p["batch_dim"])
            if 0 <= dim < len(shape):
                if shape[dim] % replicas:
                    raise PipeccError(f"port {p.get('name')!r}: batch dim of {shape[dim]} rows does not split over "
                                      f"{replicas} replicas")
                shape[dim] //= replicas
                p["shape"] = shape
        return p

    out = dict(spec)
    for key in ("receives", "sends"):
        if key in out:
            out[key] = [port(p) for p in out[key]]
    return out


def replica_inputs(leaves: Sequence[Any], batch_dims: Sequence[int | None], microbatches: int,
                   replicas: int, index: int) -> list[Any]:
    """Stage 0's input leaves for replica ``index`` (batched tensors sliced, the rest whole)."""
    return [replica_slice(v, dim, microbatches, replicas, index)
            if isinstance(v, torch.Tensor) and dim is not None else v for v, dim in zip(leaves, batch_dims)]


def replica_target(target: Any, microbatches: int, replicas: int, index: int) -> Any:
    """The target for replica ``index``: a tensor (or a tuple/list of them) sliced along dim 0."""
    if isinstance(target, torch.Tensor):
        return replica_slice(target, 0, microbatches, replicas, index)
    if isinstance(target, (tuple, list)) and target and all(isinstance(t, torch.Tensor) for t in target):
        return type(target)(replica_slice(t, 0, microbatches, replicas, index) for t in target)
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
