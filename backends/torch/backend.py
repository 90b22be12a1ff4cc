"""The torch backend behind the driver's `Backend` interface.

Its files are the compiled folder itself (`write_output`: a readable `stage.py`, weights and
ports for every stage, which the driver writes with every backend's writers), so it adds no
writer; its notes are the techniques' (their codegen parts' `notes`: a Bi-Partition saved-tensor
payload far from the plan's figure). Placement was already checked when the stages were cut
(`cut_stages`), and `check` refuses in-place writes the stages cannot reproduce
(`inplace.check_in_place`) and what only a technique's generated code shows (their `check`).
Its drop-in module runs the stage GraphModules over the model's own parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from torch import nn

from pipecc.backends.base import Backend, Target, Writer
from pipecc.backends.torch.compile import pipelined_module
from pipecc.techniques import hooks
from pipecc.backends.torch.inplace import check_in_place
from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps


class TorchBackend(Backend):
    name = "torch"
    capabilities = caps.COMPILED_FOLDER  # `pipecc run`: one process per rank
    module_capabilities = caps.IN_PROCESS  # every stage in one process: no stash moves between ranks

    def check(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any], target: Target) -> None:
        # NOTE: the techniques' scope (replicas, Bi-Partition, ...) the driver asked already
        # (`pipecc.techniques.requires` with this backend's capabilities)
        check_in_place(graph, stages)  # in-place writes to received values the stages can make
        for check in hooks("codegen", "check"):  # a technique's generated code (Bi-Partition's pieces: tied weights, boundaries)
            check(graph, plan)
        return None  # every graph node has a torch form; cut_stages checked the placement

    def writers(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
                target: Target) -> list[Writer]:
        return []

    def notes(self, plan: Plan, out: str | Path | None = None) -> list[str]:
        # a technique's words on what it wrote (Bi-Partition: a traced saved-tensor payload far
        # from the plan's figure; a note only)
        return [note for notes in hooks("codegen", "notes") for note in notes(plan, out)] if out is not None else []

    def module(self, model: nn.Module, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
               target: Target) -> nn.Module:
        return pipelined_module(model, stages, microbatches=plan.microbatches, devices=target.devices,
                                recompute=[s.recompute for s in plan.stages],
                                precision=plan.options.get("precision", "fp32"))
