"""Plan facts the technique rules share: what a plan *is* (training? one stage per device?
unequal micro-batches?), read from its fields once so every rule reads them alike."""

from __future__ import annotations

from pipecc.ir.plan import Plan


def training(plan: Plan) -> bool:
    """A plan with a backward pass (not `--inference`, not the inference schedule)."""
    return bool(plan.options.get("training", True)) and plan.schedule != "inference"


def equal_split(batch: int, m: int) -> list[int]:
    """`torch.tensor_split`'s sizes of `batch` rows in `m` parts (the first batch % m get one
    more): what every stage runs without `microbatch_sizes` (`pipecc.runtime.ports.split_sizes`)."""
    return [batch // m + (1 if i < batch % m else 0) for i in range(m)] if m > 0 else []


def unequal(plan: Plan) -> bool:
    """Per-stage micro-batch sizes other than the equal split (UMPIPE in use)."""
    sizes = plan.microbatch_sizes
    if sizes is None:
        return False
    even = equal_split(plan.batch_size, plan.microbatches) if plan.microbatches <= plan.batch_size else None
    return any(list(row) != even for row in sizes)


def stages_per_device(plan: Plan) -> int:
    """The most stages one device holds (virtual stages, or a plan reusing a device)."""
    held: dict[int, int] = {}
    for s in plan.stages:
        held[s.device] = held.get(s.device, 0) + 1
    return max([plan.virtual_stages, *held.values()])


def recomputing(plan: Plan) -> list[int]:
    """The stages that recompute their activations (`StagePlan.recompute`)."""
    return [s.index for s in plan.stages if s.recompute]


def bipartition_on(plan: Plan) -> bool:
    """Separate forward/backward cuts in a training plan, or a Bi-Partition mode other than
    "ship" asked for (an inference folder runs the forward ranges, so they are off there)."""
    return training(plan) and (plan.is_bipartition() or plan.bipartition_mode not in ("", "ship"))
