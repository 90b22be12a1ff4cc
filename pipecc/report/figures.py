"""Figures read off a plan that several views show: the bottleneck stage (`pipecc plan`,
`pipecc inspect`, report.html), each device's memory capacity, a stage's first and last node,
which stages recompute their activations, Bi-Partition's forward/backward ranges."""

from __future__ import annotations

from typing import Any

from pipecc.ir.plan import Plan, cost_basis  # noqa: F401  (cost_basis: the views import it from here)


def bottleneck_stage(plan: Plan) -> int:
    """The stage with the most fwd + bwd + comm per micro-batch (as `pipecc plan` marks it)."""
    return max(range(len(plan.stages)),
               key=lambda i: plan.stages[i].forward_s + plan.stages[i].backward_s + plan.stages[i].comm_s)


BOTTLENECK_WITH_COMM = "communication overlapped as the runtime sends"


def bottleneck_note(plan: Plan) -> str:
    """What `bottleneck_s` is, beside the sum of the bottleneck stage's own figures: the plan's
    bottleneck is the pipeline's steady-state time per micro-batch with each transfer
    overlapping other micro-batches' compute (`passes.partition`), so it lies between that
    stage's fwd + bwd and its fwd + bwd + comm, which the stage bars and tables show.
    Every view prints this one line, so none shows one number unlabelled."""
    k = bottleneck_stage(plan)
    s = plan.stages[k]
    from pipecc.report.formatting import seconds
    return (f"{BOTTLENECK_WITH_COMM}; stage {k} alone: fwd + bwd {seconds(s.forward_s + s.backward_s)}, "
            f"fwd + bwd + comm {seconds(s.forward_s + s.backward_s + s.comm_s)}")


def device_capacities(plan: Plan, cluster: Any = None) -> list[float | None]:
    """Memory bytes of each plan device, as the planner counts a stage's memory against it:
    DRAM (or HBM) for CPUs and GPUs, on-chip BRAM for FPGA cards (`memory_kind`). From
    `cluster` if given, else the built-in catalog by name (None for a device the catalog does
    not know, e.g. one defined in a cluster file)."""
    if cluster is not None:
        return [_capacity(cluster.devices[d.get("given_index", i)].memory_bytes,
                          cluster.devices[d.get("given_index", i)].fpga)
                for i, d in enumerate(plan.devices)]
    from pipecc.targets.devices import load_catalog
    catalog = load_catalog()
    return [_capacity(catalog.devices[d["name"]]["memory_bytes"], catalog.devices[d["name"]].get("fpga"))
            if d.get("name") in catalog.devices else None for d in plan.devices]


def memory_kind(device: dict[str, Any]) -> str:
    """What a device's stage memory is: "BRAM" for an FPGA card (on-chip), else "DRAM"."""
    return "BRAM" if device.get("kind") == "fpga" else "DRAM"


def _capacity(memory_bytes: float, fpga: Any) -> float:
    if fpga and fpga.get("bram18"):
        from pipecc.targets.fpga_timing import BRAM18_BYTES
        return float(fpga["bram18"]) * BRAM18_BYTES
    return float(memory_bytes)


def first_last(nodes: list[str]) -> tuple[str, str]:
    """A stage's first and last node names, ("-", "-") for a stage without nodes."""
    return (nodes[0], nodes[-1]) if nodes else ("-", "-")
