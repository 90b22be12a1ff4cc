"""The Python API (CONTRACT §7): `pipecc.compile` and `pipecc.load`.

    pm = pipecc.compile(model, example_inputs, "cpu,cpu")   # a drop-in nn.Module
    loss_fn(pm(x), y).backward()                              # same grads on model's params
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from pipecc import driver
from pipecc.devices import Cluster, parse_devices
from pipecc.errors import UsageError
from pipecc.runtime.local import PipelinedModule, load  # noqa: F401  (re-exported)


def torch_devices(cluster: Cluster, order: Sequence[int] | None = None) -> list[str]:
    """Where each stage runs in this process: the `@PLACE` given, else cuda:i / cpu."""
    out = []
    gpus = torch.cuda.device_count()
    for i, dev in enumerate(cluster.devices if order is None else [cluster.devices[j] for j in order]):
        if dev.placement:
            out.append(dev.placement)
        elif dev.kind == "gpu" and gpus:
            out.append(f"cuda:{i % gpus}")
        else:
            out.append("cpu")
    return out


def compile(model: torch.nn.Module, example_inputs: Any, devices: str | Sequence[str],  # noqa: A001
            **plan_options: Any) -> PipelinedModule:
    """Plan `model` over `devices` and return the drop-in PipelinedModule.

    `plan_options` are those of `pipecc.driver.plan` (microbatches, schedule, coarse,
    choose_order, split_layers). The model's parameters are shared, not copied: an optimizer
    built on `model.parameters()` before wrapping keeps working.
    """
    from pipecc.backends.torch import cut_stages, pipelined_module
    inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    cluster = parse_devices(devices) if not isinstance(devices, Cluster) else devices
    graph = driver.analyze_module(model, inputs, model_name=type(model).__name__)
    plan, graph = driver.plan(graph, cluster, **plan_options)
    stages = cut_stages(graph, plan.stage_of())
    order = [d.get("given_index", i) for i, d in enumerate(plan.devices)]
    placement = torch_devices(cluster, order)
    pm = pipelined_module(model, stages, microbatches=plan.microbatches,
                          devices=[placement[s.device] for s in plan.stages])
    pm.plan = plan  # type: ignore[attr-defined]  # for inspection: pm.plan.stages, ...
    return pm


