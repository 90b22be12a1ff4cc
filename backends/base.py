"""The backend interface: what the driver asks of every target (torch, FPGA).

    capabilities, module_capabilities      what its compiled folder's / drop-in module's runtime
                                           executes (the technique rules ask them)
    check(graph, plan, stages, target)     fail now, before any file is written
    writers(graph, plan, stages, target)   what the backend adds to the compiled folder
    notes(plan, out)                       lines to print after `pipecc compile`
    module(model, graph, plan, stages, target)
                                           the in-process drop-in module (`pipecc.compile`)

The compiled folder itself is the torch backend's (`pipecc.backends.torch.write_output`): a
readable `stage.py`, weights and ports for every stage, FPGA stages included (their weights
and the reference `pipecc csim` compares with). Another backend adds its files through its
writers, each called with the complete temporary folder before it replaces OUT.

Which backends a plan needs is the driver's choice (`pipecc.driver.backends_for`): torch
always, FPGA when `Plan.fpga_stages()` is non-empty. The last one chosen builds the drop-in
module, since it is the one that can run every stage (the FPGA backend runs torch stages too).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from torch import nn

from pipecc.ir.graph import AnnotatedGraph
from pipecc.ir.plan import Plan
from pipecc.techniques import capabilities as caps

Writer = Callable[[Path], None]  # called with the compiled folder being written


@dataclass(frozen=True)
class Target:
    """What a backend needs beyond the graph, the plan and the cut stages."""

    example_inputs: tuple | None = None   # the model's inputs (None: an ONNX file's; made up)
    number: str = "float"                  # FPGA stages' number format
    fpga_dir: Path | None = None           # where pipecc.compile keeps HLS projects (None: temp)
    devices: Sequence[str] | None = None   # where each stage runs in this process


class Backend(ABC):
    """One target of code generation; see the module docstring for the calls."""

    name: str
    # what the runtime of this backend's compiled folder / drop-in module executes
    # (`pipecc.techniques.capabilities`); the techniques' `requires` query them
    capabilities: frozenset[str] = caps.COMPILED_FOLDER
    module_capabilities: frozenset[str] = caps.IN_PROCESS

    @abstractmethod
    def check(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any], target: Target) -> None:
        """Raise (a PipeccError the user can act on) if the plan cannot be generated."""

    @abstractmethod
    def writers(self, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
                target: Target) -> list[Writer]:
        """What this backend adds to the compiled folder ([] for nothing)."""

    @abstractmethod
    def notes(self, plan: Plan, out: str | Path | None = None) -> list[str]:
        """Lines to print after compiling into `out` ([] for none)."""

    @abstractmethod
    def module(self, model: nn.Module, graph: AnnotatedGraph, plan: Plan, stages: Sequence[Any],
               target: Target) -> nn.Module:
        """The drop-in module over `model`'s own parameters, running every stage."""
